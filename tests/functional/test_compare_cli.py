"""The align and compare stages and ``llmflow compare`` (file vs file, dir vs dir), and its hardening:
output written all at once, bad -o, bad thresholds, FIFOs, msit's -l."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from path_helpers import checkout_path
from safetensors.torch import save_file

from llmflow import formats
from llmflow.cli import main
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.stages.align import AlignStage
from llmflow.stages.base import StageContext
from llmflow.stages.compare import CompareStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import as_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def llmflow_format_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests use llmflow dumps only: do not depend on the other format readers importing."""
    monkeypatch.setattr(formats, "reader_types", lambda: {"llmflow": LlmflowDumpReader})


def make_ctx(tmp: Path, stage_id: str, params: dict) -> StageContext:
    out = tmp / stage_id
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(
        stage_id=stage_id,
        params=params,
        out_dir=out,
        final_dir=out,
        run_dir=tmp,
        workflow_dir=tmp,
        inputs={},
        log=lambda _msg: None,
    )


def test_align_then_compare_stages(tmp_path: Path) -> None:
    as_dump(tmp_path, "g", steps=[0, 1, 2])
    as_dump(tmp_path, "t", steps=[0, 1], dtype=torch.bfloat16)
    actx = make_ctx(tmp_path, "align", {"golden_dump": "g", "target_dump": "t", "prefill_offset": 1})
    a = AlignStage().run(actx)
    assert a["pairs"] == [
        {"golden_step": 0, "target_step": 0},
        {"golden_step": 1, "target_step": 0},
        {"golden_step": 2, "target_step": 1},
    ]
    assert json.loads(Path(a["pairs_file"]).read_text()) == a["pairs"] and a["missing"] == []
    cctx = make_ctx(
        tmp_path,
        "compare",
        {
            "golden": a["golden_dump"],
            "target": a["target_dump"],
            "pairs_file": a["pairs_file"],
            "levels": ["logits", "layer"],
            "target_dtype": "bfloat16",
            "workers": 1,
            "algorithms": [str(REPO / "plugins/example_algorithm.py:max_ulp_error")],
        },
    )
    out = CompareStage().run(cctx)
    assert set(out["csv"]) == {"logits", "layer"} and Path(out["xlsx"]).is_file()
    s = cctx.summary["compare"]
    assert s["pairs"] == 3 * (1 + 4) and s == json.loads(Path(out["summary_file"]).read_text())
    # golden steps 0 and 1 both against target step 0: step 1's tokens differ from step 0's
    assert s["logits"]["first_token_mismatch_step"] in (None, 1)
    assert "max_ulp_error" in Path(out["csv"]["layer"]).read_text().splitlines()[0]


def test_stage_schemas_accept_the_workflow_params() -> None:
    import jsonschema

    jsonschema.validate(
        {
            "golden_dump": "a",
            "target_dump": "b",
            "pairs_file": "p.json",
            "mapping": "",
            "target_dtype": "bfloat16",
        },
        CompareStage.params_schema,
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"golden_dump": "a"}, CompareStage.params_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"golden": "a", "target": "b", "levels": ["tokens"]}, CompareStage.params_schema)
    jsonschema.validate({"golden": "a", "target": "b", "prefill_offset": 1}, AlignStage.params_schema)


def test_cli_dir_vs_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = as_dump(tmp_path, "g")
    t = as_dump(tmp_path, "t", dtype=torch.bfloat16)
    rc = main(
        [
            "compare",
            "-gp",
            str(g),
            "-mp",
            str(t),
            "-o",
            str(tmp_path / "out"),
            "-cl",
            "layer",
            "logits",
            "--target-dtype",
            "bfloat16",
            "--workers",
            "1",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and text.strip().splitlines()[-1].startswith("PASSED")
    assert (tmp_path / "out" / "compare_layer.csv").is_file() and (
        tmp_path / "out" / "compare.xlsx"
    ).is_file()
    bad = as_dump(tmp_path, "bad", fault=lambda i, x: -x if i == 1 else x)
    rc = main(["compare", "-gp", str(g), "-mp", str(bad), "-o", str(tmp_path / "out2"), "-cl", "layer"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("FAILED") and "model.layers.1" in last


def test_cli_file_vs_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.randn(8, 16)
    np.save(tmp_path / "g.npy", x.numpy())
    np.save(tmp_path / "t.npy", (x * 1.0001).numpy())
    rc = main(
        [
            "compare",
            "-gp",
            str(tmp_path / "g.npy"),
            "-mp",
            str(tmp_path / "t.npy"),
            "-alg",
            str(REPO / "plugins/example_algorithm.py:sign_flip_ratio"),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "cosine_similarity" in text and "sign_flip_ratio" in text
    assert text.strip().splitlines()[-1].startswith("PASSED")
    save_file({"w": x}, str(tmp_path / "g.safetensors"))
    torch.save(-x, tmp_path / "t.pt")
    rc = main(["compare", "-gp", str(tmp_path / "g.safetensors"), "-mp", str(tmp_path / "t.pt")])
    assert rc == 1 and capsys.readouterr().out.strip().splitlines()[-1].startswith("FAILED")


def test_cli_bad_input_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.npy").write_bytes(b"not numpy")
    np.save(tmp_path / "y.npy", np.ones(3))
    assert main(["compare", "-gp", str(tmp_path / "x.npy"), "-mp", str(tmp_path / "y.npy")]) == 2
    assert "x.npy: cannot read tensor file" in capsys.readouterr().err
    g = as_dump(tmp_path, "g", steps=[0])
    assert main(["compare", "-gp", str(g), "-mp", str(g), "-mf", str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_refuses_to_pass_a_compare_of_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = as_dump(tmp_path, "g", steps=(0, 1))
    t = as_dump(tmp_path, "t", steps=(5, 6))
    rc = main(["compare", "-gp", str(g), "-mp", str(t), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "nothing to compare" in err and "0..1" in err and "5..6" in err


@pytest.mark.parametrize("manifest", ["garbage{", "[1, 2]"])
def test_cli_names_a_damaged_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      manifest: str) -> None:
    g = as_dump(tmp_path, "g")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "llmflow_dump.json").write_text(manifest)
    rc = main(["compare", "-gp", str(g), "-mp", str(bad), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad / 'llmflow_dump.json'}:" in err and "Traceback" not in err


SLOW_ALG = "import time\n\ndef slow(golden, target):\n    time.sleep(0.3)\n    return 0.0, ''\n"


def test_a_killed_compare_leaves_the_old_output_whole(tmp_path: Path) -> None:
    """kill -9 halfway through a second compare into the same -o: the first compare's CSVs, xlsx
    and summary are all still there, unchanged; nothing new sits beside them."""
    g, t = as_dump(tmp_path, "g", steps=(0, 1, 2)), as_dump(tmp_path, "t", steps=(0, 1, 2), noise=1e-3)
    out = tmp_path / "out"
    assert main(["compare", "-gp", str(g), "-mp", str(t), "-o", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"compare_summary.json", "compare.xlsx", "compare_module.csv"} <= set(before)
    (tmp_path / "slow.py").write_text(SLOW_ALG)
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "llmflow.cli", "compare", "-gp", str(g), "-mp", str(t),
                             "-o", str(out), "-alg", "slow.py:slow", "--workers", "1"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": checkout_path(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not list(out.glob(".llmflow-staging-*/compare_*.csv")) and time.time() < deadline:
            time.sleep(0.05)
        assert list(out.glob(".llmflow-staging-*/compare_*.csv")), "the second compare never started writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # the killed compare's staging folder is its own: the next compare into out removes it
    assert main(["compare", "-gp", str(g), "-mp", str(t), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(before)


def test_a_failing_compare_leaves_no_partial_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from llmflow.compare import run

    g, t = as_dump(tmp_path, "g"), as_dump(tmp_path, "t")

    def broken(*_a, **_k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(run, "write_sheets", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["compare", "-gp", str(g), "-mp", str(t), "-o", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("where", ["file", "under_file", "unwritable"])
def test_a_bad_output_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            where: str) -> None:
    g = as_dump(tmp_path, "g", steps=[0])
    (tmp_path / "afile").write_text("x")
    out = {"file": tmp_path / "afile", "under_file": tmp_path / "afile" / "sub",
           "unwritable": Path("/proc/llmflow-compare-out")}[where]
    rc = main(["compare", "-gp", str(g), "-mp", str(g), "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: -o {out}:"), err
    assert {"file": "exists and is not a directory", "under_file": "is a file, not a directory",
            "unwritable": "cannot write in /proc"}[where] in err[0]


@pytest.mark.parametrize(("value", "message"), [
    ('{"warn": "abc"}', "--thresholds.warn: not a metric of this compare"),
    ('{"cosine_similarity": {"warn": "abc"}}',
     "--thresholds.cosine_similarity.warn: expected a number, got 'abc'"),
    ('{"bf16": {"rmse": {"fail": null}}}', "--thresholds.bf16.rmse.fail: expected a number, got None"),
    ('{"rmse": {"warn": 1, "tolerance": 2}}', "--thresholds.rmse: unknown field 'tolerance'"),
    ("[1, 2]", "--thresholds: expected a mapping"),
    ('{"cosine_similarity": {"warn": 0.5, "fail": 0.9}}', "--thresholds.cosine_similarity: warn 0.5 is below "
                                                          "fail 0.9; higher is better for cosine_similarity"),
    ('{"bf16": {"rmse": {"warn": 0.5, "fail": 0.1}}}', "--thresholds.bf16.rmse: warn 0.5 is above fail 0.1; "
                                                       "lower is better for rmse"),
    ('{"cosine_similarity": {"warn": 2}}',
     "--thresholds.cosine_similarity.warn: 2 lies outside the metric's range [-1, 1]"),
    ('{"one_thousandth_err_ratio": 99}',
     "--thresholds.one_thousandth_err_ratio: 99 lies outside the metric's range [0, 1]"),
])
def test_bad_thresholds_are_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    value: str, message: str) -> None:
    g = as_dump(tmp_path, "g", steps=[0])
    rc = main(["compare", "-gp", str(g), "-mp", str(g), "-o", str(tmp_path / "o"), "--thresholds", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_thresholds_file_with_a_bad_value_names_the_file(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    g = as_dump(tmp_path, "g", steps=[0])
    f = tmp_path / "limits.yaml"
    f.write_text("relative_euclidean_distance:\n  warn: 0.01\n  fail: lots\n")
    args = ["compare", "-gp", str(g), "-mp", str(g), "-o", str(tmp_path / "o"), "--thresholds", str(f)]
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"--thresholds {f}.relative_euclidean_distance.fail: expected a number, got 'lots'" \
        in err
    f.write_text("relative_euclidean_distance: {warn: 0.01, fail: 0.5}\n")  # a good file works
    assert main(args) == 0


def test_a_fifo_named_like_a_tensor_file_is_refused_by_name(tmp_path: Path) -> None:
    """Whichever side it is on, the FIFO is named and never opened (reading one would block)."""
    import os
    import subprocess

    x = torch.randn(4, 4)
    torch.save(x, tmp_path / "g.pth")
    os.mkfifo(tmp_path / "fifo.pth")
    for args in (["-gp", "g.pth", "-mp", "fifo.pth"], ["-gp", "fifo.pth", "-mp", "g.pth"]):
        done = subprocess.run([sys.executable, "-m", "llmflow.cli", "compare", *args], cwd=tmp_path,
                              timeout=60, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
        flag = args[args.index("fifo.pth") - 1]
        assert done.returncode == 2 and done.stderr.strip() == (
            f"error: {flag} fifo.pth: a FIFO, not a regular file or directory"), done.stderr
        assert "Traceback" not in done.stderr


def test_msit_short_log_level_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = as_dump(tmp_path, "g", steps=[0])
    assert main(["compare", "-gp", str(g), "-mp", str(g), "-o", str(tmp_path / "o"), "-l", "debug"]) == 0
    import logging

    assert logging.getLogger().level == logging.DEBUG
    logging.getLogger().handlers.clear()


def test_an_output_folder_reached_through_a_link_is_written_through_it(tmp_path: Path) -> None:
    g, t = as_dump(tmp_path, "g", steps=[0]), as_dump(tmp_path, "t", steps=[0])
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "notes.txt").write_text("mine")
    (tmp_path / "out").symlink_to(tmp_path / "scratch", target_is_directory=True)
    for _ in range(2):  # the second run replaces the first one's files
        assert main(["compare", "-gp", str(g), "-mp", str(t), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").is_symlink() and (tmp_path / "scratch" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "scratch" / "compare_summary.json").is_file()
    assert not list((tmp_path / "scratch").glob(".llmflow-staging-*"))


def test_a_data_file_whose_header_lies_makes_the_compare_inconclusive_naming_it(tmp_path: Path) -> None:
    """Dumps as a user has them, one data file's header edited to point past the file's end: the
    CLI in a subprocess compares the rest, names the file, and does not say PASSED (exit 3)."""
    import struct
    import subprocess

    from dump_helpers import dump

    dump(tmp_path / "g")
    dump(tmp_path / "t")
    victim = sorted((tmp_path / "t" / "dump" / "rank0" / "data").glob("*.safetensors"))[-1]
    raw = victim.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"] = [o + len(raw) for o in header[key]["data_offsets"]]
    text = json.dumps(header).encode()
    victim.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    done = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(tmp_path / "g" / "dump"),
                           "-mp", str(tmp_path / "t" / "dump"), "-o", str(tmp_path / "out"), "--no-xlsx"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("INCONCLUSIVE")
    assert victim.name in done.stdout + done.stderr and "truncated" in done.stdout + done.stderr
    assert (tmp_path / "out" / "compare_module.csv").read_text().count("\n") > 10  # the rest compared
