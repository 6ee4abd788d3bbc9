"""Held tensors: the dump reads a tensor itself, not a copy made at capture, where nothing changes
it before the writer reads it (``copies.TensorKeeper``).

Holding is for CUDA tensors; here CPU tensors are held too (``copies.HOLD_CPU``), with the
statistics kernel off so that statistics dumps copy (or hold) every tensor as on a GPU, and the
writer inline, where holding runs. ``tests/functional/test_cuda_paths.py`` runs it on a real GPU.
Every dump is checked against the same run with ``LLMFLOW_DUMP_COPIES=always``: holding must not
change a byte, whatever the model does to its tensors after their capture.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from path_helpers import checkout_path

from llmflow.dump import DumpConfig, copies, dump_run, register_hook
from llmflow.dump import stats as dump_stats
from llmflow.formats.llmflow_dump import LlmflowDumpReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dump_helpers import prompt_ids, tiny  # noqa: E402
from test_dump_native_capture import FAMILIES, _assert_same_dump  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def holding_cpu(monkeypatch) -> None:
    """Hold CPU tensors, with no statistics kernel (every tensor copied or held, as on a GPU);
    the ``keepers`` fixture (tests/conftest.py) writes inline and collects the dumps' keepers."""
    monkeypatch.setattr(copies, "HOLD_CPU", True)
    monkeypatch.setattr(dump_stats, "_kernel", False)


def _both(tmp_path: Path, monkeypatch, run) -> tuple[Path, Path]:
    run(tmp_path / "held")
    monkeypatch.setenv("LLMFLOW_DUMP_COPIES", "always")
    run(tmp_path / "copied")
    monkeypatch.delenv("LLMFLOW_DUMP_COPIES")
    return tmp_path / "held", tmp_path / "copied"


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
@pytest.mark.parametrize("mode", ["module", "api"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_held_dump_is_the_dump_of_copies(tmp_path, monkeypatch, keepers, family, mode, data_mode, batches):
    dtype = "bfloat16" if family.endswith("bf16") else "float32"
    loaded = tiny(FAMILIES[family], dtype)

    def run(out: Path) -> None:
        dump_run(loaded, prompt_ids(), 5, DumpConfig(dump_path=str(out), token_range="all",
                                                     data_mode=data_mode, mode=mode))

    held, copied = _both(tmp_path, monkeypatch, run)
    _assert_same_dump(held, copied, any_order=True)
    first, always = keepers
    assert always.why_copying == "holding is off for this dump" and not always.holding
    if mode == "module":  # nothing in these models changes a module's input or output later
        assert first.holding and first.why_copying is None, first.why_copying
    else:  # an API dump records in-place ops' inputs (the cache's index_copy_, say) or holds all
        assert first.holding or "changed in place" in (first.why_copying or "")


# families that change tensors in place inside their modules: mixture of experts (the router's
# top-k weights normalised in place), short convolutions and Mamba mixers filling their states,
# Gemma 2's sliding-window cache. Their API dumps see those ops' inputs change and keep copies;
# their module dumps are held.
MORE_FAMILIES = {
    "mixtral": "tiny-mixtral:layers=2,hidden=64,intermediate=128,seed=3",
    "lfm2": "tiny-lfm2:layers=2,hidden=64,seed=0",
    "gemma2": "tiny-gemma2:layers=2,hidden=64,seed=0",
    "falcon-h1": "tiny-falcon-h1:layers=2,hidden=64,seed=0",
}


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_held_module_dumps_of_more_families_are_the_dumps_of_copies(tmp_path, monkeypatch, keepers, family,
                                                                   data_mode):
    loaded = tiny(MORE_FAMILIES[family])

    def run(out: Path) -> None:
        dump_run(loaded, prompt_ids(), 5, DumpConfig(dump_path=str(out), token_range="all",
                                                     data_mode=data_mode))

    held, copied = _both(tmp_path, monkeypatch, run)
    _assert_same_dump(held, copied, any_order=True)
    first, _ = keepers
    assert first.holding, first.why_copying


def test_an_api_dump_of_a_router_that_normalises_in_place_keeps_its_copies(tmp_path, monkeypatch, keepers):
    """Mixtral's router divides its top-k weights in place after ``topk`` returned them: the
    learning step sees the captured output change and the dump copies, the same dump as always."""
    loaded = tiny(MORE_FAMILIES["mixtral"])

    def run(out: Path) -> None:
        dump_run(loaded, prompt_ids(), 4, DumpConfig(dump_path=str(out), token_range="all", mode="api"))

    held, copied = _both(tmp_path, monkeypatch, run)
    _assert_same_dump(held, copied, any_order=True)
    first, _ = keepers
    assert not first.holding and "topk" in first.why_copying and "changed in place" in first.why_copying


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_the_weights_written_first_are_copies_and_teach_nothing(tmp_path, keepers, data_mode):
    """``dump_weight`` writes the parameters once, before the first step: copied, and not a step
    the keeper learns from (the prefill and a decode step are)."""
    loaded = tiny(FAMILIES["llama"])
    dump_run(loaded, prompt_ids(), 1, DumpConfig(dump_path=str(tmp_path / "d"), token_range="all",
                                                 data_mode=data_mode, dump_weight=True))
    (keeper,) = keepers
    assert keeper.learning and keeper.learned_steps == 1  # the prefill only
    r = LlmflowDumpReader(tmp_path / "d")
    weights = {e.name: e for e in r.entries() if e.kind == "weight"}
    for name, p in loaded.model.named_parameters():
        if data_mode == "tensor":
            assert torch.equal(r.load(weights[name]), p.detach()), name
        else:
            assert math.isclose(weights[name].stats["max"], float(p.max()), rel_tol=1e-6), name


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Model(torch.nn.Module):
    """A model that changes its inner module's output after it returned, from step ``change_from``
    on: in place through torch (the version counter moves) or through ``.data`` (it does not: a
    write outside torch's ops, as a collective or a kernel given a raw pointer makes). With
    ``static``, its output is a buffer the next step overwrites through ``.data`` (as CUDA graphs'
    outputs are)."""

    def __init__(self, change_from: int, how: str = "inplace"):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.inner = Doubler()
        self.change_from, self.how, self.steps = change_from, how, 0
        self.register_buffer("out", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(self.lin(x))
        if self.steps >= self.change_from:
            if self.how == "inplace":
                h.add_(100)
            elif self.how == "data":
                h.data.add_(100)
            elif self.how == "touch":  # in place, the same values: only the version counter moves
                h.add_(0)
        self.steps += 1
        if self.how == "static":
            self.out.data.copy_(h.detach().sum(0))
            return self.inner(self.out)  # an input the next step overwrites outside torch's ops
        return h.sum()


def _steps(model: Model, out: Path, data_mode: str, steps: int = 6, device: str = "cpu",
           rows: int = 3) -> list[torch.Tensor]:
    """Run ``steps`` forwards of ``rows`` x 4 inputs dumped into ``out``/llmflow_dump; returns
    what the inner module returned each step (copies)."""
    handle = register_hook(model, DumpConfig(dump_path=str(out), token_range="all", data_mode=data_mode))
    seen: list[torch.Tensor] = []
    model.inner.register_forward_hook(lambda m, args, y: seen.append(y.detach().clone()))
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(rows, 4).to(device))
    handle.remove()
    return seen


def _inner_outputs(dump: Path) -> dict[int, Any]:
    r = LlmflowDumpReader(dump / "llmflow_dump")
    out = {}
    for e in r.entries():
        if e.name == "inner" and e.kind == "output" and e.level == "module" and e.step >= 0:
            out.setdefault(e.step, []).append(e)
    return {s: (r, es) for s, es in out.items()}


def _assert_dumped(dump: Path, seen: list[torch.Tensor], data_mode: str,
                   lost: frozenset[int] = frozenset()) -> None:
    calls = _inner_outputs(dump)
    per_step = len(seen) // len(calls)
    for step, (reader, entries) in sorted(calls.items()):
        for j, e in enumerate(entries):
            want = seen[step * per_step + j].cpu()
            if step in lost and j == 0:
                assert not e.has_data and not e.stats and "changed in place" in e.extra["not_stored"], e
            elif data_mode == "tensor":
                assert torch.equal(reader.load(e), want), (step, j)
            else:
                assert math.isclose(e.stats["max"], float(want.max()), rel_tol=1e-6), (step, j)


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
@pytest.mark.parametrize("how", ["inplace", "data"])
def test_a_change_after_capture_in_the_learning_steps_keeps_the_copies(tmp_path, keepers, data_mode, how):
    seen = _steps(Model(change_from=0, how=how), tmp_path / "d", data_mode)
    (keeper,) = keepers
    assert not keeper.holding and not keeper.learning
    assert ("without its version counter changing" if how == "data" else "changed in place") \
        in keeper.why_copying
    _assert_dumped(tmp_path / "d", seen, data_mode)  # every value as it was at capture


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_a_held_tensor_changed_later_is_recorded_as_not_stored(tmp_path, keepers, data_mode):
    """Learned on steps 0 and 1, held from step 2; step 3 changes it in place: that entry says it
    was not stored (never a value it did not have at capture), and the later steps are copies."""
    seen = _steps(Model(change_from=3), tmp_path / "d", data_mode)
    (keeper,) = keepers
    assert not keeper.holding and "changed in place" in keeper.why_copying
    _assert_dumped(tmp_path / "d", seen, data_mode, lost=frozenset({3}))
    (problem,) = LlmflowDumpReader(tmp_path / "d" / "llmflow_dump").problems()
    assert "1 tensor entry has no values" in problem and "inner output 0 at step 3" in problem
    assert "LLMFLOW_DUMP_COPIES=always" in problem
    assert json.loads((tmp_path / "d" / "llmflow_dump" / "llmflow_dump.json").read_text())["complete"] is True


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_a_buffer_the_next_step_overwrites_is_read_by_its_steps_end(tmp_path, keepers, data_mode):
    """Held tensors are read when their step ends, even where the data file is written a second
    later: an output buffer the next step rewrites outside torch's ops keeps each step's values."""
    model = Model(change_from=10**6, how="static")
    handle = register_hook(model, DumpConfig(dump_path=str(tmp_path / "d"), token_range="all",
                                             data_mode=data_mode))
    outs = []
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(6):
            model(torch.randn(3, 4))
            outs.append(model.out.clone())
    handle.remove()
    (keeper,) = keepers
    assert keeper.holding  # nothing changed within a step: held from step 2
    reader = LlmflowDumpReader(tmp_path / "d" / "llmflow_dump")
    inputs = [e for e in reader.entries() if e.name == "inner" and e.kind == "input" and e.step >= 0]
    buffer_inputs = [e for e in inputs if tuple(e.shape) == (4,)]
    assert [e.step for e in buffer_inputs] == list(range(6))
    for e, want in zip(buffer_inputs, outs, strict=True):
        if data_mode == "tensor":
            assert torch.equal(reader.load(e), want), e.step
        else:
            assert math.isclose(e.stats["max"], float(want.max()), rel_tol=1e-6), e.step


def test_a_bad_copies_setting_is_one_line_naming_it(tmp_path):
    script = ("from llmflow.dump import DumpConfig, register_hook\nimport torch\n"
              f"m = torch.nn.Linear(2, 2)\nregister_hook(m, DumpConfig(dump_path={str(tmp_path / 'd')!r}))\n"
              "m(torch.ones(2))\n")
    env = {"PYTHONPATH": checkout_path(ROOT), "LLMFLOW_DUMP_COPIES": "sometimes", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode != 0
    assert "LLMFLOW_DUMP_COPIES: expected 'auto' or 'always', got 'sometimes'" in done.stderr


@pytest.mark.parametrize("batch_bytes", [16, 1 << 20])
def test_learning_counts_a_step_whose_copies_were_checked_at_a_fence_before_its_end(
        tmp_path, monkeypatch, batch_bytes):
    """On a GPU the learning copies wait for a fence and may be read (and checked) at a fence in
    the step, before its end: the step still counts towards holding."""
    from test_dump_writer_fences import STREAM_A, Log, _row

    from llmflow.dump.writer import AsyncWriter
    from llmflow.formats.llmflow_dump import DumpDirWriter

    Log(monkeypatch)  # fences whose events are stand-ins
    keeper = copies.TensorKeeper(copies.host_copy, may_hold=True)
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), batch_bytes=batch_bytes, wake_bytes=8, inline=True,
                    keeper=keeper)
    key = 0
    for step in range(copies.LEARNING_STEPS):
        for _ in range(3):
            key += 1
            t = torch.full((4,), float(key))
            checked = copies.Checked(STREAM_A, t, t._version)
            w.submit(_row(key, step, True), t.clone(), checked, nbytes=t.nbytes)
        assert keeper.learning
        w.end_step(step)
    assert keeper.holding and not keeper.learning
    w.close()
    r = LlmflowDumpReader(tmp_path / "d")
    assert [float(r.load(e)[0]) for e in sorted(r.entries(), key=lambda e: e.order)] == \
        [float(k) for k in range(1, key + 1)]


def test_a_compare_against_a_dump_with_a_lost_entry_is_inconclusive(tmp_path, keepers):
    """The CLI, as a user runs it: the target dump lost one entry (a held tensor touched in place
    after its capture); every value it kept matches, so the compare says INCONCLUSIVE (exit 3),
    naming the entry and what to run, never PASSED."""
    torch.manual_seed(0)
    golden = Model(change_from=10**6)
    target = Model(change_from=3, how="touch")
    target.load_state_dict(golden.state_dict())
    _steps(golden, tmp_path / "golden", "tensor")
    _steps(target, tmp_path / "target", "tensor")
    done = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(tmp_path / "golden"),
                           "-mp", str(tmp_path / "target"), "-o", str(tmp_path / "out"), "--no-xlsx"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(ROOT)})
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert out.strip().splitlines()[-1].startswith("INCONCLUSIVE"), out
    assert "1 tensor entry has no values" in out and "inner output 0 at step 3" in out


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_held_tensors_are_bounded_by_the_writers_batches(tmp_path, monkeypatch, keepers, data_mode):
    """Held tensors stay alive until the writer reads them, as copies did: never more than a
    batch and a wake's worth of bytes (plus the tensor in hand) wait, whatever the prompt."""
    import functools

    from llmflow.dump import capture
    from llmflow.dump.writer import AsyncWriter

    batch, wake = 16 << 10, 8 << 10
    monkeypatch.setattr(capture, "AsyncWriter", functools.partial(AsyncWriter, batch_bytes=batch,
                                                                  wake_bytes=wake))
    peak, largest, writers = [0], [0], []
    submit = AsyncWriter.submit

    def watched(self, row, payload=None, event=None, nbytes=0):
        submit(self, row, payload, event, nbytes)
        largest[0] = max(largest[0], nbytes)
        waiting = [t for _, t, held in self._stats if held is not None and t is held[0]]
        waiting += [t for t, _ in self._batch_held.values()]
        waiting += [item[1] for item in self._queue if type(item[2]) is int]
        peak[0] = max(peak[0], sum(t.nbytes for t in waiting))
        writers.append(self)

    monkeypatch.setattr(AsyncWriter, "submit", watched)
    init = copies.TensorKeeper.__init__

    def holding_at_once(self, copy, may_hold):  # (the prefill held too: its tensors are the big ones)
        init(self, copy, may_hold)
        self.learning, self.holding = False, may_hold

    monkeypatch.setattr(copies.TensorKeeper, "__init__", holding_at_once)
    loaded = tiny("tiny-llama:layers=4,hidden=64,heads=4,kv_heads=2,intermediate=128")
    dump_run(loaded, prompt_ids("a long prompt, so that the prefill's tensors add up " * 8), 4,
             DumpConfig(dump_path=str(tmp_path / "d"), token_range="all", data_mode=data_mode))
    (keeper,) = keepers
    assert keeper.holding
    assert 0 < peak[0] <= batch + wake + largest[0], (peak[0], largest[0])
