"""Two dumps of runs that were given different token ids (another prompt, chat template or BOS
token) make the bisect inconclusive, naming the input that differs, before any replay: every
module error would compare two computations on different tokens. Dumps of the same tokens are
bisected as ever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from example_faults import scale_embedding  # noqa: E402

from llmflow.compare.divergence import input_difference  # noqa: E402
from llmflow.dump.config import DumpConfig  # noqa: E402
from llmflow.dump.run import dump_run  # noqa: E402
from llmflow.formats import open_dump  # noqa: E402
from llmflow.models import encode_prompt, load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen2:layers=3,hidden=64,intermediate=128,seed=5"
PROMPT = "Tell me a story."


def _dump(path: Path, prompt: str, *, dtype: str = "float32", patch=None, data_mode: str = "tensor") -> Path:
    """A module-mode dump with inputs and outputs, as a user's own script writes one."""
    lm = load_model(MODEL, dtype=dtype)
    if patch is not None:
        patch(lm.model)
    dump_run(lm, encode_prompt(lm.tokenizer, prompt), 3,
             DumpConfig(dump_path=str(path), token_range="all", tensor_part=2, data_mode=data_mode))
    return path


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    return _dump(tmp_path_factory.mktemp("golden") / "dump", PROMPT)


def _dump_bisect(golden: Path, target: Path, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmflow", "run", str(REPO / "workflows" / "dump_bisect.yaml"),
           "--run-dir", str(cwd / "run"), "--progress", "plain", "--set", f"golden_dump={golden}",
           "--set", f"target_dump={target}", "--set", f"golden_model={MODEL}"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})


@pytest.mark.parametrize(("prompt", "said"), [
    ("Tell me a story!", "kw:input_ids differs at position 16 of 17"),  # same length, one token
    ("Once upon a time, far away", "kw:input_ids has shape [1, 17] in the golden and [1, 27]"),
])
def test_another_prompt_is_inconclusive_naming_the_token_ids(golden, prompt, said, tmp_path):
    target = _dump(tmp_path / "target", prompt, dtype="bfloat16")
    done = _dump_bisect(golden, target, tmp_path)
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith("INCONCLUSIVE: the golden and the target were not given the same inputs"), last
    assert said in last, last


def test_the_same_tokens_are_bisected_as_ever(golden, tmp_path):
    target = _dump(tmp_path / "target", PROMPT, dtype="bfloat16", patch=scale_embedding)
    done = _dump_bisect(golden, target, tmp_path)
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith("FAILED: model.embed_tokens is the fault"), last


def test_statistics_dumps_of_other_tokens_differ_by_their_statistics(tmp_path):
    a = open_dump(_dump(tmp_path / "a", PROMPT, data_mode="statistics"))
    b = open_dump(_dump(tmp_path / "b", "Tell me a story!", data_mode="statistics"))
    same = open_dump(_dump(tmp_path / "c", PROMPT, dtype="bfloat16", data_mode="statistics"))
    assert "kw:input_ids has other statistics" in (input_difference(a, b) or "")
    assert input_difference(a, same) is None
