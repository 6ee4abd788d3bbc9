"""The bisect: from "the texts differ" to the first bad token, layer, module and op.

  1. token   per-step logits of both dumps -> first mismatching token, first bad token (tokens.py)
  2. step    the step to replay: the first step whose logits fail, else the first differing token,
             else the prefill and the first decode step; a decode step is replayed with the golden
             KV cache (golden.py)
  3. module  isolation replay of every module of the TARGET on the GOLDEN inputs at that step
             (replay.py) -> own errors, ranked against the same module in the other layers
             (rank.py); where nothing stands out at a decode step, the prefill is replayed too
             (a fault there reaches later steps through the cache it wrote). A target that cannot
             be reloaded here (tensor-parallel ranks, an NPU graph) is isolated the other way: the
             GOLDEN module on the TARGET's dumped inputs, rank by rank (target_dump.py, ``isolate``)
  4. op      the chosen module replayed op by op on both sides (ops.py); in fused experts, the
             expert (moe.py); the first bad op's tensors are kept for the report
  4b. steps  the chosen module's own error at each step from the prefill on (own_error_steps),
             beside the median of the same module in the other layers
  5. cost    bytes dumped and model runs, against a full API-level dump of both sides (cost.py)
  6. verdict pass / fail / inconclusive, with what the evidence covers (conclude.py)

Nothing is re-dumped to disk: replay reads the golden dump or re-runs the golden model and keeps
its captures in memory.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from statistics import median
from typing import Any

import torch

from llmflow.compare.align import steps_text
from llmflow.compare.divergence import input_difference
from llmflow.compare.mappings import Mapping, load_mapping
from llmflow.compare.run import recorded_dtype, recorded_quantization
from llmflow.compare.thresholds import coarser
from llmflow.dtypes import (
    DEFAULT_THRESHOLDS,
    OP_ERROR_FLOOR,
    dtype_class,
    dtype_name,
    quantization_dtype,
    torch_dtype,
)
from llmflow.dump.memory import Call
from llmflow.errors import UserError
from llmflow.formats import open_dump
from llmflow.formats.base import DumpReader
from llmflow.localize import cost as cost_mod
from llmflow.localize import dtype_baseline, moe, rounding
from llmflow.localize import ops as ops_mod
from llmflow.localize.calls import NO_INPUTS, calls_from_dump, cast_inputs
from llmflow.localize.conclude import (
    KV_CACHE,
    StepReplay,
    below_notice,
    conclude,
    expert_of_tokens,
    shared_error,
    stands_out,
)
from llmflow.localize.golden import (
    dump_has_layer_inputs,
    golden_call,
    golden_calls,
    golden_layer_steps,
    golden_rerun,
    golden_rerun_steps,
    rerun_fidelity,
)
from llmflow.localize.handed_down import first_handed_down
from llmflow.localize.options import BisectInputs
from llmflow.localize.own_error import relative_to_update, update_errors, update_norm
from llmflow.localize.rank import pick_candidate, rank_modules, set_aside
from llmflow.localize.replay import is_branch, replay_call, replay_modules
from llmflow.localize.target_dump import (
    golden_input_shapes,
    golden_names,
    layer_updates,
    module_entries,
    outside_layer_rows,
    raw_errors_joined,
    replay_target_dump,
    rounding_of,
    target_routing,
)
from llmflow.localize.tokens import (
    failing_steps,
    first_bad_step,
    first_mismatch,
    greedy_ids,
    logits_entries,
    token_rows,
)
from llmflow.models import logits_of, resolve_dtype
from llmflow.quantized import NormBias, QuantAccount, UnfusedExperts, W8A8Linear, unsmooth
from llmflow.results.verdict import (
    FIRST_BAD_OP_FILE,
    Cost,
    DtypeBaseline,
    HandedDown,
    ModelRuns,
    OpRow,
    OpTensors,
    OwnErrorStep,
    OwnErrorSteps,
    TeacherForced,
    TokenRow,
    Verdict,
)
from llmflow.streamed import layer_weights_held
from llmflow.structure import LayerStack, find_layer_stack, layer_of

#: the most a golden that loads whole only may take in the target's dtype for the dtype baseline,
#: loaded beside the target (a golden stored as safetensors is streamed: one layer at a time)
BASELINE_WHOLE_LIMIT = 16 << 30
#: other layers' copies of the chosen module replayed per step for the reference median
OWN_ERROR_PEERS = 8
#: a module holding quantized Linear layers whose error their quantization explains carries theirs
#: where its own error is within this many times their root sum of squares (an attention whose
#: o_proj clips: 1.0x; an honest smoothed MLP's: 1.1x; a fault in the module's own code adds its own
#: error on top)
QUANT_CARRIED = 1.5

Progress = Callable[[str, float | None], Any]

#: the phases isolation from the target's dump cannot run, and why (the verdict's ``skipped``)
NEEDS_TARGET_MODEL = {
    "op_level": "the op level replays the chosen module op by op on both sides: it needs the target model",
    "own_error_steps": "the own error per step replays the target module at each step: it needs the target "
                       "model",
    "cost_estimate": "the full API-dump estimate runs both models: it needs the target model",
}


def isolation_mode(inp: BisectInputs, target_dump: DumpReader) -> str:
    """``target_model`` or ``target_dump`` (``isolate``; auto: the dump when it has more than one
    rank or no target model is given); UserError naming the field when the choice cannot run."""
    mode = inp.isolate
    if mode not in ("auto", "target_model", "target_dump"):
        raise UserError(f"isolate: {mode!r} is not one of auto, target_model, target_dump")
    if mode == "auto":
        mode = "target_dump" if not inp.target_spec or len(target_dump.ranks()) > 1 else "target_model"
    if mode == "target_model" and not inp.target_spec:
        raise UserError("isolate: target_model needs the target model (target_model_spec); "
                        "isolate: target_dump needs none")
    return mode


def _load(spec: dict[str, Any]) -> Any:
    from llmflow.models import load_model

    keys = ("device", "dtype", "patch", "base_dir")
    return load_model(spec["model"], **{k: spec[k] for k in keys if spec.get(k) is not None})


def _notes(target: Any, golden: Any) -> str | None:
    """What a user must know about the models the bisect ran (``LoadedModel.note``), the golden's
    said as the golden's (an msModelSlim checkpoint given as the golden)."""
    said = [getattr(target, "note", None)]
    note = getattr(golden, "note", None)
    if note:
        said.append(f"The golden is {note[:1].lower()}{note[1:]}")
    return " ".join(n for n in said if n) or None


def golden_streamed(inp: BisectInputs) -> bool:
    """Whether the golden is loaded streamed (``golden_weights``); UserError naming the field when
    ``streamed`` is asked of a golden that cannot be (no safetensors checkpoint, or a patch)."""
    from llmflow.models import checkpoint_dir, is_quantized_checkpoint

    spec, mode = inp.golden_spec, inp.golden_weights
    if mode not in ("auto", "whole", "streamed"):
        raise UserError(f"golden_weights: {mode!r} is not one of auto, whole, streamed")
    if mode == "whole":
        return False
    why = None
    if spec.get("patch"):
        why = "it has a patch, which may rewrite weights that are read only while their layer runs"
    else:
        try:
            if is_quantized_checkpoint(spec["model"], spec.get("base_dir") or "."):
                why = "it is an msModelSlim checkpoint, whose quantized layers are built whole"
            elif checkpoint_dir(spec["model"], spec.get("base_dir") or ".") is None:
                why = "it has no safetensors checkpoint (smollm2 or a Hugging Face directory)"
        except UserError as exc:  # auto: the whole load reports it, as the golden's load error
            why = str(exc)
    if why and mode == "streamed":
        raise UserError(f"golden_weights: streamed cannot load the golden model {spec['model']!r}: {why}")
    return why is None


def _load_streamed(spec: dict[str, Any], layers: str | None) -> Any:
    from llmflow.streamed import load_streamed

    keys = ("device", "dtype", "base_dir")
    given = {k: spec[k] for k in keys if spec.get(k) is not None}
    return load_streamed(spec["model"], layers=layers, **given)


def target_dump_dtype(reader: DumpReader) -> str:
    """The dtype the target computed in: the model dtype its dump records (env.json), else its
    first module output's; float32 when the dump names none."""
    recorded = recorded_dtype(reader)
    if recorded:
        return recorded
    outputs = (e for e in reader.entries() if e.level == "module" and e.kind == "output" and e.dtype)
    found = next(outputs, None)
    return dtype_name(found.dtype) if found is not None else "float32"


def dumps_made_as_specs(inp: BisectInputs, golden: DumpReader, target: DumpReader, isolation: str) -> bool:
    """Whether the two dumps were made as the model specs say, so that what the specs are (the
    golden model itself in another dtype: ``conclude.golden_in_another_dtype``) speaks for the
    target's dump: the target model replayed (not its dump alone), one rank, no quantized model, and
    each dump's recorded device and dtype (env.json) those of its spec, on one device."""
    if isolation != "target_model" or inp.target_spec is None or len(target.ranks()) > 1:
        return False
    if recorded_quantization(golden) or recorded_quantization(target):
        return False
    recorded = []
    for reader, spec in ((golden, inp.golden_spec), (target, inp.target_spec)):
        settings = (reader.env() or {}).get("torch_settings") or {}
        device, dtype = settings.get("model_device"), recorded_dtype(reader)
        if not isinstance(device, str) or dtype != dtype_name(spec.get("dtype") or "float32"):
            return False
        recorded.append(device)
    return recorded[0] == recorded[1]


class _Bisect:
    """One bisect's state: the dumps, the models (the golden loaded on first need), the timings."""

    def __init__(self, inp: BisectInputs, log: Callable[[str], None], progress: Progress | None):
        self.inp, self.log, self.progress = inp, log, progress
        self.t0 = time.time()
        self.mark = self.t0
        self.phases: dict[str, float] = {}
        self.golden_dump, self.target_dump = open_dump(inp.golden_dump), open_dump(inp.target_dump)
        self.isolation = isolation_mode(inp, self.target_dump)
        # the compare's mapping file, read the compare's way (a bad one: UserError naming the file)
        self.mapping: Mapping | None = None
        if inp.mapping and self.isolation == "target_dump":
            self.mapping = load_mapping(inp.mapping).bind(self.target_dump)
        self.golden_streamed = golden_streamed(inp)
        self.held: dict[str, Any] = {}
        self.golden_error: str | None = None  # why the golden model could not be loaded
        self.target: Any = None  # the target model (isolation target_model only)
        if self.isolation == "target_model":
            self.target = _load(inp.target_spec)  # type: ignore[arg-type]
            self.phase("load target model")
            structure = self.target.model
            self.unsmooth_target()
        else:  # the golden model gives the module tree: the target's modules carry its names
            golden = self.golden()
            if golden is None:  # the only model this isolation runs: a spec that cannot load is bad input
                raise UserError(f"golden_model_spec: the golden model cannot be loaded: {self.golden_error}")
            self.phase("load golden model")
            structure = golden.model
        self.stack: LayerStack | None = find_layer_stack(structure, inp.layers)
        self.stats: dict[str, int] = {"recomputed_layers": 0, "golden_reruns": 0, "own_error_replays": 0}
        self.op_tensors: dict[str, Any] = {}  # the first bad op's tensors (ops.op_tensors)
        self.op_tensors_info: OpTensors | None = None
        self.golden_checked: set[str] = set()  # modules check_golden_model ran (each once)
        self.forced_logits: torch.Tensor | None = None  # the target's on the golden's tokens (teacher_forced)
        if self.isolation == "target_dump":
            self.check_golden_model()

    def unsmooth_target(self) -> None:
        """A quantized target smoothed by msModelSlim's anti-outlier divides each norm's weight by a
        scale its Linear layers took on: a module replayed alone on the golden's inputs would see
        inputs the target never has. The smoothing is moved into the Linear layers that read each
        norm (``quantized.unsmooth``), the target computing what it did; where it cannot be, the
        verdict's note says the modules reading a smoothed norm are not comparable alone."""
        tgt = self.target
        smoothed = [n for n, m in tgt.model.named_modules() if isinstance(m, NormBias)]
        if not smoothed:
            return
        golden = self.golden()
        weights: dict[str, torch.Tensor] = {}
        if golden is not None and not self.golden_streamed:
            params = dict(golden.model.named_parameters())
            weights = {n: params[f"{n}.weight"].detach() for n in smoothed if f"{n}.weight" in params}
        elif golden is not None:  # streamed: the norms' weights from the golden's checkpoint
            from llmflow.models import checkpoint_dir
            from llmflow.safetensors_files import SafetensorsFiles

            spec = self.inp.golden_spec or {}
            files = SafetensorsFiles(checkpoint_dir(spec["model"], spec.get("base_dir") or "."))  # type: ignore[arg-type]
            weights = {n: files.read(f"{n}.weight") for n in smoothed if f"{n}.weight" in files}
        ids = torch.tensor([list(self.inp.prompt_ids)[:32] or [0]], device=tgt.device)
        tolerance = max(1e-4, 10 * OP_ERROR_FLOOR.get(dtype_name(tgt.dtype), 1e-6))
        moved = unsmooth(tgt.model, weights, lambda: logits_of(tgt.model(input_ids=ids)), tolerance)
        if len(moved) == len(smoothed):
            self.log(f"bisect: the target's anti-outlier smoothing ({len(moved)} norms) moved into the "
                     "Linear layers that read them: each module replays on the golden's inputs")
            return
        left = [n for n in smoothed if n not in moved]
        tgt.note = ((tgt.note + " ") if tgt.note else "") + (
            f"Its anti-outlier smoothing could not be moved into the Linear layers after {len(left)} norm(s) "
            f"({left[0]}, ...): the modules reading them see smoothed inputs in the target, so their own "
            "error replayed on the golden's inputs is not theirs alone; the decoder layers' errors are.")

    def check_golden_model(self, module: str | None = None) -> None:
        """The golden model must be the one that made the golden dump: every own error from the
        target dump is measured against it. ``module`` (default: the first decoder layer; before
        a verdict names a module, its layer), run on the golden dump's own recorded inputs at the
        first step that holds them, must give the recorded output within the dump dtype's fail
        limit (the same model recomputes it to rounding); UserError naming the field otherwise.
        Skipped where the golden dump holds no inputs of it."""
        if module is None and (self.stack is None or not self.stack.layers):
            return
        name = module or self.stack.layers[0]  # type: ignore[union-attr]
        if name in self.golden_checked:
            return
        self.golden_checked.add(name)
        steps = sorted({e.step for e in self.golden_dump.entries()
                        if e.name == name and e.kind == "input" and e.level == "module"})
        if not steps:
            return
        golden = self.held["golden"]
        rows = list(replay_target_dump(golden, self.golden_dump, self.golden_dump, golden_step=steps[0],
                                       target_step=steps[0], select=lambda n, _m: n == name))
        error = rows[0].get("rel_l2") if rows and rows[0].get("replayable") else None
        dtype = recorded_dtype(self.golden_dump) or dtype_name(golden.dtype)
        limit = DEFAULT_THRESHOLDS[dtype_class(dtype)].get("relative_euclidean_distance", {}).get("fail")
        if error is not None and limit is not None and not error <= limit:
            raise UserError(
                f"golden_model_spec: the golden model does not reproduce the golden dump: {name}, run on "
                f"the golden dump's recorded inputs at step {steps[0]}, differs from its recorded output by "
                f"{error:.3g} (relative L2; the same model gives under {limit:g} in {dtype}): give the "
                "model, weights and config that made the golden dump")
        self.log(f"bisect: the golden model reproduces the golden dump ({name} at step {steps[0]}: "
                 f"{error:.2g} relative L2)" if error is not None else
                 f"bisect: the golden model was not checked against the golden dump ({name} not replayable)")

    def phase(self, name: str, detail: str = "") -> None:
        """The phase ``name`` ended: its seconds since the last phase add to ``phases``, and one
        console line says so (``detail`` in brackets), so a user sees what the bisect is doing."""
        now = time.time()
        seconds = now - self.mark
        self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 2)
        self.mark = now
        self.log(f"bisect: {name} done in {seconds:.1f} s" + (f" ({detail})" if detail else ""))

    def golden(self) -> Any:
        """The golden model, loaded on first use (layer recompute, decode re-run, op level, cost),
        whole or streamed layer by layer (``golden_weights``); None when it cannot be loaded
        (``golden_error`` says why: the verdict reports it)."""
        if "golden" not in self.held and self.golden_error is None:
            try:
                self.held["golden"] = self._load_golden()
                self.log(f"bisect: golden model loaded {self.golden_weights()}")
            except UserError as exc:
                if self.inp.golden_weights == "streamed":  # asked for: bad input, not a verdict
                    raise UserError(f"golden_weights: streamed cannot load the golden model: {exc}") from exc
                self.golden_error = str(exc)
        return self.held.get("golden")

    def _load_golden(self) -> Any:
        """Streamed where chosen; whole where ``auto`` chose streamed but the checkpoint's tensors
        are not the model's parameters as stored (transformers converts Mixtral's experts on load)."""
        spec = self.inp.golden_spec
        if self.golden_streamed:
            try:
                return _load_streamed(spec, self.inp.layers)
            except UserError as exc:
                if self.inp.golden_weights == "streamed":
                    raise
                self.log(f"bisect: the golden cannot be streamed ({exc}): loading it whole")
                self.golden_streamed = False
        return _load(spec)

    def golden_weights(self) -> str:
        return "streamed" if self.golden_streamed else "whole"

    def op_floor(self) -> float:
        """The error one correct op shows in the coarser of the dtypes the golden and the target
        compute in: an own error below it is rounding, never a fault (``rank_modules``)."""
        golden, target = self.held.get("golden"), self.target
        names = [dtype_name(target.dtype) if target is not None else target_dump_dtype(self.target_dump)]
        names += [dtype_name(golden.dtype)] if golden is not None else []
        return max(OP_ERROR_FLOOR.get(name, 0.0) for name in names)

    def select(self, name: str, module: Any) -> bool:
        return is_branch(name, module, self.stack)

    def decode(self, i: int) -> str:
        side = self.target if self.target is not None else self.held.get("golden")
        tok = side.tokenizer if side is not None else None
        return tok.decode([i]) if tok is not None else str(i)

    def target_step(self, golden_step: int) -> int:
        """The target's step paired with a golden step (the align stage's pairs; else the same)."""
        pair = next((p for p in self.inp.pairs or [] if p["golden_step"] == golden_step), None)
        return pair["target_step"] if pair else golden_step

    def handed_down(self, dtype: str) -> HandedDown | None:
        """Where no module stands out: the first module handed a keyword input its enclosing module
        was given otherwise (``handed_down.py``), over every step the golden dump holds (each dump
        against itself, so steps after the texts part count as well: rounding that parts them at
        the first token hides no decode-only change)."""
        steps = [(s, self.target_step(s)) for s in self.golden_dump.steps()]
        found = first_handed_down(self.golden_dump, self.target_dump, steps, self.mapping, dtype)
        self.phase("module: inputs handed down", f"{len(steps)} steps")
        if found is not None:
            self.log(f"bisect: {found.module} is handed a changed {found.input}: not the one "
                     f"{found.enclosing} was given, at step {found.step}")
        return found

    def expert_at_prefill(self, chosen: StepReplay) -> None:
        """A fused experts module named at a decode step from a target dump, whose expert that step
        does not tell (its one token reaches its top-k experts alike): the expert its tokens name at
        the prefill (``conclude.expert_of_tokens`` on its row there), kept as ``prefill_expert``."""
        cand = chosen.candidate
        if (self.isolation != "target_dump" or not chosen.anomalous or not cand or chosen.step == 0
                or not str(cand.get("module_type") or "").lower().endswith("experts")
                or cand.get("weight_expert") is not None
                or expert_of_tokens(cand) is not None):
            return
        name = cand["name"]
        rows = replay_target_dump(self.held["golden"], self.golden_dump, self.target_dump, golden_step=0,
                                  target_step=self.target_step(0), select=lambda n, _m: n == name,
                                  mapping=self.mapping)
        row = next((r for r in rows if r["name"] == name and r.get("replayable")), None)
        expert = expert_of_tokens(row) if row is not None else None
        if expert is not None:
            cand["prefill_expert"] = expert
            self.log(f"bisect: {name}: at the prefill its error is in the tokens routed to expert {expert}")

    def replay_from_target_dump(self, step: int, why: str) -> StepReplay:
        """Isolation from the target's dump at one step: the golden module on the target's inputs."""
        t_step = self.target_step(step)
        raw = raw_errors_joined(self.golden_dump, self.target_dump, step, t_step, self.mapping)
        result = StepReplay(step=step, why=why, raw=raw, source="target dump")
        golden = self.held["golden"]  # loaded when the bisect started (one that cannot load: bad input)
        modules = dict(golden.model.named_modules())
        names = {e.name for e in self.target_dump.entries() if e.step == t_step and e.level == "module"}
        known = golden_names(self.target_dump, t_step, modules, self.mapping)
        total = sum(1 for n in known.values() if self.select(n, modules[n]))
        task = self.progress(f"isolation from the target dump, step {step}", float(total)) \
            if self.progress else None
        layers = set(self.stack.layers) if self.stack is not None else set()

        @functools.cache
        def routing_found() -> Callable[[str], Any]:  # made once, where a layer is replayed whole
            return target_routing(golden, self.golden_dump, self.target_dump, t_step, layers,
                                  torch_dtype(target_dump_dtype(self.target_dump)))

        def routing(name: str) -> Any:
            return routing_found()(name)
        result.rows = list(replay_target_dump(golden, self.golden_dump, self.target_dump, golden_step=step,
                                              target_step=t_step, select=self.select,
                                              advance=task.advance if task is not None else None,
                                              mapping=self.mapping, routing=True))
        layers_whole = not result.rows and bool(layers & set(known.values()))
        if layers_whole:  # the decoder layers and nothing inside them (module_list auto): the rows
            task = self.progress(f"decoder layers replayed whole, step {step}", float(len(layers))) \
                if self.progress else None
            updates = self.layer_updates(step, t_step, known)
            with moe.routing_forced(golden.model, layers, routing):
                rows = [relative_to_update(r, updates.get(r["name"])) for r in replay_target_dump(
                    golden, self.golden_dump, self.target_dump, golden_step=step, target_step=t_step,
                    select=lambda n, _m: n in layers, advance=task.advance if task is not None else None,
                    mapping=self.mapping)]
            layers_whole = any(r.get("replayable") for r in rows)  # none: their outputs alone, said below
            for r in rows:  # ranked against its update alone as well (rank._update_scores)
                if r["name"] in updates:
                    r["update"] = updates[r["name"]]
            result.rows = rows if layers_whole else []
        if self.stack is not None and result.rows:  # a dump of the decoder layers alone: their ends too
            ends, notes = outside_layer_rows(golden, self.golden_dump, self.target_dump, golden_step=step,
                                             target_step=t_step, stack=self.stack, held=known)
            result.rows += ends
            result.ends_not_replayed = notes
            for note in notes:
                self.log(f"bisect: outside the decoder layers, not replayed: {note}")
        unknown = sorted(names - set(known), key=lambda n: (n.count("."), n))
        in_layers = [r for r in result.rows if layer_of(r["name"], self.stack) is not None]
        if not in_layers and unknown:  # a port that renamed its modules: its final norm or lm_head at most
            by = f" nor one the mapping {self.mapping.name}'s rules give" if self.mapping else ""
            result.missing = (f"no module inside the golden's decoder layers is among the target dump's "
                              f"at step {t_step}: {len(unknown)} of its {len(names)} module names (e.g. "
                              f"{unknown[0]}) are no module of the golden model{by}")
            result.missing_next = ("give the compare's mapping file whose rules map the target's module "
                                   "names to the golden's (mapping: FILE; regex captures carry the rest of a "
                                   "name)")
        elif not names and (held := sorted({e.step for e in self.target_dump.entries()
                                            if e.level == "module" and e.step >= 0})):
            # a token range that left the step out: the dump holds other steps' modules
            result.missing = (f"the target dump holds no module at step {t_step}: it was dumped at "
                              f"step{'s' if len(held) > 1 else ''} {steps_text(held)} only (its token range)")
            result.missing_next = (f"dump both sides again with step {t_step} in the token range (DumpConfig "
                                   f"token_range, msprobe step), or bisect one of the steps the dumps hold "
                                   f"(replay_step: {held[-1]})")
        elif not result.rows:
            result.missing = (f"the target dump holds no calls of the modules inside the decoder layers at "
                              f"step {t_step}" + (f", only {len(names)} other module(s)" if names else "")
                              + " (dump the target in module mode with inputs and outputs: tensor_part 2)")
        elif not result.replayed and not any(e.has_data for e in self.target_dump.entries()
                                             if e.step == t_step and e.level == "module" and e.is_tensor):
            result.missing = (f"the target dump holds statistics alone at step {t_step}: a module's own "
                              "error needs the tensors it received and returned")
            result.missing_next = ("dump the target again with tensors (DumpConfig data_mode tensor or "
                                   "msprobe task tensor, module mode with inputs and outputs: tensor_part 2) "
                                   "and bisect again")
        elif not result.replayed and all(r.get("reason") == NO_INPUTS for r in result.rows):
            result.missing = (f"the target dump holds no module inputs at step {t_step} (dump the target "
                              "in module mode with tensor_part 2)")
        self.rank(result, result.replayed, "module: isolation from the target dump",
                  f"target dump, {len(self.target_dump.ranks())} rank(s)")
        self.set_aside_rounding(result, self.rounding_in_dump(step, t_step, known))
        if result.replayed and not result.anomalous and self.stack is not None and not layers_whole:
            # no module stands out: what a layer does between its modules (its own code, or a change to
            # what a module receives) shows only in the layer replayed whole
            task = self.progress(f"decoder layers replayed whole, step {step}", float(len(layers))) \
                if self.progress else None
            # the target's recorded routing forced into the golden routers: near-tied experts its
            # rounding routed elsewhere are not the layer's own error
            with moe.routing_forced(golden.model, layers, routing):
                whole = list(replay_target_dump(golden, self.golden_dump, self.target_dump, golden_step=step,
                                                target_step=t_step, select=lambda n, _m: n in layers,
                                                advance=task.advance if task is not None else None,
                                                mapping=self.mapping))
            updates = self.layer_updates(step, t_step, known)
            result.layer_errors = {r["name"]: relative_to_update(r, updates.get(r["name"]))["rel_l2"]
                                   for r in whole if r.get("replayable")}
            result.layer_update_errors = update_errors(whole, updates)
            self.phase("module: decoder layers replayed whole", f"{len(result.layer_errors)} layers")
        return result

    def rounding_in_dump(self, step: int, t_step: int,
                         known: dict[str, str]) -> Callable[[str], dict[str, Any] | None]:
        """The golden module's own rounding row in the target dump's dtype, on the target's recorded
        inputs at ``t_step`` (golden ``step``; ``target_dump.rounding_of``); ``known``: target name ->
        golden name."""
        golden, dtype = self.held["golden"], torch_dtype(target_dump_dtype(self.target_dump))
        target_names = {g: t for t, g in known.items()}

        @functools.cache
        def read() -> tuple[dict[str, Any], dict[str, Any], dict[tuple[str, str], list[int]]]:
            # (the dumps' indexes read once for every candidate checked, and only where one is)
            return (dict(golden.model.named_modules()), module_entries(self.target_dump, t_step),
                    golden_input_shapes(self.golden_dump, step))

        def reference(name: str) -> dict[str, Any] | None:
            target_name = target_names.get(name)
            if target_name is None or dtype == golden.dtype:
                return None
            modules, entries, shapes = read()
            module, by_rank = modules.get(name), entries.get(target_name)
            if module is None or not by_rank:
                return None
            if rounding.copy_bytes(module, dtype) > rounding.ROUNDING_COPY_LIMIT:
                return None
            return rounding_of(name, module, by_rank, self.target_dump, golden, t_step, shapes, dtype,
                               target_name=target_name)
        return reference

    def layer_updates(self, step: int, t_step: int, known: dict[str, str]) -> dict[str, float]:
        """Decoder layer -> what it adds to the residual stream at the step: the golden dump's
        layer where it holds the layer's input and output, else the target dump's (whose inputs a
        replay from it needs anyway)."""
        layers = set(self.stack.layers) if self.stack is not None else set()
        updates = layer_updates(self.golden_dump, step, {n: n for n in layers})
        missing = {g: t for t, g in known.items() if g in layers and g not in updates}
        return {**layer_updates(self.target_dump, t_step, missing), **updates} if missing else updates

    def rank(self, result: StepReplay, replayed: list[dict[str, Any]], phase: str, source: str) -> None:
        """Rank the step's own errors, pick its candidate, end the phase and say what came out."""
        result.op_floor = self.op_floor()
        result.ranked = rank_modules(replayed, ratio_threshold=self.inp.ratio_threshold, stack=self.stack,
                                     op_floor=result.op_floor)
        result.candidate = pick_candidate(result.ranked)
        self.phase(f"{phase} (step {result.step})", f"{len(result.rows)} modules")
        cand = result.candidate
        self.log(f"bisect: step {result.step} ({source}): replayed {len(result.replayed)} of "
                 f"{len(result.rows)} modules; top candidate {cand['name'] if cand else None} "
                 f"(score {cand['score'] if cand else float('nan'):.2f})")

    # -- 3. one step's isolation replay --------------------------------------------------------
    def outside_calls(self) -> dict[str, Call]:
        """The golden's prefill calls of the modules outside the decoder layers that the golden
        dump lacks (the embedding, the final norm, lm_head, a rotary embedding): a port breaks
        there too, and a dump of the decoder layers alone holds none of their inputs. One golden
        prefill re-run captures them; none where the golden cannot load or no prompt is known."""
        if self.stack is None or not self.inp.prompt_ids or not self.inp.golden_ids:
            return {}
        dumped = {e.name for e in self.golden_dump.entries() if e.step == 0 and e.level == "module"}
        golden = self.golden()
        if golden is None:
            return {}

        def outside(name: str, module: Any) -> bool:
            return layer_of(name, self.stack) is None and name not in dumped and self.select(name, module)

        if not any(outside(n, m) for n, m in golden.model.named_modules() if n):
            return {}
        rerun = golden_rerun(golden, self.inp.prompt_ids, self.inp.golden_ids, 0, outside)
        self.stats["golden_reruns"] += 1
        return rerun.calls

    def replay_step(self, step: int, why: str) -> StepReplay:
        if self.isolation == "target_dump":
            return self.replay_from_target_dump(step, why)
        inp, tgt = self.inp, self.target
        raw = raw_errors_joined(self.golden_dump, self.target_dump, step, step)
        result = StepReplay(step=step, why=why, raw=raw)
        if step == 0 and dump_has_layer_inputs(self.golden_dump, 0):
            before = self.stats["recomputed_layers"]
            outside = self.outside_calls()
            calls: Any = itertools.chain(
                golden_calls(self.golden_dump, 0, self.golden, self.stats, self.stack, self.select),
                outside.values())
            result.call_of = lambda name: outside.get(name) or golden_call(self.golden_dump, 0, name,
                                                                            self.golden, self.stack)
        else:
            if not inp.prompt_ids or len(inp.golden_ids) <= step:
                result.missing = (f"step {step} cannot be replayed: the golden generation file lacks "
                                  "the prompt's token ids or the tokens up to that step")
                return result
            golden = self.golden()
            if golden is None:
                result.missing = (f"the golden model cannot be loaded to re-run step {step}: "
                                  f"{self.golden_error}")
                return result
            layers = set(self.stack.layers) if self.stack is not None else set()
            # the decoder layers' calls too: replayed whole where no module stands out
            rerun = golden_rerun(golden, inp.prompt_ids, inp.golden_ids, step,
                                 lambda n, m: n in layers or self.select(n, m))
            self.stats["golden_reruns"] += 1
            result.rerun_diff = rerun_fidelity(rerun, self.golden_dump)
            calls = [c for n, c in rerun.calls.items() if n not in layers]
            layer_calls = [c for n, c in rerun.calls.items() if n in layers]
            result.call_of = rerun.calls.get
            before = None
        n_modules = sum(1 for n, m in tgt.model.named_modules() if n and self.select(n, m))
        task = self.progress(f"isolation replay, step {step}", float(n_modules)) if self.progress else None
        result.rows = replay_modules(tgt.model, calls, device=tgt.device, dtype=tgt.dtype, select=self.select,
                                     stack=self.stack, advance=task.advance if task is not None else None)
        if before is None:
            result.source = "golden re-run"
        else:
            result.source = "dump + layer recompute" if self.stats["recomputed_layers"] > before else "dump"
        replayed = [r for r in result.rows if r.get("replayable")]
        if not replayed and self.golden_error:
            result.missing = (f"the golden model cannot be loaded to recompute the layers' modules at step "
                              f"{step}: {self.golden_error}")
        replayed += result.cache_writes  # what each attention wrote into its KV cache, ranked alike
        result.routing = moe.routing_divergences(result.rows, step, self.decode_position(step))
        self.rank(result, replayed, "module: isolation replay", result.source)
        self.set_aside_rounding(result, self.rounding_in_target(result))
        self.set_aside_quantization(result)
        if replayed and not result.anomalous and self.stack is not None:
            if before is not None:  # the prefill from the dump: its decoder layers' recorded calls
                layer_calls = calls_from_dump(self.golden_dump, step, names=set(self.stack.layers))
            self.replay_layers_whole(result, layer_calls)
        return result

    def set_aside_rounding(self, result: StepReplay,
                           reference: Callable[[str], dict[str, Any] | None]) -> None:
        """Check the step's candidate against the golden module's own rounding in the target's dtype
        (``reference(name)``: its row, None where it cannot be had; ``rounding.py``): one whose own
        error is within ``ratio_threshold`` times that is set aside (``result.rounding``) and the
        next candidate checked, up to ``ROUNDING_CHECKED``. Overflows stand whatever the rounding."""
        tgt = self.target
        dtype = dtype_name(tgt.dtype) if tgt is not None else target_dump_dtype(self.target_dump)
        for _ in range(rounding.ROUNDING_CHECKED):
            cand = result.candidate
            if not cand or not cand.get("anomalous") or cand.get("overflow"):
                return
            row = reference(cand["name"].removesuffix(KV_CACHE))
            ratio = rounding.to_rounding(cand, row, kv_cache=cand["name"].endswith(KV_CACHE)) if row else None
            cand["rounding_ratio"] = ratio
            if ratio is None or ratio >= self.inp.ratio_threshold:
                return
            self.log(f"bisect: {cand['name']} stands out {cand['score']:.1f}x from its peers, but only "
                     f"{ratio:.2f}x the golden module's own rounding in {dtype}: set aside")
            result.rounding.append(dict(cand))
            result.ranked = set_aside(result.ranked, cand)
            result.candidate = pick_candidate(result.ranked)

    def set_aside_quantization(self, result: StepReplay) -> None:
        """Check the step's candidate, where it is a quantized checkpoint's W8A8 Linear layer or holds
        such layers, against what their quantization explains (``W8A8Linear.account`` on the golden
        input): a Linear layer whose own error is the clip of a calibration on other prompts and
        int8 rounding is set aside (``result.quantization``) and the next candidate checked, so that a
        layer whose error the quantization does not explain (a wrong weight, scale or bias) is named
        whatever ranks above it. A module holding such layers (an attention, an MLP, what an
        attention writes to its KV cache) is set aside where every one of them is explained and its
        own error is within ``QUANT_CARRIED`` times theirs taken together: it carries theirs."""
        tgt = self.target
        if tgt is None or not getattr(tgt, "quantized", None) or result.call_of is None:
            return
        modules = dict(tgt.model.named_modules())
        self._set_aside_explained(result, modules)
        # the other quantized Linear layers standing out beside a candidate that stands: each said as
        # its quantization's where it is, not as the same fault in more layers
        others = [r for r in result.ranked if r.get("anomalous") and r is not result.candidate
                  and not r.get("overflow") and isinstance(modules.get(r["name"]), W8A8Linear)]
        for row in others:
            found = self.quantization_account(modules[row["name"]], result.call_of(row["name"]))
            if found is not None:
                row["weight_ratio"] = found[0].weight_ratio
            if found is not None and found[0].explained:
                result.quantization.append({**row, "linear": row["name"], "account": found[0],
                                            "detail": found[1]})
                result.ranked = set_aside(result.ranked, row)

    def _set_aside_explained(self, result: StepReplay, modules: dict[str, Any]) -> None:
        """``set_aside_quantization``'s candidates, one after the other, until one stands (each
        check is one Linear layer run once: every standing-out one is checked, unlike the rounding's
        module copies)."""
        for _ in range(len(result.ranked)):
            cand = result.candidate
            if not cand or not cand.get("anomalous") or cand.get("overflow"):
                return
            base = cand["name"].removesuffix(KV_CACHE)
            held = modules.get(base)
            linears = {base: held} if isinstance(held, W8A8Linear) else \
                {n: m for n, m in modules.items() if n.startswith(base + ".") and isinstance(m, W8A8Linear)}
            accounts = {}
            for name, linear in linears.items():
                found = self.quantization_account(linear, result.call_of(name))
                if found is not None and name == cand["name"]:  # (said in the verdict, and no longer
                    # taken for the quantization's own where nothing fails: ``below_notice``)
                    cand["weight_ratio"] = found[0].weight_ratio
                if found is None or not found[0].explained:
                    return  # (not explained: the candidate stands)
                accounts[name] = found
            if not accounts:
                return
            worst = max(accounts, key=lambda n: accounts[n][0].error)
            account, detail = accounts[worst]
            error = cand.get("error")
            # (the errors of the Linear layers one after another in a module add up about as their
            # root sum of squares: an MLP's gate, up and down projections)
            carried = math.sqrt(sum(a.error ** 2 for a, _ in accounts.values()))
            if worst != cand["name"] and (not isinstance(error, (int, float))
                                          or error > QUANT_CARRIED * carried):
                return  # more error than its quantized Linear layers': its own code's
            self.log(f"bisect: {cand['name']} stands out {cand['score']:.1f}x from its peers, but the "
                     f"quantization of {worst} explains it ({account.words()}): set aside")
            result.quantization.append({**cand, "linear": worst, "account": account, "detail": detail})
            result.ranked = set_aside(result.ranked, cand)
            result.candidate = pick_candidate(result.ranked)

    def quantization_account(self, module: W8A8Linear,
                             call: Call | None) -> tuple[QuantAccount, str | None] | None:
        """``module``'s account of its own error on the golden ``call`` and its ``explain``, on the
        input its forward receives (after the pre-hooks ``unsmooth`` gives a smoothed norm's
        readers); None where the call holds no input or output to measure."""
        if call is None or not call.replayable or not call.args or not call.outputs:
            return None
        golden = call.outputs.get("0", next(iter(call.outputs.values())))
        seen: dict[str, torch.Tensor] = {}
        handle = module.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))
        try:
            with torch.no_grad():
                module(*cast_inputs(call.args, self.target.device, self.target.dtype, module, []))
        finally:
            handle.remove()
        if not isinstance(seen.get("x"), torch.Tensor) or not isinstance(golden, torch.Tensor):
            return None
        with torch.no_grad():
            return module.account(seen["x"], golden), module.explain(seen["x"])

    def rounding_in_target(self, result: StepReplay) -> Callable[[str], dict[str, Any] | None]:
        """The golden module's own rounding row in the target model's dtype, on its device, on the
        golden call the target module was replayed on (``rounding.rounding_row``)."""
        @functools.cache
        def golden_modules() -> dict[str, Any]:  # (the golden loaded here: only where a candidate stands out)
            gld = self.golden()
            return dict(gld.model.named_modules()) if gld is not None else {}

        def reference(name: str) -> dict[str, Any] | None:
            tgt = self.target
            if tgt is None or result.call_of is None or not golden_modules():
                return None
            gld = self.golden()  # (held by now)
            call, module = result.call_of(name), golden_modules().get(name)
            if (call is None or not call.replayable or module is None
                    or rounding.copy_bytes(module, tgt.dtype) > rounding.ROUNDING_COPY_LIMIT):
                return None
            with layer_weights_held(gld.model, layer_of(name, self.stack) or name):
                return rounding.rounding_row(module, call, device=tgt.device, dtype=tgt.dtype,
                                             call_of=result.call_of)
        return reference

    def replay_layers_whole(self, result: StepReplay, calls: Iterable[Call]) -> None:
        """Each of the target's decoder layers run whole on its golden ``calls`` (the golden dump's
        at the prefill, the golden re-run's with its KV cache at a decode step), for a step where no
        module stands out (``result.layer_errors``): a fault in a layer's own code (a residual add,
        a scale between its modules) shows only there."""
        layers, tgt = set(self.stack.layers), self.target
        calls = [c for c in calls if c.name in layers]
        with moe.routing_forced(tgt.model, layers, result.call_of or (lambda _name: None)):
            whole = replay_modules(tgt.model, calls, device=tgt.device, dtype=tgt.dtype,
                                   select=lambda n, _m: n in layers, stack=self.stack)
        updates = {c.name: update_norm(c) for c in calls}
        result.layer_errors = {r["name"]: relative_to_update(r, updates.get(r["name"]))["rel_l2"]
                               for r in whole if r.get("replayable")}
        result.layer_update_errors = update_errors(whole, updates)
        self.phase("module: decoder layers replayed whole", f"{len(result.layer_errors)} layers")

    def decode_position(self, step: int) -> Callable[[int], str]:
        """Token text at a position of the sequence seen at ``step`` (prompt, then golden tokens)."""
        seq = list(self.inp.prompt_ids) + list(self.inp.golden_ids[:step])
        offset = len(seq) - 1 if step > 0 else 0  # a decode step sees one new position

        def text(pos: int) -> str:
            i = pos + offset
            return self.decode(seq[i]) if 0 <= i < len(seq) else f"#{pos}"
        return text

    # -- 4. op level and experts ---------------------------------------------------------------
    def op_level(self, chosen: StepReplay) -> None:
        cand = chosen.candidate
        if not (self.inp.op_level and cand and cand.get("anomalous") and chosen.call_of and self.target):
            return
        call: Call | None = chosen.call_of(cand["name"].removesuffix(KV_CACHE))
        gld, tgt = self.golden(), self.target
        if call is None or not call.replayable or gld is None:
            return
        name = cand["name"].removesuffix(KV_CACHE)
        g_mod = dict(gld.model.named_modules())[name]
        t_mod = dict(tgt.model.named_modules())[name]
        if isinstance(t_mod, W8A8Linear) and call.args and isinstance(call.args[0], torch.Tensor):
            # (on the input its forward receives: a smoothed norm's reader's, after its pre-hook)
            found = self.quantization_account(t_mod, call)
            chosen.quant_detail = found[1] if found is not None else t_mod.explain(call.args[0])
        if moe.is_fused_experts(t_mod, call):
            chosen.experts = moe.expert_errors(g_mod, t_mod, call, golden=gld, target=tgt)
            chosen.expert = moe.worst_expert(chosen.experts, self.inp.ratio_threshold)
        if isinstance(t_mod, UnfusedExperts) and chosen.expert is not None:
            # a quantized checkpoint's experts against the golden's fused ones: no op pairs with
            # the golden's, so each Linear layer of the expert is replayed alone instead
            with layer_weights_held(gld.model, layer_of(name, self.stack) or name):  # (read directly)
                chosen.expert_linears, inputs = moe.expert_linear_errors(
                    g_mod, t_mod, call, name=name, golden=gld, target=tgt, expert=chosen.expert)
            linear = moe.worst_expert_linear(chosen.expert_linears, chosen.expert, self.inp.ratio_threshold)
            chosen.expert_linear = linear
            held = dict(t_mod.named_modules(prefix=name)).get(linear.name) if linear else None
            if isinstance(held, W8A8Linear):
                chosen.quant_detail = held.explain(inputs[linear.name])
            if chosen.expert_linears and not cand.get("overflow"):  # (an overflow's first op still wanted)
                return
        g_ops = ops_mod.capture_ops(g_mod, name, call, device=gld.device, dtype=gld.dtype)
        t_ops = ops_mod.capture_ops(t_mod, name, call, device=tgt.device, dtype=tgt.dtype)
        chosen.op_level = ops_mod.comparability(g_ops, t_ops)
        if chosen.op_level.comparable:
            chosen.op_rows, chosen.first_op = ops_mod.compare_ops(g_ops, t_ops, target_dtype=tgt.dtype,
                                                                  ratio=self.inp.ratio_threshold)
        else:  # the ops before the first difference pair; after it, the target's are listed only
            n_g, n_t = chosen.op_level.golden_ops_paired, chosen.op_level.target_ops_paired
            chosen.op_rows, chosen.first_op = ops_mod.compare_ops(
                g_ops[:n_g], t_ops[:n_t], target_dtype=tgt.dtype, ratio=self.inp.ratio_threshold,
                own_error_only=True)
            chosen.op_rows += [OpRow(name=t.name, golden_api=None, target_api=t.api, raw=None, iso=None,
                                     status="not comparable") for t in t_ops[n_t:]]
        if cand.get("overflow"):
            origin = ops_mod.first_overflow_op(t_ops)
            if origin is not None:
                chosen.overflow_op = ops_mod.overflow_detail(origin)
                chosen.first_op = origin.name
        g_op, t_op = ops_mod.paired_op(g_ops, t_ops, chosen.first_op) if chosen.first_op else (None, None)
        if g_op is not None and t_op is not None:  # the panel compares the two sides: keep a pair only
            tensors, sampled, notes = ops_mod.op_tensors(g_op, t_op)
            self.op_tensors = tensors
            self.op_tensors_info = OpTensors(
                file=FIRST_BAD_OP_FILE, op=chosen.first_op, step=chosen.step, tensors=sorted(tensors),
                golden_op=g_op.name if g_op.name != chosen.first_op else None,
                sampled=sampled, notes=notes)
        self.log(f"bisect: {len(t_ops)} target ops in {name}"
                 + ("" if chosen.op_level.comparable else " (not comparable with the golden's)")
                 + f"; first bad op {chosen.first_op}")
        self.phase("op: replay with API capture", f"{len(t_ops)} target ops")

    # -- 4b. the chosen module's own error per step ----------------------------------------------
    def own_error_per_step(self, chosen: StepReplay) -> OwnErrorSteps | None:
        """Replay the chosen module (and its copies in up to ``OWN_ERROR_PEERS`` other layers) at
        each of the first ``own_error_steps`` steps, on golden inputs from one golden re-run."""
        inp, cand = self.inp, chosen.candidate
        steps = min(inp.own_error_steps, len(inp.golden_ids))
        if not (cand and cand.get("anomalous") and steps > 0 and inp.prompt_ids and self.target):
            return None
        golden = self.golden()
        if golden is None:
            return None
        metric = "kv_cache_rel_l2" if cand["name"].endswith(KV_CACHE) else "rel_l2"
        name = cand["name"].removesuffix(KV_CACHE)
        layer = layer_of(name, self.stack)
        peers: list[str] = []
        if layer is not None and self.stack is not None:
            others = [other for other in self.stack.layers if other != layer]
            every = max(1, math.ceil(len(others) / OWN_ERROR_PEERS))
            peers = [other + name[len(layer):] for other in others[::every]]
        tgt = self.target
        modules = dict(tgt.model.named_modules())
        wanted = {name, *peers}
        for replayed in [name, *peers]:  # an MoE block is replayed with the golden routing: its router's call
            found = moe.router_of(modules[replayed]) if replayed in modules else None
            if found is not None:
                wanted.add(f"{replayed}.{found[0]}")
        calls, source = self.golden_steps(golden, [name, *peers], steps, wanted)

        def error(at: dict[str, Any], module_name: str) -> float | None:
            call, module = at.get(module_name), modules.get(module_name)
            if call is None or module is None:
                return None
            row = replay_call(module, call, device=tgt.device, dtype=tgt.dtype, context=at)
            self.stats["own_error_replays"] += 1
            return row.get(metric) if row.get("replayable") else None

        rows = []
        for step in range(steps):
            at = calls.get(step, {})
            peer_errors = [e for e in (error(at, p) for p in peers) if e is not None and math.isfinite(e)]
            rows.append(OwnErrorStep(step=step, own_error=error(at, name),
                                     peer_median=median(peer_errors) if peer_errors else None,
                                     peers=len(peer_errors)))
        self.phase("module: own error per step", f"{steps} steps x {1 + len(peers)} modules, {source}")
        return OwnErrorSteps(module=name, metric=metric, rows=rows, source=source)

    def golden_steps(self, golden: Any, modules: list[str], steps: int,
                     wanted: set[str]) -> tuple[dict[int, dict[str, Call]], str]:
        """The ``wanted`` modules' golden calls at steps 0..``steps``-1, and where they came from:
        the decoder layers of ``modules`` re-run alone from the golden dump where it holds their
        inputs at every step, else one golden re-run through those steps."""
        layers = [layer_of(m, self.stack) for m in modules]
        if all(layers):
            found = golden_layer_steps(self.golden_dump, golden, list(dict.fromkeys(layers)), steps,
                                       lambda n, _m: n in wanted)
            if found.missing is None:
                self.stats["recomputed_layers"] += len(set(layers)) * steps
                return found.calls, "dump + layer re-run"
            self.log(f"bisect: own error per step from a golden re-run: {found.missing}")
        calls = golden_rerun_steps(golden, self.inp.prompt_ids, self.inp.golden_ids, set(range(steps)),
                                   lambda n, _m: n in wanted)
        self.stats["golden_reruns"] += 1
        return calls, "golden re-run"

    # -- 5. cost ---------------------------------------------------------------------------------
    def cost(self, tried: list[StepReplay], chosen: StepReplay) -> Cost:
        inp = self.inp
        g_bytes, t_bytes = cost_mod.dir_bytes(inp.golden_dump), cost_mod.dir_bytes(inp.target_dump)
        cost = Cost(
            model_runs=ModelRuns(full_generations=2, models_loaded_by_bisect=(self.target is not None)
                                 + ("golden" in self.held),
                                 golden_weights=self.golden_weights(),
                                 golden_layers_recomputed=self.stats["recomputed_layers"],
                                 golden_reruns=self.stats["golden_reruns"],
                                 module_replays=sum(len(t.rows) for t in tried)
                                 + self.stats["own_error_replays"],
                                 op_replays=len(chosen.op_rows)),
            bytes_dumped=g_bytes + t_bytes, golden_dump_bytes=g_bytes, target_dump_bytes=t_bytes)
        if inp.estimate_cost and inp.prompt_ids and self.target is not None:
            # one run of the target estimates both sides: the golden runs the same ops in its dtype
            tgt, gld = self.target, self.held.get("golden")
            golden_dtype = gld.dtype if gld is not None else tgt.dtype
            estimates = cost_mod.api_dump_estimates(tgt.model, inp.prompt_ids, max(len(inp.golden_ids), 1),
                                                    [None, golden_dtype])
            full = sum(e["total_bytes"] for e in estimates)
            cost.full_api_dump_bytes_estimate = full
            cost.full_api_dump_estimate_method = estimates[0]["method"]  # "one layer x N": extrapolated
            cost.bytes_fraction_of_full_api_dump = round(cost.bytes_dumped / max(full, 1), 4)
            self.phase("cost: full API dump estimate", estimates[0]["method"])
        cost.bisect_seconds = round(time.time() - self.t0, 2)
        cost.bisect_phase_seconds = self.phases
        return cost

    def teacher_forced(self, mismatch: int, judged: str) -> TeacherForced | None:
        """The target run once more on the golden's tokens (teacher-forced, through its own decoding
        loop), its logits at each step after ``mismatch`` against the golden dump's, judged at
        ``judged``; None where no target model is held (a dump alone holds no step on the golden's
        text), no prompt ids, or no step after the part."""
        from llmflow.compare.metrics import compare_tensors
        from llmflow.compare.thresholds import judge
        from llmflow.models import greedy_steps

        inp, tgt = self.inp, self.target
        golden_logits = logits_entries(self.golden_dump)
        after = [k for k in range(mismatch + 1, len(inp.golden_ids)) if k in golden_logits]
        if tgt is None or not inp.prompt_ids or not after:
            return None
        eos = getattr(tgt.tokenizer, "eos_token_id", None)
        try:
            _, logits = greedy_steps(tgt.model, inp.prompt_ids, len(inp.golden_ids), eos_token_id=eos,
                                     force_ids=inp.golden_ids, stop_after=len(inp.golden_ids),
                                     keep_logits=True)
        except (RuntimeError, MemoryError, ValueError) as exc:  # (a device too full for another run):
            # the verdict then says the steps after the part are not checked
            self.log(f"bisect: the target could not run on the golden's tokens: {type(exc).__name__}: {exc}")
            return None
        self.forced_logits = logits
        found = TeacherForced(after=mismatch)
        furthest = -1.0
        for k in after:
            if logits is None or k >= logits.shape[0]:
                break
            golden = dtype_baseline.last_position(self.golden_dump.load(golden_logits[k]))
            metrics = compare_tensors(golden, logits[k].float())
            judged_row = judge(metrics, judged, inp.thresholds)
            found.steps.append(k)
            rel = metrics.get("relative_euclidean_distance")
            if isinstance(rel, float) and rel > furthest:  # (NaN compares false: a failing step anyway)
                found.furthest, furthest = k, rel
            if judged_row.verdict == "fail":
                found.failing.append(k)
                if found.first_fail is None:
                    found.first_fail, found.reason = k, judged_row.reason
        self.log(f"bisect: the target on the golden's tokens after the part at token {mismatch}: logits "
                 + (f"first fail at step {found.first_fail}" if found.first_fail is not None else
                    f"within the thresholds at steps {steps_text(found.steps)}"))
        self.phase("token: the target teacher-forced on the golden's tokens")
        return found

    def target_logits(self, rows: list[TokenRow], forced: TeacherForced | None) -> Callable[[int], Any]:
        """Golden step -> the target's logits there: its dump's up to where the texts part (paired by
        ``rows``), its run on the golden's tokens after it (``teacher_forced``); None where neither."""
        t_log = logits_entries(self.target_dump)
        target_step = {r.step: r.target_step for r in rows}
        after = forced.after if forced is not None else None

        def logits(step: int) -> torch.Tensor | None:
            if after is not None and step > after:
                held = self.forced_logits
                return held[step] if held is not None and step < held.shape[0] else None
            found = t_log.get(target_step.get(step, -1))
            return self.target_dump.load(found) if found is not None else None
        return logits

    def dtype_baseline(self, rows: list[TokenRow], failing: list[int], judged: str,
                       forced: TeacherForced | None = None, warning: bool = False) -> DtypeBaseline | None:
        """The golden model itself in the target's dtype on the target's device (a target known by
        its dump alone: on the golden's device, in the dtype the dump records), re-run through the
        ``failing`` steps (whose logits fail, up to where the texts part: ``dtype_baseline.py``); None
        where it says nothing: a quantized target, no golden model, no prompt ids, no failing step,
        or a golden that already computes as the target does. Asked by the verdict only where failing
        logits are all that is left to explain: the golden model held is released first, so the
        process holds the target (where it is loaded) and this one. ``warning``: no step's logits
        fail, ``failing`` are those that warn."""
        inp, tgt = self.inp, self.target
        golden = inp.golden_spec
        if not failing or not golden or not inp.prompt_ids or len(inp.golden_ids) <= max(failing):
            return None
        if tgt is not None:
            if getattr(tgt, "quantized", None):
                return None
            dtype, device = dtype_name(tgt.dtype), str(tgt.device)
        else:
            if recorded_quantization(self.target_dump):
                return None
            dtype, device = target_dump_dtype(self.target_dump), str(golden.get("device") or "cpu")
        if (_same_device(golden.get("device") or "cpu", device)
                and dtype_name(golden.get("dtype") or "float32") == dtype):
            return None  # (it would reproduce the golden: an error of 0 explains nothing)
        on_target = tgt is not None
        held = self.held.pop("golden", None)
        whole = (None if self.golden_streamed or held is None else
                 rounding.copy_bytes(held.model, resolve_dtype(dtype)))
        del held
        gc.collect()
        if whole is not None and whole > BASELINE_WHOLE_LIMIT:
            found = dtype_baseline.unmeasured(
                dtype, device, failing[0], f"the golden model loads whole only (no safetensors checkpoint to "
                f"stream), {whole / 2**30:.1f} GiB in {dtype} beside the target", on_target)
        else:
            found = self._measure_baseline(rows, failing, judged, forced, dtype, device, on_target)
            self.phase("dtype baseline: the golden model in the target's dtype")
        found.warning, found.failing_steps = warning, found.failing_steps or list(failing)
        return found

    def _measure_baseline(self, rows: list[TokenRow], failing: list[int], judged: str,
                          forced: TeacherForced | None, dtype: str, device: str,
                          on_target: bool) -> DtypeBaseline:
        """The golden model loaded in ``dtype`` on ``device`` and re-run (``dtype_baseline.measure``);
        unmeasured, saying why, where it cannot be loaded or run there."""
        inp = self.inp
        spec = {**inp.golden_spec, "dtype": dtype, "device": device}
        self.log(f"bisect: the golden model in {dtype} on {device}, re-run through step {max(failing)}: how "
                 "far that dtype alone takes the logits")
        try:
            model = _load_streamed(spec, inp.layers) if self.golden_streamed else _load(spec)
            return dtype_baseline.measure(
                self.golden_dump, self.target_logits(rows, forced), model, prompt_ids=inp.prompt_ids,
                golden_ids=inp.golden_ids, failing=failing, dtype=dtype, device=device,
                judge_dtype=judged, thresholds=inp.thresholds, on_target_device=on_target)
        except (UserError, RuntimeError, OSError, MemoryError, ValueError) as exc:  # (a device too full
            # for it, a golden that loads in no other dtype); a fault of llmflow's own is not hidden
            self.log(f"bisect: the golden model in {dtype} could not be run: {type(exc).__name__}: {exc}")
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
            return dtype_baseline.unmeasured(dtype, device, failing[0], why, on_target)


def _same_device(a: str, b: str) -> bool:
    """Whether two device names are one device (``cuda`` is ``cuda:0``)."""
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and (da.index or 0) == (db.index or 0)


def replay_plan(inp: BisectInputs, mismatch: int | None, bad_token: int | None) -> tuple[int, str]:
    """The step to replay first, and why."""
    if inp.replay_step is not None:
        return inp.replay_step, "the step asked for (replay_step)"
    if bad_token is not None:
        return bad_token, "the first step whose logits fail the thresholds"
    if mismatch is not None:
        return mismatch, "the first step whose greedy token differs"
    return 0, "nothing diverges: the prefill, where every module runs on the whole prompt"


def run_bisect(inp: BisectInputs, *, log: Callable[[str], None] = print,
               progress: Progress | None = None, op_tensors: dict[str, Any] | None = None) -> Verdict:
    """Narrow the divergence down; returns the verdict with its evidence.

    ``op_tensors``: a dict the first bad op's tensors are put in (key -> tensor, as
    ``verdict.first_bad_op_tensors`` lists them) for the caller to write beside the verdict; None:
    none kept, and the verdict names none."""
    b = _Bisect(inp, log, progress)
    tgt = b.target
    if not inp.golden_ids or not inp.target_ids:  # dumps made elsewhere: the greedy tokens of their logits
        b.inp = inp = replace(inp, golden_ids=inp.golden_ids or greedy_ids(b.golden_dump),
                              target_ids=inp.target_ids or greedy_ids(b.target_dump))
    dtype = dtype_name(tgt.dtype) if tgt is not None else target_dump_dtype(b.target_dump)
    # what judges the logits and the shared errors: a quantized target's matmuls ran in int8 or int4
    quant = (quantization_dtype(tgt.quantized.values()) if tgt is not None
             else recorded_quantization(b.target_dump))
    judged = coarser(dtype, quant) or dtype
    # a side without token ids (a dump without logits) says nothing of where the texts part
    mismatch = first_mismatch(inp.golden_ids, inp.target_ids) if inp.golden_ids and inp.target_ids else None
    rows = token_rows(b.golden_dump, b.target_dump, golden_ids=inp.golden_ids, target_ids=inp.target_ids,
                      pairs=inp.pairs, target_dtype=judged, thresholds=inp.thresholds, decode=b.decode)
    bad_token = first_bad_step(rows, mismatch)
    log(f"bisect: first mismatching token {mismatch}, first bad token (logits) {bad_token}")
    b.phase("token: logits per step")

    step, why = replay_plan(inp, mismatch, bad_token)
    differs = input_difference(b.golden_dump, b.target_dump, b.target_step(0))
    if differs:  # every module error would compare two computations on different tokens: no replay
        log(f"bisect: the two runs were given different inputs: {differs}")
        tried = [StepReplay(step=step, why=why, source="none",
                            missing=f"the golden and the target were not given the same inputs: {differs}",
                            missing_next=("dump both sides from the same token ids (the same prompt, chat "
                                          "template, BOS token and tokenizer) and run the bisect again"))]
    else:
        tried = [b.replay_step(step, why)]
    first = tried[0]
    found = stands_out(first, inp.ratio_threshold)
    if not found and inp.replay_step is None and not differs:
        if step > 0:
            tried.append(b.replay_step(0, f"nothing stands out at step {step}: the prefill, whose KV "
                                          "cache every later step reads"))
        elif len(inp.golden_ids) > 1:  # (also where rounding parts the texts at the first token: a
            # decode-only fault hides behind it, and the target's modules on the golden's inputs
            # at step 1 still measure their own error)
            seen = "nothing diverges" if mismatch is None and bad_token is None else \
                "nothing stands out at the prefill"
            tried.append(b.replay_step(1, f"{seen}: the first decode step too, where the decode kernel runs "
                                          "against the KV cache"))
    forced = None
    if (mismatch is not None and inp.replay_step is None and not differs
            and not any(stands_out(t, inp.ratio_threshold) for t in tried)):
        # the texts part through rounding, so far: the steps after the part, where each side continues
        # its own text, are checked with the target on the golden's tokens (a fault that first shows
        # there would pass unseen); the first whose logits fail is replayed, else the one whose logits
        # are furthest from the golden's (a fault too small yet to fail them, growing with the cache)
        forced = b.teacher_forced(mismatch, judged)
        late, what = None, ""
        if forced is not None:
            late, what = ((forced.first_fail, "first fail") if forced.first_fail is not None else
                          (forced.furthest, "are furthest from the golden's"))
        if late is not None and late not in {t.step for t in tried}:
            tried.append(b.replay_step(late, f"the texts part at token {mismatch}; on the golden's tokens "
                                             f"the target's logits {what} at this step, after the part"))
    failing = inp.compare_first_fail or {}
    if (not any(stands_out(t, inp.ratio_threshold) for t in tried) and inp.replay_step is None
            and not differs and isinstance(failing.get("step"), int)
            and failing["step"] not in {t.step for t in tried} and failing["step"] < len(inp.golden_ids)):
        # the logits stay within their thresholds, yet a row of the compare fails at this step
        tried.append(b.replay_step(failing["step"], f"nothing stands out where the logits point: the "
                                                     f"compare's first failing row, {failing.get('name')}"))
    # the step the verdict speaks of: the first where a module or layer stands out, else the first
    # where every layer's copy of one module type is off alike (no copy stands out from its peers:
    # a decode kernel every layer runs, checked at the first decode step after a clean prefill)
    chosen = next((t for t in tried if stands_out(t, inp.ratio_threshold)), None) or next(
        (t for t in tried if shared_error(t, b.stack, judged) is not None), tried[0])
    if b.isolation == "target_dump" and chosen.anomalous and chosen.candidate:
        # the module about to be named, measured against the golden model: its layer must be the
        # golden dump's too (a golden model that differs there alone would blame a clean target)
        named = chosen.candidate["name"].removesuffix(KV_CACHE)
        for module in dict.fromkeys((layer_of(named, b.stack) or named, named)):  # where the dump holds it
            b.check_golden_model(module)
    # nothing stands out (or only a lead too weak to name where every output is within its thresholds):
    # a side input (positions, mask) changed on its way into a module, which a replay on the recorded
    # inputs is given changed as well
    quantized = getattr(tgt, "quantized", None)
    nameable = [t for t in tried
                if t.anomalous and not below_notice(inp, t.candidate, mismatch, bad_token, quantized)]
    handed = b.handed_down(dtype) if not differs and not nameable else None
    b.op_level(chosen)
    b.expert_at_prefill(chosen)
    own_steps = b.own_error_per_step(chosen)
    cost = b.cost(tried, chosen)
    problems = [f"golden dump: {p}" for p in b.golden_dump.problems()]
    problems += [f"target dump: {p}" for p in b.target_dump.problems()]
    # the steps whose logits fail: up to where the texts part, and on the golden's tokens after it
    logits_failing = failing_steps(rows, mismatch) + (forced.failing if forced is not None else [])
    # where none fails, the steps whose logits warn: a port error too small yet to fail them (a logits
    # scale in its forward) is told from the dtype's own drift the same way
    logits_judged = logits_failing or failing_steps(rows, mismatch, verdict="warn")
    result = conclude(inp, tried, chosen, rows=rows, mismatch=mismatch, bad_token=bad_token,
                      stack=b.stack, decode=b.decode, dtype=judged, compute_dtype=dtype,
                      device=str(tgt.device) if tgt is not None else "target dump",
                      problems=problems, note=_notes(tgt, b.held.get("golden")), own_steps=own_steps,
                      quantized=quantized,
                      quantized_names=getattr(tgt, "quantized_names", None), handed_down=handed,
                      dumps_as_specs=dumps_made_as_specs(inp, b.golden_dump, b.target_dump, b.isolation),
                      dtype_baseline=lambda: b.dtype_baseline(rows, logits_judged, judged, forced,
                                                              warning=not logits_failing),
                      teacher_forced=forced)
    result.isolation = b.isolation
    if b.isolation == "target_dump":
        asked = {"op_level": inp.op_level, "own_error_steps": inp.own_error_steps > 0,
                 "cost_estimate": inp.estimate_cost}
        result.skipped = {phase: why for phase, why in NEEDS_TARGET_MODEL.items() if asked[phase]}
    result.cost = cost
    result.own_error_steps = own_steps
    if op_tensors is not None and b.op_tensors_info is not None:
        op_tensors.update(b.op_tensors)
        result.first_bad_op_tensors = b.op_tensors_info
    b.held.clear()
    return result
