"""The report's module tree: the model's own hierarchy from topology.json, one collapsed row per
decoder layer, each module coloured by its own (replayed) error and labelled with its raw error,
the chosen module open and outlined, the ops under it; 80 layers in a page that stays small."""

from __future__ import annotations

import sys
from pathlib import Path

from llmflow.report.html import render_report
from llmflow.report.html_tree import module_tree, walk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import (  # noqa: E402
    find,
    parse_dom,
    synthetic_layer_rows,
    synthetic_topology,
    synthetic_verdict,
)


def _page(n_layers: int, bad_layer: int = 7, *, topology: dict | None = None, **verdict_args) -> str:
    verdict = synthetic_verdict(n_layers=n_layers, bad_layer=bad_layer, **verdict_args)
    return render_report(title="t", verdict=verdict,
                         compare={"layer": synthetic_layer_rows(n_layers=n_layers, bad_layer=bad_layer)},
                         topology=topology if topology is not None else synthetic_topology(n_layers))


def _node(dom: list, name: str):
    (li,) = find(dom, "li", data_name=name)
    return li


def _opened(li) -> bool:
    """Whether every <details> around ``li`` is open (so the node is visible)."""
    node = li.parent
    while node is not None:
        if node.tag == "details" and "open" not in node.attrs:
            return False
        node = node.parent
    return True


def test_eighty_layers_are_eighty_rows_with_the_chosen_module_open_and_outlined():
    html = _page(80, bad_layer=41)
    dom = parse_dom(html)
    start = html.index('<section id="tree"')
    section = html[start:html.index("</section>", start)]
    assert len(section) < 350_000  # ~1000 modules: a few hundred bytes each
    stack = _node(dom, "model.layers")
    layers = [li for li in find(dom, "li") if li.parent.parent.parent is stack]  # li < ul < details < li
    assert [li.attrs["data-name"] for li in layers] == [f"model.layers.{i}" for i in range(80)]
    assert "×80" in stack.text.split("\n")[0] and _opened(layers[0])
    # the layers' own modules are folded, except in the chosen module's layer
    opened = [li.attrs["data-name"] for li in layers if _opened(_node(dom, li.attrs["data-name"] + ".mlp"))]
    assert opened == ["model.layers.41"]
    chosen = _node(dom, "model.layers.41.mlp.down_proj")
    assert "chosen" in chosen.classes and chosen.attrs["id"] == "tree-module-chosen" and _opened(chosen)
    assert len(find(dom, "li", "chosen")) == 2  # the module and, under it, the first bad op
    (op,) = [li for li in find(dom, "li", "op") if "chosen" in li.classes]
    assert op.attrs["data-name"] == "model.layers.41.mlp.down_proj/mul.0"
    assert op.within("li", id="tree-module-chosen")
    # colours: the chosen module's own error is red; its layer's row says a module inside stands out
    name = [s for s in find(dom, "span", "nm") if s.within("li", id="tree-module-chosen")][0]
    assert "own-fail" in name.classes and "own 0.4 (133×)" in chosen.text
    layer_line = find(dom, "span", "nm", title="model.layers.41")[0]
    assert "in-fail" in layer_line.classes
    assert "in-ok" in find(dom, "span", "nm", title="model.layers.3")[0].classes
    # raw error of the layer output at the replayed step, from the compare rows
    assert "raw 0.002" in _node(dom, "model.layers.0").text


def test_tree_nodes_carry_own_and_raw_errors_and_not_replayable_reasons():
    v = synthetic_verdict(n_layers=8, bad_layer=6)
    tree = module_tree(synthetic_topology(8), v, {"model.layers.6": 0.25}, {"model.layers.6": "fail"})
    nodes = {n["name"]: n for n in walk(tree["nodes"])}
    chosen = nodes["model.layers.6.mlp.down_proj"]
    assert chosen["level"] == "fail" and chosen["chosen"] and [op["name"] for op in chosen["children"]] == [
        "model.layers.6.mlp.down_proj/linear.0", "model.layers.6.mlp.down_proj/mul.0"]
    assert nodes["model.layers.1.mlp.down_proj"]["level"] == "ok"
    assert (nodes["model.layers.6"]["raw"], nodes["model.layers.6"]["raw_level"]) == (0.25, "fail")
    assert nodes["model.layers.0.self_attn"]["note"] == "not replayed: needs the KV cache of earlier steps"
    assert nodes["model.layers"]["kind"] == "list" and nodes["model.layers"]["count"] == 8
    assert nodes["model.layers.6"]["worst"] == 0.4 and nodes["model.layers.6"]["inner"] == "fail"
    assert all(n["open"] for n in (nodes[""], nodes["model"], nodes["model.layers"], nodes["model.layers.6"],
                                   nodes["model.layers.6.mlp"]))
    assert not nodes["model.layers.1"]["open"]


def test_hostile_module_names_are_escaped_and_no_topology_means_no_tree():
    topo = synthetic_topology(2)
    topo["children"].append({"name": "<script>alert(1)</script>", "type": "<b>X</b>", "children": []})
    html = _page(2, bad_layer=1, topology=topo)
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;X&lt;/b&gt;" in html
    assert '<section id="tree"' not in render_report(title="t", verdict=synthetic_verdict())
    assert '<section id="tree"' not in _page(2, bad_layer=1, topology={"name": "", "children": []})


def test_a_passing_verdict_draws_the_tree_with_nothing_chosen():
    dom = parse_dom(_page(4, bad_layer=2, state="pass"))
    assert find(dom, "ul", "tree") and not find(dom, "li", "chosen")
