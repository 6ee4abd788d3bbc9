"""A compare that did not compare must not pass: rows that found no partner, other token ranges,
dumps whose readers distrust them, and finding the dump under the dump_path a user gave."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path

from llmflow.cli import main
from llmflow.dump import DumpConfig, register_hook
from llmflow.dump.hooks import _PATH
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.models import greedy_generate
from llmflow.stages.base import StageContext
from llmflow.stages.compare import CompareStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import prompt_ids, tiny  # noqa: E402
from formats_helpers import capture, write_msit_from_capture  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _reset_dump_path():
    saved = dict(_PATH)
    yield
    _PATH.update(saved)
    logging.getLogger().handlers.clear()  # main() logs to the stderr pytest captured for this test


def validate_summary(summary: dict) -> None:
    """The compare block of summary.json, as schemas/summary.schema.json describes it."""
    import jsonschema

    schema = json.loads((REPO / "schemas" / "summary.schema.json").read_text())
    compare = {"$ref": "#/definitions/CompareSummary", "definitions": schema["definitions"]}
    jsonschema.validate(summary, compare)


def hook_dump(dump_path: Path, prompts: tuple[str, ...] = ("hello world",), new_tokens: int = 3,
              **config) -> list[Path]:
    """What a user's script does: register_hook with a DumpConfig, generate, remove."""
    lm = tiny()
    handle = register_hook(lm.model, DumpConfig(dump_path=str(dump_path), **config))
    for text in prompts:
        greedy_generate(lm.model, prompt_ids(text), new_tokens)
    handle.remove()
    return handle.dumps


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow.cli", "compare", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})


def test_names_that_do_not_pair_fail_as_incomplete(tmp_path: Path) -> None:
    """An msit dump of the model inside a wrapper (PEFT-style ``base_model.model.`` prefix) against
    the user's dump_path: nothing pairs by name, the compare fails and says why."""
    hook_dump(tmp_path / "golden", token_range=[0])
    tokens, types = capture(tiny().model.eval(), steps=1)
    wrapped = {s: {f"base_model.{n}": c for n, c in mods.items()} for s, mods in tokens.items()}
    write_msit_from_capture(tmp_path / "target", wrapped, {f"base_model.{n}": t for n, t in types.items()})
    done = cli("-gp", str(tmp_path / "golden"), "-mp", str(tmp_path / "target"), "-o", str(tmp_path / "out"))
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert lines[-1].startswith("FAILED: incomplete:") and "found no partner" in lines[-1]
    assert "name their tensors differently" in lines[-1] and "'base_model.model." in lines[-1]
    assert f"golden: {tmp_path / 'golden' / 'llmflow_dump'} (llmflow dump)" in done.stdout
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["state"] == "incomplete" and summary["verdict"] == "fail"
    assert summary["coverage"]["unpaired"] > summary["coverage"]["considered"] / 2
    assert summary["outcome"]["status"] == "fail"
    validate_summary(summary)


def test_other_token_ranges_fail_as_incomplete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hook_dump(tmp_path / "g", token_range="all", new_tokens=4)
    hook_dump(tmp_path / "t", token_range=[0], new_tokens=4)
    rc = main(["compare", "-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "o")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("FAILED: incomplete:") and "different token ranges / steps" in last
    assert "golden steps 1..3 have no target step" in last


@pytest.mark.parametrize("left_out", [[0], [2]], ids=["prefill", "a-decode-step"])
def test_a_target_that_skipped_a_step_of_the_golden_fails_until_steps_picks_the_common_ones(
        tmp_path: Path, left_out: list[int]) -> None:
    """The target dumped its modules at fewer steps than the golden (a token_range without the
    prefill): rows of the rest pair and pass, but the steps left out were never compared."""
    hook_dump(tmp_path / "g", token_range="all", new_tokens=6)
    hook_dump(tmp_path / "t", token_range=[s for s in range(6) if s not in left_out], new_tokens=6)
    done = cli("-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "out"))
    last_line = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout + done.stderr
    assert last_line.startswith("FAILED: incomplete:") and "(--steps)" in last_line
    assert f"golden steps {left_out[0]} have no target step or no target entry of their level" in last_line
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["coverage"]["steps_not_in_target"] == {"layer": left_out, "module": left_out}
    validate_summary(summary)
    common = [str(s) for s in range(6) if s not in left_out]
    done = cli("-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "out"),
               "--steps", *common)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1].startswith("PASSED"), done.stdout


def _keep_rows(dump: Path, keep) -> None:
    """Rewrite a dump's index with the rows ``keep(row)`` holds to (as a narrower dump would be)."""
    index = next(dump.rglob("index.jsonl"))
    lines = []
    kept = 0
    for line in index.read_text().splitlines():
        record = json.loads(line)
        record["rows"] = [r for r in record["rows"] if keep(r)]
        kept += len(record["rows"])
        lines.append(json.dumps(record))
    index.write_text("\n".join(lines) + "\n")
    meta = json.loads((index.parent / "rank.json").read_text())
    meta["entries"] = kept  # (as the writer of a narrower dump counts its rows)
    (index.parent / "rank.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("cut", ["after layer 0", "layer 1 only"])
def test_a_target_without_a_golden_layer_fails_as_incomplete(tmp_path: Path, cut: str) -> None:
    """The target's rows end before the last layer (a run that died, a narrower dump): half the
    rows pair and pass, but a layer the compare never saw cannot pass (the fault may be there)."""
    import shutil

    hook_dump(tmp_path / "g", token_range=[0])
    shutil.copytree(tmp_path / "g", tmp_path / "t")
    if cut == "after layer 0":
        orders = [e.order for e in LlmflowDumpReader(next((tmp_path / "t").glob("llmflow_dump*"))).entries()
                  if ".layers.0" in e.name]
        last = max(orders)
        _keep_rows(tmp_path / "t", lambda r: r[5] <= last)
    else:
        _keep_rows(tmp_path / "t", lambda r: ".layers.1" not in r[1])
    done = cli("-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "out"))
    last_line = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout + done.stderr
    assert last_line.startswith("FAILED: incomplete:")
    assert "no rows of golden layer model.layers.1" in last_line
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["coverage"]["layers_not_in_target"] == ["model.layers.1"]
    assert summary["state"] == "incomplete"
    validate_summary(summary)


def test_a_target_dumped_in_another_mode_pairs_only_logits_and_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A module dump against an API dump of the same run: only the logits pair. That compared the
    model's output, not the model: incomplete, unless the user asks for the logits alone."""
    hook_dump(tmp_path / "g", token_range=[0])
    hook_dump(tmp_path / "t", token_range=[0], mode="api")
    rc = main(["compare", "-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "o")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1, last
    assert last.startswith("FAILED: incomplete: only the logits paired; the target has no module"), last
    rc = main(["compare", "-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "o2"),
               "-cl", "logits"])
    assert rc == 0 and capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED")


def test_target_without_inputs_is_complete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bisect recipe's dumps: golden inputs and outputs, target outputs only. The inputs the
    target never dumped are listed, not held against the compare."""
    hook_dump(tmp_path / "g", token_range=[0], module_list=["LlamaDecoderLayer"], tensor_part=2)
    hook_dump(tmp_path / "t", token_range=[0], module_list=["LlamaDecoderLayer"], tensor_part=1)
    rc = main(["compare", "-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 0 and out.strip().splitlines()[-1].startswith("PASSED"), out
    assert "not compared (the target dump has none" in out and "golden module input rows" in out


def test_a_dump_with_problems_never_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    hook_dump(tmp_path / "g", token_range=[0])
    hook_dump(tmp_path / "t", token_range=[0])
    rc = main(["compare", "-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "o")])
    assert rc == 0 and capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED")
    target = tmp_path / "t" / "llmflow_dump"
    monkeypatch.setattr(LlmflowDumpReader, "problems",
                        lambda self: ["rank0/index.jsonl: 3 rows point at a missing data file"]
                        if self.path == target else [])
    rc = main(["compare", "-gp", str(tmp_path / "g"), "-mp", str(tmp_path / "t"), "-o", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 3, out
    assert "target dump problem: rank0/index.jsonl: 3 rows point at a missing data file" in out
    assert out.strip().splitlines()[-1] == ("INCONCLUSIVE: the target dump cannot be trusted: "
                                            "rank0/index.jsonl: 3 rows point at a missing data file")
    assert out.strip().splitlines()[-2].startswith("next: llmflow inspect the target dump")
    summary = json.loads((tmp_path / "o" / "compare_summary.json").read_text())
    assert summary["verdict"] == "inconclusive" and summary["problems"]["target"]
    assert summary["outcome"]["next"].startswith("llmflow inspect the target dump")
    validate_summary(summary)


def test_dump_path_with_two_turns_lists_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    turns = hook_dump(tmp_path / "g", prompts=("one", "two"), token_range=[0])
    assert turns == [tmp_path / "g" / "llmflow_dump", tmp_path / "g" / "llmflow_dump_1"]
    rc = main(["compare", "-gp", str(tmp_path / "g"), "-mp", str(turns[0]), "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"{tmp_path / 'g'}: holds 2 dumps, name one:" in err
    assert str(turns[0]) in err and str(turns[1]) in err
    assert not (tmp_path / "o").exists()
    # naming the turn works
    assert main(["compare", "-gp", str(turns[1]), "-mp", str(turns[1]), "-o", str(tmp_path / "o")]) == 0


def stage_ctx(tmp: Path, params: dict) -> StageContext:
    out = tmp / "stage"
    out.mkdir()
    return StageContext(stage_id="compare", params=params, out_dir=out, final_dir=tmp / "final",
                        run_dir=tmp, workflow_dir=tmp, inputs={}, log=lambda _m: None)


@pytest.mark.parametrize(("target_range", "status"), [([0], "pass"), ("all", "pass")])
def test_compare_stage_sets_its_outcome(tmp_path: Path, target_range, status: str) -> None:
    hook_dump(tmp_path / "g", token_range=[0])
    hook_dump(tmp_path / "t", token_range=target_range)
    ctx = stage_ctx(tmp_path, {"golden": "g/llmflow_dump", "target": "t/llmflow_dump"})
    CompareStage().run(ctx)
    assert ctx.outcome is not None and ctx.outcome.status == status
    summary = json.loads((ctx.out_dir / "compare_summary.json").read_text())
    # the summary names the final stage directory (its one writer is compare_dumps)
    assert summary["csv"]["module"] == str(tmp_path / "final" / "compare_module.csv")
    assert ctx.summary["compare"] == summary


def test_compare_stage_fails_an_incomplete_compare(tmp_path: Path) -> None:
    hook_dump(tmp_path / "g", token_range="all", new_tokens=4)
    hook_dump(tmp_path / "t", token_range=[0], new_tokens=4)
    ctx = stage_ctx(tmp_path, {"golden": "g/llmflow_dump", "target": "t/llmflow_dump"})
    CompareStage().run(ctx)
    assert ctx.outcome is not None and ctx.outcome.status == "fail"
    assert ctx.outcome.headline.startswith("compare: incomplete:")


def test_compare_stage_fails_on_failing_rows(tmp_path: Path) -> None:
    hook_dump(tmp_path / "g", token_range=[0])
    lm = tiny()
    with torch.no_grad():
        saved = lm.model.model.layers[1].mlp.down_proj.weight.clone()
        lm.model.model.layers[1].mlp.down_proj.weight.mul_(3)
    try:
        hook_dump(tmp_path / "t", token_range=[0])
    finally:
        with torch.no_grad():
            lm.model.model.layers[1].mlp.down_proj.weight.copy_(saved)
    ctx = stage_ctx(tmp_path, {"golden": "g/llmflow_dump", "target": "t/llmflow_dump"})
    CompareStage().run(ctx)
    assert ctx.outcome is not None and ctx.outcome.status == "fail"
    assert "tensor pairs fail; first: model.layers.1.mlp" in ctx.outcome.headline
