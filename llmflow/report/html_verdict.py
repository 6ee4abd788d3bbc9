"""The verdict and the run as the report shows them: a banner, the fields, the replay and routing
evidence, the cost in units a person reads, the two sides' versions.

Everything here turns the bisect stage's verdict dict (``llmflow.localize.verdict``) and the
dumps' ``env.json`` into plain values for the template. Keys a verdict may lack are optional:
a verdict without ``status`` gets its banner from the fields it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STATUS_LABELS = {"pass": "PASSED", "fail": "FAILED", "inconclusive": "INCONCLUSIVE", "drift": "DRIFT"}


def step_label(step: Any) -> str:
    """``0`` -> "step 0 (prefill)", ``5`` -> "step 5 (decode)"."""
    if not isinstance(step, int):
        return f"step {step}"
    return f"step {step} ({'prefill' if step == 0 else 'decode'})"


def banner(v: Mapping[str, Any]) -> dict[str, str]:
    """``{"status", "label", "headline"}``: the verdict's own status and headline when it has
    them; otherwise derived: a blamed module or op is a fail, identical outputs a pass, outputs
    that drift with no module standing out a drift."""
    status = v.get("status")
    headline = v.get("headline")
    if status not in ("pass", "fail", "inconclusive"):
        if v.get("first_bad_layer") is not None or v.get("first_bad_op") is not None:
            status = "fail"
            where = v.get("first_bad_op") or v.get("first_bad_module") or v.get("first_bad_layer")
            headline = headline or f"fault localised to {where}"
        elif v.get("first_mismatch_token") is None and v.get("first_bad_token") is None:
            status = "pass"
            headline = headline or "the target matches the golden"
        else:
            status = "drift"
            headline = headline or "the outputs drift; no single module stands out"
    return {"status": str(status), "label": STATUS_LABELS[str(status)], "headline": str(headline or "")}


def fields(v: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The localisation, coarse to fine, as (label, value) pairs ("none" when not found)."""
    out = [("first mismatching token", v.get("first_mismatch_token")),
           ("first bad token (logits)", v.get("first_bad_token")),
           ("first bad layer", v.get("first_bad_layer")),
           ("first bad module", v.get("first_bad_module")),
           ("first bad op", v.get("first_bad_op"))]
    detail = v.get("token_detail") or {}
    if detail.get("golden_token") is not None:
        out.append(("tokens at the mismatch",
                    f"golden {detail.get('golden_token')!r} vs target {detail.get('target_token')!r}"))
    return [(label, "none" if value is None else str(value)) for label, value in out]


def replay(v: Mapping[str, Any]) -> dict[str, Any] | None:
    """The isolation replay: step, counts, where, and the not-replayable modules per reason."""
    r = v.get("replay")
    if not isinstance(r, Mapping):
        return None

    def count(x: Any) -> Any:
        return len(x) if isinstance(x, (list, tuple, dict)) else x

    reasons = r.get("reasons") or {}
    return {"step": r.get("step"), "step_label": step_label(r.get("step")),
            "replayed": count(r.get("replayed")), "not_replayable": count(r.get("not_replayable")),
            "where": " ".join(str(r[k]) for k in ("device", "dtype") if r.get(k)),
            "ratio_threshold": r.get("ratio_threshold"),
            "reasons": [{"reason": str(reason), "modules": [str(m) for m in names]}
                        for reason, names in reasons.items()
                        if isinstance(names, (list, tuple))]}


def inconclusive(v: Mapping[str, Any]) -> dict[str, str] | None:
    info = v.get("inconclusive")
    if not isinstance(info, Mapping):
        return None
    return {"reason": str(info.get("reason") or ""), "next": str(info.get("next") or "")}


def routing(v: Mapping[str, Any]) -> list[dict[str, Any]]:
    """MoE routing differences: one row per (layer, step)."""
    rows = v.get("routing") or []
    return [dict(r) for r in rows if isinstance(r, Mapping)] if isinstance(rows, list) else []


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


def cost(c: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``{"items": [{label, text, exact}], "groups": [{label, rows: [{label, text, exact}]}]}``:
    scalars formatted by unit (``exact`` keeps the raw number for a tooltip), nested dicts (model
    runs, phase seconds) as small tables of their own."""
    if not c:
        return None
    items, groups = [], []
    for key, value in c.items():
        if isinstance(value, Mapping):
            unit_key = key if ("seconds" in key or "bytes" in key) else ""
            groups.append({"label": _label(key),
                           "rows": [{"label": _label(str(k)), "text": fmt_value(unit_key or str(k), v),
                                     "exact": str(v)} for k, v in value.items()]})
        else:
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
