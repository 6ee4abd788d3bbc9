"""Real msprobe dumps (mindstudio-probe from PyPI, on CPU) of a tiny Llama, read back and checked
against plain forward hooks: L0 (modules) and L1 (APIs), tasks tensor and statistics, one step
folder per token (``debugger.step()``) and one folder for all tokens (split by the reader)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed (optional: "
                                              "pip install mindstudio-probe)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from formats_helpers import capture, tiny_model  # noqa: E402

from llmflow.formats import open_dump  # noqa: E402
from llmflow.formats.msprobe import MsprobeDumpReader  # noqa: E402

RUNS = (("L0", "tensor", True), ("L0", "statistics", False), ("L1", "tensor", False),
        ("L1", "statistics", True))
SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from llmflow.models import load_model
    from msprobe.pytorch import PrecisionDebugger
    for level, task, per_step in json.loads(sys.argv[1]):
        # a fresh model each time: msprobe's module hooks stay on a model it has seen
        model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()
        cfg = {"task": task, "dump_path": f"{level}_{task}", "rank": [], "step": [], "level": level,
               "seed": 1234, task: {"scope": [], "list": [], "data_mode": ["all"]}}
        json.dump(cfg, open("cfg.json", "w"))
        PrecisionDebugger._instance = None  # one debugger per configuration
        dbg = PrecisionDebugger(config_path="cfg.json")
        ids = torch.tensor([[1, 5, 7, 9]])
        with torch.no_grad():
            if not per_step:
                dbg.start(model=model)
            for t in range(3):
                if per_step:
                    dbg.start(model=model)
                logits = model(ids, use_cache=False).logits
                if per_step:
                    dbg.stop()
                    dbg.step()
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
            if not per_step:
                dbg.stop()
""")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[tuple[str, str], Path]:
    d = tmp_path_factory.mktemp("msprobe")
    import json

    (d / "run.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "run.py", json.dumps(RUNS)], cwd=d, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {(lv, task): d / f"{lv}_{task}" for lv, task, _ in RUNS}


@pytest.fixture(scope="module")
def hooked():
    tokens, _ = capture(tiny_model(), steps=3)
    return tokens


def _out(r, step: int, name: str):
    return next(e for e in r.entries() if e.step == step and e.name == name and e.kind == "output"
                and e.index == "0")


def test_l0_tensor_matches_forward_hooks(dumps, hooked) -> None:
    r = open_dump(dumps[("L0", "tensor")])
    assert isinstance(r, MsprobeDumpReader) and r.steps() == [0, 1, 2]
    checked = 0
    for step, mods in hooked.items():
        for name, call in mods.items():
            if name == "model":  # a ModelOutput: msprobe indexes it "0.last_hidden_state"
                e = next(e for e in r.entries() if e.step == step and e.name == name
                         and e.index == "0.last_hidden_state")
                want = call["output"].last_hidden_state
            else:
                want = call["output"] if isinstance(call["output"], torch.Tensor) else call["output"][0]
                e = _out(r, step, name)
            assert e.has_data and e.shape == tuple(want.shape), name
            torch.testing.assert_close(r.load(e), want, rtol=0, atol=0)
            checked += 1
    assert checked >= 3 * 15
    w = next(e for e in r.entries() if e.kind == "weight" and e.name == "model.layers.0.mlp.down_proj.weight")
    assert w.step == -1 and w.shape == (64, 128) or w.shape[1] == 64


def test_l0_statistics_one_folder_split_into_tokens(dumps, hooked) -> None:
    r = open_dump(dumps[("L0", "statistics")])
    assert r.steps() == [0, 1, 2] and not any(e.has_data for e in r.entries())
    for step in (0, 2):
        want = hooked[step]["lm_head"]["output"]
        e = _out(r, step, "lm_head")
        assert e.shape == tuple(want.shape)
        assert e.stats["max"] == pytest.approx(want.max().item(), rel=1e-5)
        assert e.stats["norm"] == pytest.approx(want.norm().item(), rel=1e-4)


def test_l1_tensor_api_calls_per_token(dumps, hooked) -> None:
    r = open_dump(dumps[("L1", "tensor")])
    assert r.steps() == [0, 1, 2]
    for step in r.steps():
        linears = sorted({e.name for e in r.entries() if e.step == step and "/linear." in e.name},
                         key=lambda n: int(n.rsplit(".", 1)[1]))
        assert len(linears) == 2 * 7 + 1  # q k v o gate up down per layer, then lm_head
        e = _out(r, step, linears[-1])
        torch.testing.assert_close(r.load(e), hooked[step]["lm_head"]["output"], rtol=0, atol=0)


def test_l1_statistics_per_step_folders(dumps, hooked) -> None:
    r = open_dump(dumps[("L1", "statistics")])
    assert r.steps() == [0, 1, 2]
    e = _out(r, 1, "/embedding.0")
    want = hooked[1]["model.embed_tokens"]["output"]
    assert e.stats["mean"] == pytest.approx(want.mean().item(), rel=1e-4, abs=1e-7)


def test_a_tensor_file_cut_short_is_no_whole_dump(dumps, tmp_path) -> None:
    """A copy of a real L1 tensor dump with one ``.pt`` file cut to half its size (a copy that
    stopped early): ``inspect`` fails naming the file, and a statistics compare against the whole
    dump is not passed (the statistics in dump.json alone would pass it); the whole dump inspects
    clean."""
    from workflow_helpers import llmflow

    whole = dumps[("L1", "tensor")]
    copy = tmp_path / "copied"
    shutil.copytree(whole, copy)
    victim = sorted(copy.rglob("Functional.linear.*.forward.output.0.pt"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    proc = llmflow("inspect", str(whole))
    assert proc.returncode == 0, proc.stdout[-2000:]
    proc = llmflow("inspect", str(copy))
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("FAILED: the dump cannot be trusted whole"), last
    assert f"(first: {victim.name}: cut short: no zip end record at its end" in proc.stdout, proc.stdout
    proc = llmflow("compare", "-gp", str(whole), "-mp", str(copy), "-st", "-o", str(tmp_path / "out"))
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 3 and last.startswith("INCONCLUSIVE: the target dump cannot be trusted"), last


def test_inspect_finds_a_tensor_by_msprobes_own_names(dumps) -> None:
    """An msprobe user asks for ``Functional.linear.13.forward`` (a dump.json record) or its data
    file's name, as msprobe's own compare table shows them: the entries llmflow read it as."""
    from workflow_helpers import llmflow

    dump = dumps[("L1", "tensor")]
    data = sorted(dump.rglob("Functional.linear.*.forward.output.0.pt"))[0]
    record = data.name.removesuffix(".output.0.pt")
    listed = llmflow("inspect", str(dump), record)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    assert data.name in listed.stdout, listed.stdout
    assert listed.stdout.strip().splitlines()[-1].startswith("PASSED ("), listed.stdout
    one = llmflow("inspect", str(dump), data.name, "--step", "0")
    last = one.stdout.strip().splitlines()[-1]
    assert one.returncode == 0 and last.startswith("PASSED (/linear.") and "output 0, step 0" in last, last
    module = llmflow("inspect", str(dumps[("L0", "tensor")]), "Module.model.layers.0.mlp.LlamaMLP.forward.0")
    assert module.returncode == 0 and "model.layers.0.mlp" in module.stdout, module.stdout[-2000:]


@pytest.mark.parametrize(("run", "said"), [(("L0", "tensor"), "holds no API calls"),
                                           (("L1", "statistics"), "calls could be checked")])
def test_precheck_of_a_dump_it_cannot_judge_says_what_to_dump_in_msprobes_terms(dumps, tmp_path, run, said):
    """A module-level or statistics-only msprobe dump: inconclusive (exit 3), and what to run next
    is msprobe's own configuration, not llmflow's DumpConfig, which an msprobe user does not use."""
    import json

    from workflow_helpers import llmflow

    proc = llmflow("precheck", str(dumps[run]), "-o", str(tmp_path / "out"))
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 3 and last.startswith("INCONCLUSIVE") and said in last, proc.stdout[-2000:]
    [advice] = [line for line in proc.stdout.splitlines() if line.startswith("next: ")]
    assert "msprobe at level L1, task tensor" in advice and "DumpConfig" not in advice + last, advice
    assert json.loads((tmp_path / "out" / "precheck.json").read_text())["status"] == "inconclusive"
