"""The whole narrowing, coarse to fine, as one function: ``run_bisect(BisectInputs) -> verdict``.

  1. token   per-step logits of the two dumps -> first mismatching / first bad token (tokens.py)
  2. raw     module outputs both dumps hold -> the raw per-layer error curve (inherited error)
  3. module  isolation replay of every branch module of the TARGET on the GOLDEN inputs recorded
             in the golden dump (replay.py) -> own errors, ranked per module type (rank.py)
  4. op      the chosen module replayed on both sides with API capture (ops.py)
  5. cost    bytes dumped and model runs, against a full API-level dump of both sides (cost.py)

Nothing is re-dumped to disk: replay reads the golden dump and keeps its captures in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmflow.formats import open_dump
from llmflow.formats.base import DumpReader
from llmflow.localize import cost as cost_mod
from llmflow.localize import ops as ops_mod
from llmflow.localize.golden import golden_call, golden_calls
from llmflow.localize.rank import (
    DEFAULT_RATIO_THRESHOLD,
    first_jump,
    layer_index,
    layer_of,
    pick_candidate,
    rank_modules,
)
from llmflow.localize.replay import is_branch, own_error, replay_modules
from llmflow.localize.tokens import first_bad_step, first_mismatch, token_rows

CURVE_METRICS = {"rel_l2": "relative L2 error", "cos_dist": "cosine distance (1 - cos)",
                 "max_rel": "max abs error / max |golden|"}


@dataclass
class BisectInputs:
    """What the bisect needs: the two dumps, what each side generated, and how to reload each
    side's model (a dump stage's ``model_spec``: model, device, dtype, patch, base_dir)."""

    golden_dump: str | Path
    target_dump: str | Path
    golden_spec: dict[str, Any]
    target_spec: dict[str, Any]
    golden_ids: list[int]
    target_ids: list[int]
    prompt_ids: list[int] = field(default_factory=list)
    pairs: list[dict[str, int]] | None = None
    replay_step: int = 0
    ratio_threshold: float = DEFAULT_RATIO_THRESHOLD
    thresholds: dict[str, Any] | None = None
    op_level: bool = True
    estimate_cost: bool = True
    top_k: int = 15


Progress = Callable[[str, float | None], Any]


def _load(spec: dict[str, Any]) -> Any:
    from llmflow.models import load_model

    keys = ("device", "dtype", "patch", "base_dir")
    return load_model(spec["model"], **{k: spec[k] for k in keys if spec.get(k) is not None})


def raw_errors(golden: DumpReader, target: DumpReader, step: int) -> dict[str, dict[str, float]]:
    """Output ``"0"`` of every module both dumps hold at ``step``: error metrics (inherited error)."""
    def outs(reader: DumpReader) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for e in reader.entries():
            if (e.step == step and e.level == "module" and e.kind == "output" and e.index == "0"
                    and e.has_data and e.is_tensor):
                found.setdefault(e.name, e)
        return found
    g, t = outs(golden), outs(target)
    return {n: own_error(golden.load(g[n]), target.load(t[n])) for n in g if n in t}


def _curves(raw: dict[str, dict[str, float]], iso_rows: list[dict[str, Any]]) -> dict[str, Any]:
    curves: dict[str, Any] = {}
    for key, label in CURVE_METRICS.items():
        raw_s: dict[int, float] = {}
        iso: dict[int, float] = {}
        series = {"raw (layer output, dumps)": raw_s, "isolated (worst module, replay)": iso}
        for name, m in raw.items():
            if layer_of(name) == name:
                raw_s[layer_index(name)] = m[key]
        for r in iso_rows:
            idx = layer_index(r["name"])
            if idx is not None and r.get(key) is not None:
                iso[idx] = max(iso.get(idx, 0.0), r[key])
        curves[label] = {k: {str(x): y for x, y in sorted(v.items())} for k, v in series.items()}
    return curves


def run_bisect(inp: BisectInputs, *, log: Callable[[str], None] = print,
               progress: Progress | None = None) -> dict[str, Any]:
    """Narrow the divergence down; returns the verdict dict (JSON-ready)."""
    t0 = time.time()
    phases: dict[str, float] = {}
    mark = [t0]

    def phase(name: str) -> None:
        now = time.time()
        phases[name] = round(now - mark[0], 2)
        mark[0] = now

    golden, target = open_dump(inp.golden_dump), open_dump(inp.target_dump)
    tgt = _load(inp.target_spec)
    phase("load target model")
    tok = tgt.tokenizer
    held: dict[str, Any] = {}

    def load_golden() -> Any:
        """The golden model, loaded on first use (layer recompute, op level, cost estimate)."""
        if "golden" not in held:
            held["golden"] = _load(inp.golden_spec)
        return held["golden"]

    def decode(i: int) -> str:
        return tok.decode([i]) if tok is not None else str(i)

    # 1. token
    mismatch = first_mismatch(inp.golden_ids, inp.target_ids)
    rows = token_rows(golden, target, golden_ids=inp.golden_ids, target_ids=inp.target_ids,
                      pairs=inp.pairs, target_dtype=str(tgt.dtype).removeprefix("torch."),
                      thresholds=inp.thresholds, decode=decode)
    bad_token = first_bad_step(rows, mismatch)
    log(f"bisect: first mismatching token {mismatch}, first bad token (logits) {bad_token}")
    phase("token: logits per step")

    # 2. raw, 3. isolation replay
    raw = raw_errors(golden, target, inp.replay_step)
    stats: dict[str, int] = {}
    n_modules = sum(1 for n, m in tgt.model.named_modules() if n and is_branch(n, m))
    task = progress("isolation replay", float(n_modules)) if progress else None
    iso_rows = replay_modules(tgt.model, golden_calls(golden, inp.replay_step, load_golden, stats),
                              device=tgt.device, dtype=tgt.dtype, select=is_branch,
                              advance=task.advance if task is not None else None)
    replayed = [r for r in iso_rows if r.get("replayable")]
    ranked = rank_modules(replayed, ratio_threshold=inp.ratio_threshold)
    for r in iso_rows:
        if not r.get("replayable"):
            fallback = raw.get(r["name"], {})
            ranked.append({**r, "error": None, "score": None, "raw_rel_l2": fallback.get("rel_l2"),
                           "rank": len(ranked) + 1})
    for r in ranked:
        r["raw_rel_l2"] = raw.get(r["name"], {}).get("rel_l2")
    cand = pick_candidate(ranked)
    anomalous = bool(cand and cand.get("anomalous"))
    layer_fallback = None
    if not replayed:  # nothing replayable: the layer-output curve is all we have
        layer_names = sorted((n for n in raw if layer_of(n) == n), key=layer_index)
        jump = first_jump([raw[n]["rel_l2"] for n in layer_names], ratio=inp.ratio_threshold)
        layer_fallback = layer_names[jump] if jump is not None else None
    phase("module: isolation replay")
    log(f"bisect: replayed {len(replayed)} of {len(iso_rows)} modules; top candidate "
        f"{cand['name'] if cand else None} (score {cand['score'] if cand else float('nan'):.2f})")

    # 4. op
    op_rows: list[dict[str, Any]] = []
    first_op = None
    call = golden_call(golden, inp.replay_step, cand["name"], load_golden) if anomalous else None
    if inp.op_level and call is not None and call.replayable:
        gld = load_golden()
        g_ops, t_ops = (ops_mod.capture_ops(dict(side.model.named_modules())[cand["name"]], cand["name"],
                                            call, device=side.device, dtype=side.dtype)
                        for side in (gld, tgt))
        op_rows, first_op = ops_mod.compare_ops(g_ops, t_ops, target_dtype=tgt.dtype,
                                                ratio=inp.ratio_threshold)
        log(f"bisect: {len(t_ops)} target ops in {cand['name']}; first bad op {first_op}")
        phase("op: replay with API capture")

    # 5. cost
    cost: dict[str, Any] = {
        "model_runs": {"full_generations": 2, "models_loaded_by_bisect": 1 + ("golden" in held),
                       "golden_layers_recomputed": stats.get("recomputed_layers", 0),
                       "module_replays": len(iso_rows), "op_replays": len(op_rows)},
        "bytes_dumped": cost_mod.dir_bytes(inp.golden_dump) + cost_mod.dir_bytes(inp.target_dump),
        "golden_dump_bytes": cost_mod.dir_bytes(inp.golden_dump),
        "target_dump_bytes": cost_mod.dir_bytes(inp.target_dump),
    }
    if inp.estimate_cost and inp.prompt_ids:
        n = max(len(inp.golden_ids), 1)
        full = sum(cost_mod.estimate_api_dump_bytes(m.model, inp.prompt_ids, n)["total_bytes"]
                   for m in (load_golden(), tgt))
        cost["full_api_dump_bytes_estimate"] = full
        cost["bytes_fraction_of_full_api_dump"] = round(cost["bytes_dumped"] / max(full, 1), 4)
        phase("cost: full API dump estimate")

    cost["bisect_seconds"] = round(time.time() - t0, 2)
    cost["bisect_phase_seconds"] = phases
    verdict = _compose(inp, rows, mismatch, bad_token, ranked, cand, anomalous, layer_fallback,
                       op_rows, first_op, raw, replayed, decode, tgt)
    verdict["cost"] = cost
    held.clear()
    return verdict


def _compose(inp: BisectInputs, rows: list[dict[str, Any]], mismatch: int | None, bad_token: int | None,
             ranked: list[dict[str, Any]], cand: dict[str, Any] | None, anomalous: bool,
             layer_fallback: str | None, op_rows: list[dict[str, Any]], first_op: str | None,
             raw: dict[str, dict[str, float]], replayed: list[dict[str, Any]],
             decode: Callable[[int], str], tgt: Any) -> dict[str, Any]:
    dtype = str(tgt.dtype).removeprefix("torch.")
    module = cand["name"] if cand and anomalous else None
    layer = layer_of(module) if module else layer_fallback
    by_step = {r["step"]: r for r in rows}
    detail: dict[str, Any] = {}
    if mismatch is not None:
        g = inp.golden_ids[mismatch] if mismatch < len(inp.golden_ids) else None
        t = inp.target_ids[mismatch] if mismatch < len(inp.target_ids) else None
        detail = {"step": mismatch, "golden_token": decode(g) if g is not None else None,
                  "target_token": decode(t) if t is not None else None,
                  "golden_margin": by_step.get(mismatch, {}).get("golden_margin"),
                  "kl": by_step.get(mismatch, {}).get("kl"),
                  "logits_max_abs_error": by_step.get(mismatch, {}).get("max_absolute_error")}
    if module:
        diagnosis = (f"{module} is the fault: replayed alone on the golden inputs it adds "
                     f"{cand['error']:.3g} relative error, {cand['score']:.0f}x the {cand['typical']:.2g} "
                     f"the same module adds in the other layers")
        diagnosis += f"; inside it, {first_op} is the first op that goes wrong." if first_op else "."
    else:
        worst = f"{cand['name']} at {cand['score']:.1f}x" if cand else "none replayable"
        diagnosis = (f"No module's own error stands out from the same module in the other layers "
                     f"(worst: {worst}, threshold {inp.ratio_threshold}x)")
        if mismatch is None and bad_token is None:
            diagnosis = "The target matches the golden: the same tokens, logits within the thresholds. " \
                        + diagnosis + "."
        else:
            diagnosis += f": the drift is the {dtype} rounding of every layer adding up, not one faulty op"
            noisy = _noisiest_types(replayed)
            diagnosis += f" (largest own errors: {noisy})." if noisy else "."
        if layer_fallback:
            diagnosis += f" The layer-output error jumps at {layer_fallback} (dump comparison)."
    if mismatch is not None and detail.get("golden_margin") is not None:
        diagnosis += (f" The texts first differ at generated token {mismatch} "
                      f"({detail['golden_token']!r} -> {detail['target_token']!r}), where the golden's "
                      f"top-2 logit margin was {detail['golden_margin']:.3g}")
        err = detail.get("logits_max_abs_error")
        diagnosis += (f" and the target's logits there differ by up to {err:.3g}: enough to swap "
                      f"the top two." if isinstance(err, (int, float)) and err >= detail["golden_margin"]
                      else ".")
    top = [r for r in ranked if r.get("score") is not None][: inp.top_k]
    evidence = [{"name": r["name"], "isolated_rel_l2": r["error"], "typical": r["typical"],
                 "score": r["score"], "raw_rel_l2": r.get("raw_rel_l2")} for r in top[:5]]
    keep = ("rank", "name", "module_type", "layer", "error", "typical", "score", "z", "anomalous",
            "raw_rel_l2", "max_abs", "cos_dist", "replayable", "reason")
    unreplayable = [r for r in ranked if r.get("score") is None]
    return {
        "first_mismatch_token": mismatch,
        "first_bad_token": bad_token,
        "first_bad_layer": layer,
        "first_bad_module": module,
        "first_bad_op": first_op if module else None,
        "diagnosis": diagnosis,
        "token_detail": detail,
        "evidence": evidence,
        "texts": {side: {"label": f"{spec.get('model')} {spec.get('dtype')} {spec.get('device')}"
                         + (f" patch={spec['patch']}" if spec.get("patch") else ""),
                         "text": "".join(decode(i) for i in ids), "tokens": [decode(i) for i in ids]}
                  for side, spec, ids in (("golden", inp.golden_spec, inp.golden_ids),
                                          ("target", inp.target_spec, inp.target_ids))},
        "curves": _curves(raw, replayed),
        "candidates": [{k: r.get(k) for k in keep} for r in top + unreplayable[:50]],
        "ops": op_rows,
        "token_rows": rows,
        "replay": {"step": inp.replay_step, "replayed": len(replayed),
                   "not_replayable": len(unreplayable), "ratio_threshold": inp.ratio_threshold,
                   "device": str(tgt.device), "dtype": dtype},
    }


def _noisiest_types(rows: list[dict[str, Any]], n: int = 3) -> str:
    """The module types with the largest median own error: where the dtype's rounding bites."""
    from statistics import median

    from llmflow.localize.rank import module_type

    by_type: dict[str, list[float]] = {}
    for r in rows:
        if r.get("rel_l2") is not None:
            by_type.setdefault(module_type(r["name"]), []).append(r["rel_l2"])
    top = sorted(((median(v), k) for k, v in by_type.items()), reverse=True)[:n]
    return ", ".join(f"{k} {m:.2g}" for m, k in top)


def to_json_safe(obj: Any) -> Any:
    """Floats that JSON cannot hold (inf, nan) as strings; tensors never reach here."""
    if isinstance(obj, dict):
        return {str(k): to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json_safe(v) for v in obj]
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    return obj
