"""A torch (msit) dump against an ATB dump of the same Llama, compared without -mf: the ATB
mapping is picked from the target's topology, its layer numbering read from the model json, and
the rows are the ones -mf atb-llama gives. The torch side has modules ATB has no node for (the
rotary embedding, every Linear): they never shift the pairing by a layer."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from llmflow.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from format_writers import write_atb_dump, write_msit_dump  # noqa: E402
from formats_helpers import LAYERS, SUBS, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def captured() -> tuple[dict[int, dict[str, dict[str, Any]]], dict[str, str]]:
    """Every module's inputs and outputs (the rotary embedding and the Linears included, as msit
    dumps them) of a 3-token greedy run without a KV cache."""
    model = tiny_model()
    tokens: dict[int, dict[str, dict[str, Any]]] = {}
    types = {n: type(m).__name__ for n, m in model.named_modules() if n}
    step = {"n": 0}

    def hook(name: str):
        def fn(mod, args, output):
            ins = tuple(a for a in args if isinstance(a, torch.Tensor))
            if isinstance(output, tuple) and len(output) == 1:
                output = output[0]
            tokens.setdefault(step["n"], {})[name] = {"inputs": ins, "output": output}
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        for s in range(3):
            step["n"] = s
            logits = model(ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    for h in handles:
        h.remove()
    return tokens, types


def write_msit(path: Path, tokens, types) -> Path:
    tree = {"name": "root", "type": "LlamaForCausalLM",
            "children": [{"name": f"root.{n}", "type": types[n], "children": []} for n in tokens[0]]}
    return write_msit_dump(path, tokens, tree=tree, types=types, timestamp="20250101_000000")


def write_atb(path: Path, tokens, *, before_layers: tuple[str, ...] = ()) -> Path:
    """An ATB dump (one model: round r is token r) of the same values. ``before_layers``: extra
    top-level ops between the embedding and the first decoder layer (their number shifts the
    layers' numbers, as in engines that gather the rotary tables there)."""
    base = 1 + len(before_layers)
    tops = ["WordEmbedding", *before_layers] + ["DecoderLayer"] * LAYERS + ["RmsNorm", "LmHead"]
    layer_nodes = [{"opName": t.split("_", 1)[1], "opType": t.split("_", 1)[1]} for t in SUBS.values()]
    nodes = [{"opName": f"{t}_{i}", "opType": t, **({"nodes": layer_nodes} if t == "DecoderLayer" else {})}
             for i, t in enumerate(tops)]
    def tensors(call: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
        out = call["output"]
        outs = [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)]
        return {"in": list(call["inputs"]), "out": outs}

    rounds: dict[int, dict[str, dict[str, list[torch.Tensor]]]] = {}
    for s, mods in tokens.items():
        ops = {"0_WordEmbedding": tensors(mods["model.embed_tokens"])}
        for k, op in enumerate(before_layers):  # values of their own (the rotary tables' cos)
            ops[f"{k + 1}_{op}"] = {"in": [], "out": [mods["model.rotary_emb"]["output"][0]]}
        for i in range(LAYERS):
            ops[f"{base + i}_DecoderLayer"] = tensors(mods[f"model.layers.{i}"])
            for sub, folder in SUBS.items():
                ops[f"{base + i}_DecoderLayer/{folder}"] = tensors(mods[f"model.layers.{i}.{sub}"])
        ops[f"{base + LAYERS}_RmsNorm"] = tensors(mods["model.norm"])
        ops[f"{base + LAYERS + 1}_LmHead"] = tensors(mods["lm_head"])
        rounds[s] = ops
    return write_atb_dump(path, rounds, [{"modelName": "LlamaModel", "nodes": nodes}],
                          timestamp="20250101_000000")


def run(tmp: Path, g: Path, t: Path, name: str, *extra: str) -> tuple[int, list[dict[str, str]], dict, str]:
    out = tmp / name
    rc = main(["compare", "-gp", str(g), "-mp", str(t), "-o", str(out), "--no-xlsx", *extra])
    rows = [r for p in sorted(out.glob("compare_*.csv")) for r in csv.DictReader(open(p))]
    return rc, rows, json.loads((out / "compare_summary.json").read_text()), str(out)


def key(r: dict[str, str]) -> tuple:
    return r["step"], r["name"], r["target_name"], r["kind"], r["index"]


@pytest.mark.parametrize("before_layers", [(), ("PositionEmbedding",)],
                         ids=["embedding-first", "one-op-more"])
def test_atb_against_torch_needs_no_mapping_flag(tmp_path: Path, captured, capsys, before_layers) -> None:
    tokens, types = captured
    g = write_msit(tmp_path / "torch", tokens, types)
    t = write_atb(tmp_path / "atb", tokens, before_layers=before_layers)
    rc, rows, summary, _ = run(tmp_path, g, t, "auto")
    out = capsys.readouterr().out
    assert rc == 0, out
    m = summary["matching"]
    assert (m["method"], m["mapping"], m["chosen"]) == ("mapping", "atb-llama", "automatically")
    assert m["vars"] == {"layer_base": 1 + len(before_layers)}
    assert ("matching: mapping atb-llama (chosen automatically: the target is an atb dump with "
            "DecoderLayer ops") in out
    paired = [r for r in rows if r["name"] and r["target_name"]]
    names = {(r["name"], r["target_name"]) for r in paired}
    base = 1 + len(before_layers)
    for i in range(LAYERS):
        assert (f"model.layers.{i}.mlp", f"{base + i}_DecoderLayer.3_Mlp") in names
        assert (f"model.layers.{i}", f"{base + i}_DecoderLayer") in names
    # the same values on both sides: every paired row passes, no pair crosses a layer
    assert all(r["verdict"] == "pass" for r in paired), [r for r in paired if r["verdict"] != "pass"][:2]
    assert summary["coverage"]["state"] == "complete" and summary["coverage"]["golden_only"] > 0
    # -mf atb-llama gives the same rows, number for number
    rc2, given, summary2, _ = run(tmp_path, g, t, "given", "-mf", "atb-llama")
    assert rc2 == 0 and summary2["matching"]["chosen"] == "given"
    metrics = ("cosine_similarity", "max_absolute_error", "golden_norm", "target_norm")
    assert {key(r): [r[c] for c in metrics] for r in rows} == {key(r): [r[c] for c in metrics] for r in given}


def test_a_faulty_atb_op_is_blamed_at_its_own_layer(tmp_path: Path, captured, capsys) -> None:
    tokens, types = captured
    bad = {s: {n: dict(c) for n, c in mods.items()} for s, mods in tokens.items()}
    for s in bad:
        bad[s]["model.layers.1.mlp"]["output"] = bad[s]["model.layers.1.mlp"]["output"] * 1.5
    g = write_msit(tmp_path / "torch", tokens, types)
    t = write_atb(tmp_path / "atb", bad, before_layers=("PositionEmbedding",))
    rc, rows, summary, _ = run(tmp_path, g, t, "auto", "-cl", "module")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and "first: model.layers.1.mlp (step 0" in last, last
    failed = {r["name"] for r in rows if r["verdict"] == "fail"}
    assert "model.layers.1.mlp" in failed and not any(n.startswith("model.layers.0") for n in failed)
