"""The verdict and the run as the report shows them: a banner, the fields, the replay and routing
evidence, the cost in units a person reads, the two sides' versions.

Everything here turns the bisect's ``Verdict`` (``llmflow.results.verdict``, read back from
verdict.json), or, where no bisect ran, the outcome of the stage that concluded (a compare's, a
precheck's: ``StageOutcome``), and the dumps' ``env.json`` into plain values for the template.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmflow.results.verdict import Cost, Verdict

STATUS_LABELS = {"pass": "PASSED", "fail": "FAILED", "inconclusive": "INCONCLUSIVE"}


def step_label(step: Any) -> str:
    """``0`` -> "step 0 (prefill)", ``5`` -> "step 5 (decode)"."""
    if not isinstance(step, int):
        return f"step {step}"
    return f"step {step} ({'prefill' if step == 0 else 'decode'})"


@dataclass(frozen=True)
class StageOutcome:
    """What a stage other than the bisect concluded, in the words it gave the run (summary.json's
    ``outcome``): ``status`` (pass, fail or inconclusive), the ``headline`` and, when the evidence
    falls short, ``next``: what to run to get what is missing."""

    status: str
    headline: str
    next: str = ""


def banner(v: Verdict | StageOutcome) -> dict[str, str]:
    """``{"status", "label", "headline"}``: the verdict's (or the stage outcome's) status and headline."""
    return {"status": v.status, "label": STATUS_LABELS[v.status], "headline": v.headline}


def fields(v: Verdict) -> list[tuple[str, str]]:
    """The localisation, coarse to fine, as (label, value) pairs ("none" when not found)."""
    out: list[tuple[str, Any]] = [("first mismatching token", v.first_mismatch_token),
                                  ("first bad token (logits)", v.first_bad_token),
                                  ("first bad layer", v.first_bad_layer),
                                  ("first bad module", v.first_bad_module),
                                  ("first bad op", v.first_bad_op)]
    if v.isolation == "target_dump":  # no target model: the rank and what did not run say so
        out.insert(4, ("first bad rank", v.first_bad_rank if v.first_bad_rank is not None else
                       ("none stands out" if v.first_bad_module else None)))
        skipped = f"; not run: {', '.join(v.skipped)} (they need the target model)" if v.skipped else ""
        out.append(("isolation", f"the golden modules on the target dump's recorded inputs{skipped}"))
    detail = v.token_detail
    if detail.golden_token is not None:
        out.append(("tokens at the mismatch",
                    f"golden {detail.golden_token!r} vs target {detail.target_token!r}"))
    return [(label, "none" if value is None else str(value)) for label, value in out]


def replay(v: Verdict) -> dict[str, Any]:
    """The isolation replay: step, counts, where, and the not-replayable modules per reason."""
    r = v.replay
    return {"step": r.step, "step_label": step_label(r.step),
            "replayed": r.replayed, "not_replayable": r.not_replayable,
            "where": " ".join(x for x in (r.device, r.dtype) if x),
            "ratio_threshold": r.ratio_threshold,
            "reasons": [{"reason": reason, "modules": list(names)} for reason, names in r.reasons.items()]}


def inconclusive(v: Verdict | StageOutcome | None) -> dict[str, str] | None:
    """``{"reason", "next"}``: why the evidence does not settle it and what to run next; None when
    there is nothing to say. A stage outcome's headline already says why: only its next step."""
    if isinstance(v, StageOutcome):
        return {"reason": "", "next": v.next} if v.next else None
    info = v.inconclusive if v is not None else None
    if info is None:
        return None
    return {"reason": info.reason, "next": info.next}


def routing(v: Verdict | None) -> list[dict[str, Any]]:
    """MoE routing differences: one row per (MoE block, step)."""
    return [dataclasses.asdict(r) for r in v.routing] if v is not None else []


# ---------------------------------------------------------------- units a person reads

def fmt_bytes(n: float) -> str:
    """Decimal units, three significant digits: 206206 -> "206 kB", 1234567 -> "1.23 MB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    if s >= 120:
        return f"{int(s // 60)} min {s % 60:.0f} s"
    if s == 0:
        return "0 s"
    return f"{s:.3g} s" if s >= 0.01 else f"{s * 1000:.2g} ms"


def fmt_value(key: str, value: Any) -> str:
    """A cost value by what its key says it is: bytes, seconds, a fraction, or a count."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    if "fraction" in key:
        return f"{value * 100:.3g} %"
    if "bytes" in key:
        return fmt_bytes(value)
    if "seconds" in key:
        return fmt_seconds(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def _label(key: str) -> str:
    return key.replace("_", " ")


def cost(c: Cost | None) -> dict[str, Any] | None:
    """``{"items": [{label, text, exact}], "groups": [{label, rows: [{label, text, exact}]}]}``:
    scalars formatted by unit (``exact`` keeps the raw number for a tooltip), nested records
    (model runs, phase seconds) as small tables of their own; values not measured left out."""
    if c is None:
        return None
    items, groups = [], []
    for key, value in dataclasses.asdict(c).items():
        if isinstance(value, Mapping):
            unit_key = key if ("seconds" in key or "bytes" in key) else ""
            groups.append({"label": _label(key),
                           "rows": [{"label": _label(str(k)), "text": fmt_value(unit_key or str(k), v),
                                     "exact": str(v)} for k, v in value.items()]})
        elif value is not None:
            items.append({"label": _label(key), "text": fmt_value(key, value), "exact": str(value)})
    return {"items": items, "groups": groups}


# ---------------------------------------------------------------- the run

SIDE_ROWS = (  # (label, section of env.json, key, always shown as a row)
    ("model", "generation", "model", True), ("device", "generation", "device", True),
    ("dtype", "generation", "dtype", True), ("patch", "generation", "patch", True),
    ("torch", "versions", "torch", True), ("transformers", "versions", "transformers", True),
    ("torch_npu", "versions", "torch_npu", True), ("CUDA", "versions", "cuda", True),
    ("python", "versions", "python", False), ("platform", "versions", "platform", False),
    ("model class", "model_config", "model_class", False), ("tokenizer", "tokenizer", "class", False),
    ("chat template", "generation", "chat_template", False),
    ("new tokens", "generation", "max_new_tokens", False), ("sampling", "generation", "do_sample", False),
    ("threads", "torch_settings", "num_threads", False),
    ("fp32 matmul precision", "torch_settings", "float32_matmul_precision", False),
)


def sides(envs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """The two sides' setup from their env.json dicts (side -> dict, or None when not recorded):
    ``{"rows": [{label, golden, target, differs}], "same": [(label, value)]}``. The main facts
    (model, device, dtype, patch, versions) and any fact that differs are rows; the other facts
    both sides share are listed once in ``same``; facts both sides lack are left out."""
    rows, same = [], []
    for label, section, key, main in SIDE_ROWS:
        vals = {side: ((env or {}).get(section) or {}).get(key) for side, env in envs.items()}
        if label == "dtype":  # the model's own dtype when the generation record lacks it
            vals = {s: val if val is not None else ((envs[s] or {}).get("torch_settings") or {})
                    .get("model_dtype") for s, val in vals.items()}
        if all(x is None or x == "" for x in vals.values()):
            continue
        shown = {s: "" if x is None else str(x) for s, x in vals.items()}
        differs = len(set(shown.values())) > 1
        if main or differs:
            rows.append({"label": label, "golden": shown.get("golden", ""), "target": shown.get("target", ""),
                         "differs": differs})
        else:
            same.append((label, next(iter(shown.values()))))
    return {"rows": rows, "same": same}


def prompt_of(envs: Mapping[str, Mapping[str, Any] | None], params: Mapping[str, Any] | None) -> str | None:
    """The prompt both sides ran: the golden dump's record, else the run's ``prompt`` parameter."""
    for env in envs.values():
        p = ((env or {}).get("generation") or {}).get("prompt")
        if p:
            return str(p)
    p = (params or {}).get("prompt")
    return str(p) if p else None
