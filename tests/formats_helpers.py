"""Helpers of the formats tests: a tiny Llama's module tensors captured with plain forward hooks,
and the same values written as an msit torch dump and as an ATB dump (with our writers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from format_writers import write_atb_dump, write_msit_dump

LAYERS = 2
# Hugging Face module -> ATB op folder (relative to its model; top-level number n for layer n-1)
SUBS = {"input_layernorm": "0_RmsNorm", "self_attn": "1_Attention", "post_attention_layernorm": "2_RmsNorm",
        "mlp": "3_Mlp"}


def tiny_model() -> torch.nn.Module:
    from llmflow.models import load_model

    return load_model(f"tiny-llama:layers={LAYERS},hidden=64,seed=0").model.eval()


def capture(model: torch.nn.Module, steps: int = 3, prompt: tuple[int, ...] = (1, 5, 7, 9)
            ) -> tuple[dict[int, dict[str, dict[str, Any]]], dict[str, str]]:
    """``{token: {module name: {"inputs": (tensors), "output": value}}}`` of a greedy run without a
    KV cache (each step re-runs the whole sequence), and module name -> class name."""
    tokens: dict[int, dict[str, dict[str, Any]]] = {}
    types = {n: type(m).__name__ for n, m in model.named_modules() if n}
    cur = {"step": 0}
    hooks = []

    def hook(name: str):
        def fn(mod, args, output):
            if isinstance(output, tuple):
                output = output[0] if len(output) == 1 else output
            ins = tuple(a for a in args if isinstance(a, torch.Tensor))
            tokens.setdefault(cur["step"], {})[name] = {"inputs": ins, "output": output}
        return fn

    for name, mod in model.named_modules():
        if name and "rotary" not in name and not name.endswith("act_fn"):
            hooks.append(mod.register_forward_hook(hook(name)))
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        for s in range(steps):
            cur["step"] = s
            logits = model(ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    for h in hooks:
        h.remove()
    return tokens, types


def atb_op(name: str) -> str | None:
    """The ATB op folder (own-model numbering) of a Hugging Face module, None if ATB has none."""
    parts = name.split(".")
    if name == "model.embed_tokens":
        return "0_WordEmbedding"
    if name == "model.norm":
        return f"{LAYERS + 1}_RmsNorm"
    if name == "lm_head":
        return f"{LAYERS + 2}_LmHead"
    if len(parts) == 3 and parts[:2] == ["model", "layers"]:
        return f"{int(parts[2]) + 1}_DecoderLayer"
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in SUBS:
        return f"{int(parts[2]) + 1}_DecoderLayer/{SUBS[parts[3]]}"
    return None


def _shift(op: str, start: int) -> str:
    top, _, rest = op.partition("/")
    n, _, typ = top.partition("_")
    return f"{int(n) + start}_{typ}" + (f"/{rest}" if rest else "")


def _nodes(start: int) -> list[dict[str, Any]]:
    layer = [{"opName": f"{t.split('_', 1)[1]}", "opType": t.split("_", 1)[1], "param": {},
              "inTensors": [], "outTensors": []} for t in SUBS.values()]
    tops = ["WordEmbedding"] + ["DecoderLayer"] * LAYERS + ["RmsNorm", "LmHead"]
    return [{"opName": f"{t}_{start + i}", "opType": t, "param": {}, "inTensors": [], "outTensors": [],
             **({"nodes": layer} if t == "DecoderLayer" else {})} for i, t in enumerate(tops)]


def write_atb_from_capture(path: Path, tokens: dict[int, dict[str, dict[str, Any]]], *,
                           two_models: bool = True, statistics: bool = False) -> Path:
    """The captured values as an ATB dump: with two models, round 0 is a warm-up of noise, round 1
    holds token 0 (prefill ops 0..N-1) and token 1 (decode ops N..2N-1), round r holds token r."""
    n_top = LAYERS + 3
    rounds: dict[int, dict[str, dict[str, list[torch.Tensor]]]] = {}

    def put(round_no: int, token: int, start: int) -> None:
        for name, call in tokens[token].items():
            op = atb_op(name)
            if op is None:
                continue
            out = call["output"]
            outs = [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)]
            rounds.setdefault(round_no, {})[_shift(op, start)] = {"in": list(call["inputs"]), "out": outs}

    if two_models:
        noise = {"in": [torch.randn(1, 4, 64)], "out": [torch.randn(1, 4, 64)]}
        rounds[0] = {"0_WordEmbedding": noise}
        put(1, 0, 0)
        for t in sorted(tokens):
            if t >= 1:
                put(max(t, 1), t, n_top)
        models = [{"modelName": "LlamaPrefillModel", "nodes": _nodes(0)},
                  {"modelName": "LlamaDecodeModel", "nodes": _nodes(n_top)}]
    else:
        for t in sorted(tokens):
            put(t, t, 0)
        models = [{"modelName": "LlamaModel", "nodes": _nodes(0)}]
    return write_atb_dump(path, rounds, models, timestamp="20250101_000000", statistics=statistics)


def write_msit_from_capture(path: Path, tokens: dict[int, dict[str, dict[str, Any]]],
                            types: dict[str, str], **kw: Any) -> Path:
    tree = {"name": "root", "type": "LlamaForCausalLM", "children": [
        {"name": f"root.{n}", "type": types[n], "children": []} for n in tokens[0]]}
    return write_msit_dump(path, tokens, tree=tree, types=types, timestamp="20250101_000000", **kw)
