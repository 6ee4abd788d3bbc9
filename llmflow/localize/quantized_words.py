"""What a verdict says of a quantized checkpoint (msModelSlim's): the quantization a module computes
with, the Linear layer named with the command that checks its weight and the ``disable_names`` that
keeps it in float, and the most sensitive Linear layers where none is a fault. Every name is given as
the checkpoint stores it (``stored_name``), which is what msModelSlim's ``disable_names`` takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmflow.errors import UserError
from llmflow.results.verdict import ExpertLinearRow


def quantization_of(name: str | None, quantized: dict[str, str] | None) -> str | None:
    """The quantization module ``name`` computes with: its own (a quantized Linear layer), or the
    one type of the quantized Linear layers inside it (a mixture of experts whose experts a
    checkpoint quantized one by one, a block of them); None: none, or several types."""
    if not name or not quantized:
        return None
    if name in quantized:
        return quantized[name]
    inner = {q for n, q in quantized.items() if n.startswith(name + ".")}
    return inner.pop() if len(inner) == 1 else None



#: how many of a quantized block's Linear layers the verdict lists for disable_names
QUANT_BLOCK_SHOWN = 6
#: how many of a quantized checkpoint's most sensitive Linear layers the verdict names
QUANT_SENSITIVE_SHOWN = 5


def weights_path(spec: dict[str, Any] | None) -> str | None:
    """Where a side's weights are, for a command to run on them: its checkpoint folder (SmolLM2's
    converted copy, a model directory), else the spec as given."""
    from llmflow.models import checkpoint_dir

    model = (spec or {}).get("model")
    if not model:
        return None
    try:
        found = checkpoint_dir(model, spec.get("base_dir") or ".")  # type: ignore[union-attr]
    except (UserError, OSError):
        found = None
    return str(found) if found is not None else model


def stored_name(quantized_names: dict[str, str] | None) -> Callable[[str], str]:
    """A quantized Linear layer's name as msModelSlim's ``disable_names`` takes it: the one its
    checkpoint stores it under (a transformers 4 layout's, where the model names it otherwise)."""
    names = quantized_names or {}
    return lambda name: names.get(name, name)


def quantized_layer(module: str, qtype: str, detail: str | None, golden: str | None,
                     target: str | None, stored: Callable[[str], str]) -> str:
    """What the verdict adds where the module named is a Linear layer of a quantized checkpoint."""
    said = f" {module} is a {qtype} Linear layer of the quantized checkpoint"
    said += f" (stored as {stored(module)})" if stored(module) != module else ""
    said += f"; on the golden input, {detail}." if detail else "."
    return (said + " Its weight against the float one: llmflow run weight_check "
            f"--set golden={golden or 'FLOAT'} --set target={target or 'QUANTIZED'}; to keep it in float, "
            f"quantize again with it in msModelSlim's disable_names (['{stored(module)}']).")


def expert_linear_clause(linear: ExpertLinearRow | None, rows: list[ExpertLinearRow], expert: int,
                          stored: Callable[[str], str]) -> str:
    """What the verdict adds where a quantized checkpoint's expert stands out: which of its Linear
    layers, replayed alone on the golden expert's input, stands out from the same projection in
    the other experts (or that they err alike)."""
    if linear is not None:
        where = f" (stored as {stored(linear.name)})" if stored(linear.name) != linear.name else ""
        return (f", and of its Linear layers, {linear.projection}{where}: replayed alone on the golden "
                f"expert's input ({linear.tokens} token(s)) it is {linear.rel_l2:.3g} off, "
                f"{linear.score:.0f}x the {linear.typical:.2g} of the same projection in the other experts")
    own = [r for r in rows if r.expert == expert and r.score is not None]
    if not own:
        return ""
    return ("; its Linear layers, each replayed alone on the golden expert's input, err alike ("
            + ", ".join(f"{r.projection} {r.score:.1f}x" for r in own)
            + " the same projection in the other experts)")


def quantized_block(module: str, qtype: str, expert: int | None, quantized: dict[str, str],
                     stored: Callable[[str], str]) -> str:
    """What the verdict adds where the module named holds quantized Linear layers (a mixture of
    experts, of which ``expert`` stands out where one does)."""
    inside = f"{module}.{expert}." if expert is not None else f"{module}."
    names = sorted((n for n in quantized if n.startswith(inside)), key=lambda n: n.count("."))
    who = f"{module}'s expert {expert}" if expert is not None else module
    shown = ", ".join(repr(stored(n)) for n in names[:QUANT_BLOCK_SHOWN])
    shown += ", ..." if len(names) > QUANT_BLOCK_SHOWN else ""
    return (f" {who} computes with {len(names)} {qtype} Linear layer(s) of the quantized checkpoint; to "
            "keep them in float, quantize again with them in "
            f"msModelSlim's disable_names ([{shown}]).")


def sensitive_linears(replayed: list[dict[str, Any]], quantized: dict[str, str]) -> list[dict[str, Any]]:
    """The replayed rows of the quantized Linear layers with the largest own error, largest first."""
    return sorted((r for r in replayed if r["name"] in quantized and r.get("rel_l2") is not None),
                  key=lambda r: -r["rel_l2"])[:QUANT_SENSITIVE_SHOWN]


def most_sensitive(replayed: list[dict[str, Any]], quantized: dict[str, str] | None,
                    stored: Callable[[str], str]) -> str:
    """A quantized target that passes: its most sensitive Linear layers, to keep in float for a
    result nearer the float model (empty for a float target)."""
    linears = sensitive_linears(replayed, quantized or {})
    if not linears:
        return ""
    return (" Its most sensitive quantized Linear layers (own error on the golden inputs): "
            + ", ".join(f"{stored(r['name'])} ({r['rel_l2']:.3g})" for r in linears)
            + "; msModelSlim's disable_names keeps a layer in float.")


def quantization_spread(replayed: list[dict[str, Any]], quantized: dict[str, str], steps: str,
                         stored: Callable[[str], str]) -> tuple[str, str]:
    """Why a quantized checkpoint whose Linear layers err alike is inconclusive, and what to run:
    its most sensitive Linear layers (the largest own error replayed on the golden inputs), the
    ones msModelSlim users keep in float (``disable_names``)."""
    linears = sensitive_linears(replayed, quantized)
    kinds = ", ".join(sorted(set(quantized.values())))
    reason = (f"the target is a quantized checkpoint ({len(quantized)} {kinds} Linear layers) and none of "
              f"its modules' own error stands out at {steps}: the drift is the quantization's own, spread "
              "over the layers, not one layer's fault")
    if not linears:
        return reason, ("dump both sides in module mode and compare them (llmflow compare) to see where the "
                        "error grows")
    reason += "; the most sensitive Linear layers: " + ", ".join(
        f"{stored(r['name'])} ({r['rel_l2']:.3g})" for r in linears)
    names = ", ".join(f"'{stored(r['name'])}'" for r in linears)
    return reason, (f"keep the most sensitive Linear layers in float and quantize again (msModelSlim "
                    f"QuantConfig disable_names=[{names}]), or use a finer scheme (W8A16, per-group "
                    "scales, anti-outlier); then bisect again")


def quantized_sentences(module: str, expert: int | None, linear: ExpertLinearRow | None,
                        ranked: list[dict[str, Any]], detail: str | None,
                        specs: tuple[dict[str, Any] | None, dict[str, Any] | None],
                        quantized: dict[str, str], stored: Callable[[str], str]) -> str:
    """What a fault's diagnosis adds where the target is a quantized checkpoint: the Linear layer
    named (itself, or the expert's that stands out) with its weight check and ``disable_names``, and
    the next most sensitive ones; or the quantized Linear layers inside the block named."""
    golden, target = (weights_path(spec) for spec in specs)
    if module in quantized:
        said = quantized_layer(module, quantized[module], detail, golden, target, stored)
        after = [r for r in ranked if r["name"] in quantized and r["name"] != module
                 and r.get("score") is not None][:QUANT_SENSITIVE_SHOWN - 1]
        if after:
            said += (" The next most sensitive quantized Linear layers: "
                     + ", ".join(f"{stored(r['name'])} ({r['score']:.1f}x)" for r in after) + ".")
        return said
    if linear is not None and linear.name in quantized:
        return quantized_layer(linear.name, quantized[linear.name], detail, golden, target, stored)
    qtype = quantization_of(module, quantized)
    return quantized_block(module, qtype, expert, quantized, stored) if qtype else ""


#: how many Linear layers set aside as explained by their quantization the verdict names
QUANT_EXPLAINED_SHOWN = 3
#: how the reason of a quantized target whose divergence its quantization explains begins
EXPLAINED_REASON = "the divergence is explained by the quantization"


def _explained_layers(explained: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per Linear layer set aside (a module carrying a Linear layer's error is said as that
    layer), the first set aside first."""
    seen: dict[str, dict[str, Any]] = {}
    for r in explained:
        if r.get("account") is not None:
            seen.setdefault(r["linear"], r)
    return list(seen.values())[:QUANT_EXPLAINED_SHOWN]


def _explained_words(row: dict[str, Any], stored: Callable[[str], str]) -> str:
    said = (f"{stored(row['linear'])} ({row['score']:.1f}x the same module in the other layers; "
            f"{row['account'].words(counts=not row.get('detail'))}")
    return said + (f"; {row['detail']})" if row.get("detail") else ")")


def explained_sentence(explained: list[dict[str, Any]], stored: Callable[[str], str]) -> str:
    """What a verdict adds where quantized Linear layers standing out were set aside because their
    quantization explains their own error (``bisect.set_aside_quantization``)."""
    rows = _explained_layers(explained)
    if not rows:
        return ""
    return ("Set aside, their own error explained by their quantization (a calibration on other prompts "
            "clipping a few of this prompt's values, and int8 rounding; their weights within int8 rounding "
            "of the float ones): " + "; ".join(_explained_words(r, stored) for r in rows) + ".")


def quantization_explained(explained: list[dict[str, Any]], steps: str,
                           stored: Callable[[str], str]) -> tuple[str, str]:
    """Why a quantized checkpoint whose texts or logits part where only Linear layers whose error
    their quantization explains stand out is inconclusive, and what to run: the divergence is the
    quantization's, at the layers named, not a fault of the port."""
    rows = _explained_layers(explained)
    names = ", ".join(f"'{stored(r['linear'])}'" for r in rows)
    reason = (f"{EXPLAINED_REASON} at {', '.join(stored(r['linear']) for r in rows)}: "
              f"at {steps} no module stands out but Linear layers whose own error their quantization "
              "explains, a calibration on other prompts clipping a few of this prompt's values and int8 "
              "rounding, their weights within int8 rounding of the float ones: "
              + "; ".join(_explained_words(r, stored) for r in rows)
              + ". That is the quantization doing what it does, not a fault of the port")
    return reason, (f"to bring the target nearer the float model, keep those layers in float (msModelSlim "
                    f"QuantConfig disable_names=[{names}]) or calibrate on prompts like this one, then "
                    "bisect again")
