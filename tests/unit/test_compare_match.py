"""Tensor matching within a step: names, op-mapping files (ATB <-> HF), sums, order, unmatched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmflow.compare.mappings import fill_template, glob_to_regex, load_mapping, resolve_mapping
from llmflow.compare.match import entry_levels, layer_positions, match_step
from llmflow.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import entry  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def hf_entries(n_layers: int = 2) -> list:
    names = [("model.embed_tokens", "Embedding")]
    for i in range(n_layers):
        p = f"model.layers.{i}"
        names += [
            (f"{p}.input_layernorm", "LlamaRMSNorm"),
            (f"{p}.self_attn", "LlamaAttention"),
            (f"{p}.post_attention_layernorm", "LlamaRMSNorm"),
            (f"{p}.mlp", "LlamaMLP"),
            (p, "LlamaDecoderLayer"),
        ]
    names += [("model.norm", "LlamaRMSNorm"), ("lm_head", "Linear")]
    return [entry(n, module_type=t, order=i) for i, (n, t) in enumerate(names)]


def atb_entries(n_layers: int = 2, sep: str = ".") -> list:
    names = [("0_WordEmbedding", "WordEmbedding")]
    for i in range(1, n_layers + 1):
        p = f"{i}_DecoderLayer"
        names += [
            (f"{p}{sep}0_RmsNorm", "RmsNorm"),
            (f"{p}{sep}1_SelfAttention", "SelfAttention"),
            (f"{p}{sep}2_RmsNorm", "RmsNorm"),
            (f"{p}{sep}3_Mlp", "Mlp"),
            (p, "DecoderLayer"),
        ]
    names += [(f"{n_layers + 1}_RmsNorm", "RmsNorm"), (f"{n_layers + 2}_LmHead", "LmHead")]
    return [entry(n, module_type=t, order=i) for i, (n, t) in enumerate(names)]


def pairs_by_name(pairs) -> dict:
    return {
        p.golden.name if p.golden else None: "+".join(t.name for t in p.targets)
        for p in pairs
        if not p.unmatched
    }


def test_same_names_match_by_name() -> None:
    pairs = match_step(hf_entries(), hf_entries(), golden_step=0, target_step=0, rank=0)
    assert all(p.match == "name" for p in pairs) and len(pairs) == len(hf_entries())
    layer = next(p for p in pairs if p.golden.name == "model.layers.1")
    assert layer.levels == ("layer", "module")


@pytest.mark.parametrize("sep", [".", "/"])
def test_atb_llama_mapping(sep: str) -> None:
    mapping = load_mapping("atb-llama")
    pairs = match_step(
        hf_entries(),
        atb_entries(sep=sep),
        golden_step=0,
        target_step=0,
        rank=0,
        mapping=mapping,
        order_fallback=False,
    )
    got = pairs_by_name(pairs)
    assert got["model.embed_tokens"] == "0_WordEmbedding"
    assert got["model.layers.0"] == "1_DecoderLayer"  # ATB index 0 is the embedding
    assert got["model.layers.1"] == "2_DecoderLayer"
    assert got["model.layers.1.input_layernorm"] == f"2_DecoderLayer{sep}0_RmsNorm"
    assert got["model.layers.1.post_attention_layernorm"] == f"2_DecoderLayer{sep}2_RmsNorm"
    assert got["model.layers.0.self_attn"] == f"1_DecoderLayer{sep}1_SelfAttention"
    assert got["model.layers.0.mlp"] == f"1_DecoderLayer{sep}3_Mlp"
    assert got["model.norm"] == "3_RmsNorm" and got["lm_head"] == "4_LmHead"
    assert all(p.match == "mapping" for p in pairs) and len(pairs) == len(hf_entries())
    # levels come from the golden side: the mapped decoder layer is a layer row
    assert next(p for p in pairs if p.targets[0].name == "2_DecoderLayer").levels == ("layer", "module")


def test_custom_mapping_sum_fused_and_regex(tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text(
        "rules:\n"
        "  - target: ['blk{n}.resid_a', 'blk{n}.resid_b']\n"  # split residual: a + b == golden
        "    golden: model.layers.{n}\n"
        "  - target: 'blk{n}.fused_qkv_rope'\n"  # a fused op replacing three golden ops
        "    golden: ['model.layers.{n}.q', 'model.layers.{n}.k', 'model.layers.{n}.rope']\n"
        "  - target: '^head\\.(?P<i>\\d+)$'\n"
        "    match: regex\n"
        "    golden: lm_head.{i*2}\n"
        "    golden_index: '1'\n"
    )
    golden = [
        entry("model.layers.3", order=0),
        entry("model.layers.3.rope", order=1),
        entry("lm_head.4", index="1", order=2),
        entry("model.only", order=3),
    ]
    target = [
        entry("blk3.resid_a", order=0),
        entry("blk3.fused_qkv_rope", order=1),
        entry("blk3.resid_b", order=2),
        entry("head.2", order=3),
        entry("extra.thing", order=4, shape=(9,)),
    ]
    pairs = match_step(
        golden, target, golden_step=0, target_step=0, rank=0, mapping=load_mapping(f), order_fallback=False
    )
    got = pairs_by_name(pairs)
    assert got == {
        "model.layers.3": "blk3.resid_a+blk3.resid_b",
        "model.layers.3.rope": "blk3.fused_qkv_rope",
        "lm_head.4": "head.2",
    }
    unmatched = {(p.match, (p.golden or p.targets[0]).name) for p in pairs if p.unmatched}
    assert unmatched == {("unmatched golden", "model.only"), ("unmatched target", "extra.thing")}


def test_order_fallback_pairs_module_outputs_by_shape() -> None:
    golden = [
        entry("a.x", module_type="LlamaMLP", order=0, shape=(4,)),
        entry("a.y", module_type="LlamaRMSNorm", order=1, shape=(2,)),
    ]
    target = [
        entry("other_mlp", module_type="Mlp", order=0, shape=(4,)),
        entry("noise", module_type="Foo", order=1, shape=(7,)),
        entry("other_norm", module_type="RMSNorm", order=2, shape=(2,)),
    ]
    pairs = match_step(golden, target, golden_step=0, target_step=0, rank=0)
    assert pairs_by_name(pairs) == {"a.x": "other_mlp", "a.y": "other_norm"}
    assert [p.match for p in pairs] == ["order", "order", "unmatched target"]


def test_order_fallback_never_pairs_across_layers() -> None:
    """ATB layer n's Mlp cannot pair (another shape); the next layer's Mlp, within the look-ahead,
    has the golden's shape: it must not stand in for it (it is the next layer's)."""
    golden = [entry(f"model.layers.{i}.mlp", module_type="LlamaMLP", order=i, shape=(4,)) for i in range(3)]
    target = [entry("1_DecoderLayer.3_Mlp", module_type="Mlp", order=0, shape=(1, 4)),
              entry("2_DecoderLayer.3_Mlp", module_type="Mlp", order=1, shape=(4,)),
              entry("3_DecoderLayer.3_Mlp", module_type="Mlp", order=2, shape=(4,))]
    pairs = match_step(golden, target, golden_step=0, target_step=0, rank=0)
    assert pairs_by_name(pairs) == {"model.layers.1.mlp": "2_DecoderLayer.3_Mlp",
                                    "model.layers.2.mlp": "3_DecoderLayer.3_Mlp"}
    assert {(p.match, (p.golden or p.targets[0]).name) for p in pairs if p.unmatched} == {
        ("unmatched golden", "model.layers.0.mlp"), ("unmatched target", "1_DecoderLayer.3_Mlp")}


def test_layer_positions_by_index_or_by_position() -> None:
    hf = hf_entries(3)
    pos = layer_positions(hf)
    assert [pos[id(e)] for e in hf if e.name.endswith(".mlp")] == [0, 1, 2]
    assert pos[id(hf[0])] is None and pos[id(hf[-1])] is None  # embedding, lm_head
    # ATB numbers its top-level ops, the embedding first: the layers' positions count from 0
    atb = atb_entries(3)
    pos = layer_positions(atb)
    assert [pos[id(e)] for e in atb if e.name.endswith("_Mlp")] == [0, 1, 2]
    assert pos[id(atb[0])] is None


def test_mapping_vars_are_read_from_the_target() -> None:
    """A model with an op before its first decoder layer numbers its layers from 2: layer_base
    comes from the target's names (or its topology), not from the file's default."""
    names = [("0_WordEmbedding", "WordEmbedding"), ("1_PositionEmbedding", "PositionEmbedding")]
    names += [(f"{i + 2}_DecoderLayer", "DecoderLayer") for i in range(2)]
    target = [entry(n, module_type=t, order=i) for i, (n, t) in enumerate(names)]

    class Reader:
        format = "atb"

        def entries(self):
            return target

        def topology(self):
            return None

    mapping = load_mapping("atb-llama")
    assert mapping.variables == {"layer_base": 1} and mapping.detects(Reader())
    bound = mapping.bind(Reader())
    assert bound.variables == {"layer_base": 2} and bound.var_sources == {"layer_base": "entries"}
    pairs = match_step(hf_entries(), target, golden_step=0, target_step=0, rank=0, mapping=bound,
                       order_fallback=False)
    got = pairs_by_name(pairs)
    assert got["model.layers.0"] == "2_DecoderLayer" and got["model.layers.1"] == "3_DecoderLayer"


def test_levels_and_filter() -> None:
    assert entry_levels(entry("transformer.h.3")) == ("layer", "module")
    assert entry_levels(entry("model.layers.3", kind="input")) == ("module",)
    assert entry_levels(entry("logits", level="logits")) == ("logits",)
    assert entry_levels(entry("m/matmul.0", level="api")) == ("api",)
    assert entry_levels(entry("w", level="weight", step=-1)) == ()
    pairs = match_step(hf_entries(), hf_entries(), golden_step=0, target_step=0, rank=0, levels=["layer"])
    assert [p.golden.name for p in pairs] == ["model.layers.0", "model.layers.1"]
    assert all(p.levels == ("layer",) for p in pairs)


def test_non_tensor_entries_are_skipped() -> None:
    flag = entry("model", kind="input", index="kw:use_cache", has_data=False, dtype=None, shape=None)
    assert match_step([flag], [flag], golden_step=0, target_step=0, rank=0) == []


def test_templates_and_globs() -> None:
    caps = {"n": "5"}
    assert fill_template("l.{n-1}.{n+2}.{n*2}.{n//2}.{n}", caps) == "l.4.7.10.2.5"
    import re

    assert re.fullmatch(glob_to_regex("{n}_Layer?*Norm*"), "3_Layer.0_RmsNorm")
    assert not re.fullmatch(glob_to_regex("{n}_Layer?*Norm"), "3_Layer.0_Attn.1_RmsNorm")
    assert re.fullmatch(glob_to_regex("{n}_Layer**Norm"), "3_Layer.0_Attn.1_RmsNorm")


def test_mapping_errors_name_file_and_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - target: x\n    golden: y\n    kind: sideways\n")
    with pytest.raises(UserError, match=r"bad\.yaml: rules/0/kind"):
        load_mapping(bad)
    bad.write_text("rules:\n  - target: '{n}_X'\n    golden: 'layers.{m}'\n")
    with pytest.raises(UserError, match=r"bad\.yaml: rules/0/golden: .*\{m\}"):
        load_mapping(bad)
    bad.write_text("rules: [\n")
    with pytest.raises(UserError, match="cannot read mapping"):
        load_mapping(bad)
    j = tmp_path / "ok.json"
    j.write_text(json.dumps({"rules": [{"target_type": "RmsNorm", "golden": "norm"}]}))
    assert load_mapping(j).rules[0].target_type == "RmsNorm"
    bad.write_text("rules:\n  - target: '{n}_X'\n    golden: 'layers.{n-base}'\n")
    with pytest.raises(UserError, match=r"rules/0/golden: .*the var 'base'.*declared: none"):
        load_mapping(bad)
    with pytest.raises(UserError, match="unknown mapping"):
        resolve_mapping("no-such-mapping")
    with pytest.raises(UserError, match="no such file"):
        resolve_mapping("missing.yaml")


def test_schema_copy_is_the_shipped_one() -> None:
    shipped = REPO / "llmflow" / "data" / "mappings" / "mapping.schema.json"
    assert json.loads((REPO / "schemas" / "mapping.schema.json").read_text()) == json.loads(
        shipped.read_text()
    )


def test_module_names_follow_the_rule_of_each_modules_output(tmp_path: Path) -> None:
    """The bisect's golden module for a renamed target module: the rule that maps its output "0"
    (glob captures, a regex tail, a sequence by occurrence); an input-only rule is passed over, a
    many-to-one rule names no module, and a name no rule matches is left out."""
    f = tmp_path / "m.yaml"
    f.write_text(
        "rules:\n"
        "  - {kind: input, target: 'transformer.h.{n}.mlp', golden: 'wrong.{n}'}\n"
        "  - {target: ['transformer.h.{n}.a', 'transformer.h.{n}.b'], golden: 'model.layers.{n}'}\n"
        "  - {target: 'transformer.h.{n}.ln.*', golden_sequence: ['model.layers.{n}.input_layernorm',"
        " 'model.layers.{n}.post_attention_layernorm']}\n"
        "  - {match: regex, target: 'transformer\\.h\\.(?P<n>\\d+)\\.attn(?P<rest>(\\..+)?)',"
        " golden: 'model.layers.{n}.self_attn{rest}'}\n"
        "  - {match: regex, kind: any, target: 'transformer\\.h(?P<rest>(\\..+)?)',"
        " golden: 'model.layers{rest}'}\n")
    modules = ["transformer.h.0.ln.0", "transformer.h.0.attn", "transformer.h.0.attn.q_proj",
               "transformer.h.0.ln.1", "transformer.h.0.mlp", "transformer.h.0.a", "lm_head"]
    assert load_mapping(f).module_names((m, None) for m in modules) == {
        "transformer.h.0.ln.0": "model.layers.0.input_layernorm",
        "transformer.h.0.attn": "model.layers.0.self_attn",
        "transformer.h.0.attn.q_proj": "model.layers.0.self_attn.q_proj",
        "transformer.h.0.ln.1": "model.layers.0.post_attention_layernorm",
        "transformer.h.0.mlp": "model.layers.0.mlp"}
