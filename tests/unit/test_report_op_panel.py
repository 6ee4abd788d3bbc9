"""The first bad op's panel: a golden/target tensor pair taken apart (per head or per channel,
the error's histogram, the worst elements with indices and both values, both sides' statistics,
the inspect commands), bounded work on big tensors, and the panel in the page."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from llmflow.report import html_op
from llmflow.report.html import render_report
from llmflow.report.html_op import inspect_command, op_panel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom, synthetic_verdict  # noqa: E402


def _pair(shape=(1, 6, 5, 8), bad_head=4, seed=0):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    t = g + 1e-3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1))
    t[:, bad_head] *= 1.5  # one head's softmax scale wrong
    t[0, bad_head, 2, 3] = 99.0  # and one element far off
    return g, t.to(torch.bfloat16)


def test_per_head_error_worst_elements_and_statistics():
    g, t = _pair()
    p = op_panel(g, t, name="model.layers.1.self_attn/scaled_dot_product_attention.0", step=3,
                 what="the first bad op's output", heads=6, golden_dtype="float32", target_dtype="bfloat16",
                 commands=[inspect_command("/runs/a b/dump", "rank0/data/000001.safetensors:7")])
    assert p["split"]["by"].startswith("attention head (6 heads")
    assert p["split"]["worst"][0]["label"] == "head 4" and p["split"]["worst"][0]["error"] > 0.4
    assert len(p["split"]["chart"]["bars"]) == 6
    first = p["worst"][0]
    assert first["index"] == "[0, 4, 2, 3]" and first["target"] == 99.0
    assert first["golden"] == float(g[0, 4, 2, 3])
    assert abs(first["abs_error"] - abs(99.0 - first["golden"])) < 1e-9
    assert len(p["worst"]) == html_op.TOP
    assert p["sides"]["golden"]["dtype"] == "float32" and p["sides"]["target"]["max"] == 99.0
    assert p["sides"]["golden"]["shape"] == "1x6x5x8" and p["sides"]["target"]["nan"] == 0
    assert sum(b["title"].endswith(tuple("0123456789")) for b in p["histogram"]["bars"]) == html_op.HIST_BINS
    assert p["commands"] == ["llmflow inspect '/runs/a b/dump' rank0/data/000001.safetensors:7"]


def test_outside_attention_the_error_is_per_channel_and_wide_tensors_are_binned():
    g = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2))
    t = g.clone()
    t[:, 777] += 1.0
    p = op_panel(g, t, name="model.layers.0.mlp.down_proj", step=0, what="x", heads=6)
    assert p["split"]["by"] == "channel of the last dimension (1000)"
    assert p["split"]["worst"][0]["label"] == "channel 777"
    assert len(p["split"]["chart"]["bars"]) <= html_op.MAX_BARS
    assert p["exact"] == 4 * 999 and {r["index"].split(", ")[1] for r in p["worst"][:4]} == {"777]"}


def test_big_tensors_are_sampled_and_nan_counts_as_worst(monkeypatch):
    monkeypatch.setattr(html_op, "MAX_ELEMENTS", 1000)
    g = torch.ones(100, 64)
    t = g.clone()
    t[50, 5] = float("nan")
    p = op_panel(g, t, name="m", step=0, what="x")
    assert any("every 7th element" in n for n in p["notes"])
    assert p["sides"]["golden"]["numel"] == len(range(0, 6400, 7))
    assert "split" not in p  # a NaN: no per-channel error to draw
    q = op_panel(torch.ones(3), torch.ones(4), name="m", step=0, what="x")
    assert q["notes"] == ["shapes differ: golden (3,), target (4,)"] and "worst" not in q


def test_the_panel_in_the_page_with_its_commands_and_per_step_bars():
    g, t = _pair()
    cmd = inspect_command("/d", "rank0/data/x.safetensors:1") + " '<b>'"
    p = op_panel(g, t, name="model.layers.1.self_attn", step=2, what="the chosen module's output", heads=6,
                 commands=[cmd], per_step={0: 1e-3, 1: 2e-3, 2: 0.3, 3: 0.5}, per_step_label="raw per step",
                 diverged_after=2)
    dom = parse_dom(render_report(title="t", verdict=synthetic_verdict(), op_panel=p))
    (section,) = find(dom, "section", id="op-panel")
    assert "model.layers.1.self_attn" in section.text and "the chosen module's output" in section.text
    (button,) = find(dom, "button", "copy")
    assert button.attrs["data-copy"] == cmd  # escaped in the page, the same text when copied
    bars = [b for b in find(dom, "rect", "bar") if b.within("figure")]
    assert len([b for b in bars if "after" in b.classes]) == 1  # step 3, after the texts part
    assert len(find(dom, "table", "worst")[0].text.strip().splitlines()) >= html_op.TOP
