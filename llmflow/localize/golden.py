"""Where the golden inputs of every module come from, as cheaply as possible.

Isolation replay needs, for each module, the golden model's inputs and output at the replay step.

At the prefill step (0) two sources, used per decoder layer:
  the golden dump itself, when it recorded the module (a full module-mode dump, tensor_part 2);
  the golden *decoder layer's* dumped inputs, re-run in memory through the golden model's layer
    (golden device and dtype, so bit-identical to what a full dump would have held) with every
    sub-module's call captured. The recipe dumps only the decoder layers' inputs and outputs, a
    few percent of a full module dump (the 1536-wide MLP intermediates dominate that), and lets
    the bisect recompute the rest layer by layer, never holding more than one layer in memory.
The modules outside the decoder layers (embedding, final norm, lm_head) that such a dump lacks
come from one golden prefill re-run (``golden_rerun`` at step 0, those modules selected).
A dump records the prefill's KV cache by its kind alone (empty then); each call built from it is
given an empty cache of that kind (``prefill_cache``), and an attention's call what the golden
module writes into it (recomputed with its layer, or the dumped module run once more:
``_golden_write``), so the replay measures the target's prefill cache write as at a decode step.

At a decode step t > 0 a module also reads state: the KV cache of the steps before, the cache
position, the rotary angles and the mask. A dump holds no cache contents, so the golden model is
re-run in memory, teacher-forced on its own generated tokens through its own decoding loop (the
same forward calls its dump run made), and every module's call at step t is captured with the
cache as that module found it (``golden_rerun``). The re-run's logits are checked against the
golden dump's, so a re-run that does not reproduce the golden run is reported, not trusted.
``golden_rerun_steps`` does the same for a few modules at several steps in one generation (the
chosen module's own error per step).

A few modules at several steps need no whole re-run when the golden dump holds their decoder
layers' inputs at every one of those steps (the recipe's golden dump does):
``golden_layer_steps`` runs each such layer alone, step after step from its dumped inputs, with
a KV cache of its own that its own calls fill, so the cache holds exactly what the layer wrote in
the golden run. That reads those layers' weights once and runs a few layers, not the model. Each
step's recomputed layer output is checked against the dumped one; where it does not reproduce it
(a golden on a device that is not deterministic, a cache kind the layer cannot be given alone),
the caller falls back to the whole re-run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmflow.dump.arguments import is_cache_type
from llmflow.dump.memory import CacheSnapshot, Call, CallRecorder, cache_layer_index, capture_calls
from llmflow.formats.base import DumpReader
from llmflow.localize.calls import cache_class, calls_from_dump, cast_inputs, fresh_cache
from llmflow.localize.own_error import own_error
from llmflow.streamed import layer_weights_held
from llmflow.structure import LayerStack, layer_of

#: how far (rel_l2) a layer re-run alone may land from its dumped output and still stand for the
#: golden run: far below any own error worth ranking (a bf16 module's is ~1e-3), above the last-bit
#: noise of a device whose kernels do not reduce in a fixed order
LAYER_RERUN_TOLERANCE = 1e-5


def _run_layer(golden: Any, module: nn.Module, layer: str, call: Call,
               select: Callable[[str, nn.Module], bool]) -> tuple[dict[str, Call], torch.Tensor | None]:
    """One call of a decoder layer on the golden side (inputs cast to the golden's device and
    dtype): the calls of the sub-modules ``select`` picks, and the layer's output 0 (None where it
    is not a tensor)."""
    args = cast_inputs(call.args, golden.device, golden.dtype, module)
    kwargs = cast_inputs(call.kwargs, golden.device, golden.dtype, module)
    ran: list[Any] = []
    sub = capture_calls(module, lambda: ran.append(module(*args, **kwargs)), prefix=layer,
                        select=lambda n, m: n != layer and select(n, m))
    out = ran[0][0] if isinstance(ran[0], (tuple, list)) and ran[0] else ran[0]
    return sub, out if isinstance(out, torch.Tensor) else None


def prefill_cache(reader: DumpReader, load_golden: Callable[[], Any]) -> CacheSnapshot | None:
    """An empty KV cache of the kind the golden dump recorded at the prefill (step 0), laid out by
    the golden model's config, for the calls built from that step: a dump holds the cache's kind
    alone, and an attention given none writes nothing, so its cache write could not be measured.
    None where the dump records no cache there, records several kinds, a kind that cannot be
    made empty (``cache_class``), or the golden cannot be loaded. A snapshot: each run of a call
    gets a private copy (``cast_inputs``)."""
    kinds = {e.pytype for e in reader.entries()
             if e.step == 0 and e.level == "module" and e.kind == "input" and is_cache_type(e.pytype)}
    if len(kinds) != 1:
        return None
    golden = load_golden()
    kind = kinds.pop()
    if golden is None or cache_class(golden.model, kind) is None:
        return None
    return CacheSnapshot(fresh_cache(golden.model, kind))


@torch.no_grad()
def _golden_write(golden: Any, module: nn.Module, call: Call) -> None:
    """Set a dumped call's ``cache_after``: the golden ``module`` run once more on the call's
    inputs, into a private copy of the cache they hold, to have what it writes there (the dump
    holds the module's outputs, not its cache). Left None for a module that names no cache layer,
    a call without a cache snapshot, or a run that fails (the replay reports that call itself)."""
    holds = any(isinstance(v, CacheSnapshot) for v in (*call.args, *call.kwargs.values()))
    if not call.replayable or not holds or not isinstance(getattr(module, "layer_idx", None), int):
        return
    caches: list[Any] = []
    try:
        module(*cast_inputs(call.args, golden.device, golden.dtype, module, caches),
               **cast_inputs(call.kwargs, golden.device, golden.dtype, module, caches))
    except Exception:  # (a module that refuses the rebuilt inputs: its replay says why)
        return
    if len(caches) == 1:
        call.cache_after = CacheSnapshot(caches[0], cache_layer_index(module))


def golden_calls(reader: DumpReader, step: int, load_golden: Callable[[], Any],
                 stats: dict[str, int] | None = None, stack: LayerStack | None = None,
                 select: Callable[[str, nn.Module], bool] | None = None) -> Iterator[Call]:
    """Every golden call at ``step`` from the dump: the dumped ones, then for each dumped decoder
    layer whose sub-modules the dump lacks, the sub-module calls recomputed from the layer's inputs.
    At the prefill a recorded KV cache is an empty one (``prefill_cache``), and each dumped call
    of a module that writes into it holds what the golden module writes (``_golden_write``).

    ``load_golden()`` returns the golden LoadedModel, or None when it cannot be loaded (called only
    when a layer must be re-run or a prefill cache be made).
    ``stats["recomputed_layers"]`` counts the layers re-run.
    """
    names = {e.name for e in reader.entries() if e.step == step and e.level == "module"}
    stats = stats if stats is not None else {}
    stats.setdefault("recomputed_layers", 0)
    select = select or (lambda _n, _m: True)
    cache = prefill_cache(reader, load_golden) if step == 0 else None
    writer = load_golden() if cache is not None else None  # (loaded: it made the cache)
    writers = dict(writer.model.named_modules()) if writer is not None else {}
    for call in calls_from_dump(reader, step, cache=cache):
        module = writers.get(call.name)
        if module is not None and select(call.name, module):
            _golden_write(writer, module, call)
        yield call
        layer = call.name
        if layer_of(layer, stack) != layer or not call.replayable:
            continue
        if any(n.startswith(layer + ".") for n in names):
            continue  # the dump has this layer's modules: nothing to recompute
        golden = load_golden()
        module = dict(golden.model.named_modules()).get(layer) if golden is not None else None
        if module is None:
            continue
        sub, _out = _run_layer(golden, module, layer, call, select)
        stats["recomputed_layers"] += 1
        yield from sub.values()


def golden_call(reader: DumpReader, step: int, name: str, load_golden: Callable[[], Any],
                stack: LayerStack | None = None) -> Call | None:
    """The golden call of one module from the dump: dumped, else recomputed from its layer's inputs
    (at the prefill with an empty cache and what the golden writes there, as ``golden_calls``)."""
    cache = prefill_cache(reader, load_golden) if step == 0 else None
    dumped = next(calls_from_dump(reader, step, names={name}, cache=cache), None)
    if dumped is not None and dumped.replayable:
        golden = load_golden() if cache is not None else None  # (loaded: it made the cache)
        module = dict(golden.model.named_modules()).get(name) if golden is not None else None
        if module is not None:
            _golden_write(golden, module, dumped)
        return dumped
    layer = layer_of(name, stack)
    layer_call = next(calls_from_dump(reader, step, names={layer}, cache=cache), None) if layer else None
    if layer_call is None or not layer_call.replayable:
        return dumped
    golden = load_golden()
    if golden is None:
        return dumped
    module = dict(golden.model.named_modules())[layer]
    sub, _out = _run_layer(golden, module, layer, layer_call, lambda n, _m: n == name)
    return sub.get(name, dumped)


def dump_has_layer_inputs(reader: DumpReader, step: int) -> bool:
    """Does the dump hold replayable module inputs at ``step`` (the dump-based golden source)?"""
    return any(e.step == step and e.level == "module" and e.kind == "input" and e.is_tensor and e.has_data
               for e in reader.entries())


@dataclass
class GoldenRerun:
    """The golden model re-run up to one step: every selected module's call at that step, and
    the last position's logits of every step run (float32, CPU) to check it against the dump."""

    step: int
    calls: dict[str, Call] = field(default_factory=dict)
    logits: list[torch.Tensor] = field(default_factory=list)


class _StepCalls(CallRecorder):
    """Records the selected modules' calls at one step of a generation, and every step's last
    position's logits (float32, CPU)."""

    def __init__(self, model: nn.Module, select: Callable[[str, nn.Module], bool], step: int):
        super().__init__(model, select, steps=True)
        self.wanted_step = step
        self.active = False
        self.logits: list[torch.Tensor] = []

    def begin_step(self, step: int) -> None:
        self.active = step == self.wanted_step

    def end_step(self, step: int, output: Any, error: str | None, raised_in: str | None) -> None:
        from llmflow.models import logits_of

        self.active = False
        if error is not None or output is None:
            return
        try:
            logits = logits_of(output)
        except TypeError:
            return
        last = logits[:, -1, :] if logits.dim() == 3 else logits
        self.logits.append(last.detach().float().cpu())


@torch.no_grad()
def golden_rerun(golden: Any, prompt_ids: list[int], golden_ids: list[int], step: int,
                 select: Callable[[str, nn.Module], bool]) -> GoldenRerun:
    """Re-run ``golden`` (a LoadedModel) on the prompt, forcing its own tokens ``golden_ids``,
    through step ``step`` of its decoding loop; capture every selected module's call at that step."""
    from llmflow.models import greedy_generate

    recorder = _StepCalls(golden.model, select, step)
    try:
        eos = getattr(golden.tokenizer, "eos_token_id", None)
        # the dump run's max_new_tokens (a static cache is sized by it), stopped after step ``step``
        greedy_generate(golden.model, prompt_ids, len(golden_ids), eos_token_id=eos, force_ids=golden_ids,
                        stop_after=step + 1)
    finally:
        recorder.close()
    return GoldenRerun(step, recorder.calls, recorder.logits)


class _EachStepCalls(CallRecorder):
    """Records the selected modules' calls at each of several steps of a generation."""

    def __init__(self, model: nn.Module, select: Callable[[str, nn.Module], bool], steps: set[int]):
        super().__init__(model, select, steps=True)
        self.wanted_steps = steps
        self.active = False
        self.by_step: dict[int, dict[str, Call]] = {}

    def begin_step(self, step: int) -> None:
        self.active = step in self.wanted_steps
        self.calls = {}

    def end_step(self, step: int, output: Any, error: str | None, raised_in: str | None) -> None:
        if self.active and error is None:
            self.by_step[step] = self.calls
        self.active = False
        self.calls = {}


@torch.no_grad()
def golden_rerun_steps(golden: Any, prompt_ids: list[int], golden_ids: list[int], steps: set[int],
                       select: Callable[[str, nn.Module], bool]) -> dict[int, dict[str, Call]]:
    """Like ``golden_rerun``, for several steps in one generation (through the last of ``steps``):
    step -> the selected modules' calls at that step. Select few modules: every call is kept."""
    from llmflow.models import greedy_generate

    if not steps:
        return {}
    recorder = _EachStepCalls(golden.model, select, steps)
    try:
        eos = getattr(golden.tokenizer, "eos_token_id", None)
        greedy_generate(golden.model, prompt_ids, len(golden_ids), eos_token_id=eos, force_ids=golden_ids,
                        stop_after=max(steps) + 1)
    finally:
        recorder.close()
    return recorder.by_step


@dataclass
class LayerSteps:
    """``golden_layer_steps``' answer: step -> the selected modules' calls at that step, or why the
    dump cannot stand for a golden re-run (``missing``); ``fidelity``: the largest rel_l2 between a
    recomputed layer output and its dumped one."""

    calls: dict[int, dict[str, Call]] = field(default_factory=dict)
    missing: str | None = None
    fidelity: float = 0.0


@torch.no_grad()
def golden_layer_steps(reader: DumpReader, golden: Any, layers: list[str], steps: int,
                       select: Callable[[str, nn.Module], bool]) -> LayerSteps:
    """Each of ``layers`` re-run alone from its dumped inputs at steps 0..``steps``-1, in order,
    with a KV cache of its own: the calls of its modules ``select`` picks, per step (as
    ``golden_rerun_steps`` gives them, without running the rest of the model)."""
    found = LayerSteps()
    dumped = {(e.name, e.step) for e in reader.entries()
              if e.level == "module" and e.kind == "input" and e.name in layers and e.step < steps}
    lacking = [(n, s) for n in layers for s in range(steps) if (n, s) not in dumped]
    if lacking:
        name, step = lacking[0]
        found.missing = f"the golden dump holds no inputs of {name} at step {step}"
        return found
    caches = {e.pytype for e in reader.entries() if e.level == "module" and e.kind == "input"
              and e.name in layers and is_cache_type(e.pytype)}
    other = sorted(c for c in caches if cache_class(golden.model, c) is None)
    if other or len(caches) > 1:
        found.missing = f"the golden run's KV cache is a {(other or sorted(caches))[0]}"
        return found
    modules = dict(golden.model.named_modules())
    for layer in layers:
        module = modules[layer]
        cache = fresh_cache(golden.model, next(iter(caches))) if caches else None
        with layer_weights_held(golden.model, layer):
            for step in range(steps):
                call = next(calls_from_dump(reader, step, names={layer}, cache=cache), None)
                if call is None or not call.replayable or "0" not in call.outputs:
                    found.missing = (f"{layer} at step {step} cannot be re-run from the golden dump: "
                                     f"{call.reason if call is not None else 'not recorded'}")
                    return found
                try:  # a layer that cannot run alone (state kept elsewhere in the model): the whole re-run
                    sub, out = _run_layer(golden, module, layer, call, select)
                except Exception as exc:
                    found.missing = (f"{layer} cannot be re-run alone at step {step}: "
                                     f"{type(exc).__name__}: {exc}")
                    return found
                error = own_error(call.outputs["0"], out)["rel_l2"] if out is not None else math.inf
                found.fidelity = max(found.fidelity, error)
                if not error <= LAYER_RERUN_TOLERANCE:
                    found.missing = (f"{layer} re-run alone at step {step} lands {error:.2e} (rel_l2) from "
                                     "its dumped output")
                    return found
                found.calls.setdefault(step, {}).update(sub)
    return found


def rerun_fidelity(rerun: GoldenRerun, reader: DumpReader) -> float | None:
    """The largest |logit| difference between the re-run and the golden dump over the steps both
    hold (0.0 when the re-run reproduced the dump bit for bit); None when nothing to compare."""
    from llmflow.localize.tokens import logits_entries

    dumped = logits_entries(reader)
    worst: float | None = None
    for s, logits in enumerate(rerun.logits):
        if s not in dumped:
            continue
        ref = reader.load(dumped[s]).float()
        if ref.numel() != logits.numel():
            continue
        d = float((ref.reshape(logits.shape) - logits).abs().max())
        worst = d if worst is None else max(worst, d)
    return worst
