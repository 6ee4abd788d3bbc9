"""The dump's capture in C (``llmflow/dump/capture.cpp``) writes exactly the dump the session's
Python methods write: the same index rows, statistics, keys and tensors, for every mode, family,
dtype and the paths that leave a leaf to Python (views, inference tensors, tensor subclasses,
max_bytes, distributed runs without de-duplication)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
from path_helpers import checkout_path

from llmflow import native
from llmflow.dump import DumpConfig, capture, dump_run, register_hook
from llmflow.dump import stats as dump_stats
from llmflow.dump.api import ApiMode
from llmflow.dump.capture import DumpSession
from llmflow.formats import llmflow_dump

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import prompt_ids, tiny  # noqa: E402

NATIVE = capture._NATIVE
needs_native = pytest.mark.skipif(NATIVE is None, reason="no C++ compiler or Python headers here")

MODES = {
    "statistics module": {"data_mode": "statistics", "mode": "module"},
    "statistics api": {"data_mode": "statistics", "mode": "api"},
    "tensor module": {"data_mode": "tensor", "mode": "module"},
    "tensor api": {"data_mode": "tensor", "mode": "api"},
    "statistics crc32": {"data_mode": "statistics", "mode": "module", "crc32": True},
    "statistics max_bytes": {"data_mode": "statistics", "mode": "api", "max_bytes": 150_000},
    "statistics api inputs": {"data_mode": "statistics", "mode": "api", "tensor_part": 0},
    "tensor api outputs": {"data_mode": "tensor", "mode": "api", "tensor_part": 1},
}
FAMILIES = {
    "llama": "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64",
    "gpt2": "tiny-gpt2:layers=2,hidden=32,heads=4",
    "qwen2-bf16": "tiny-qwen2:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64",
}


def _index_rows(dump_dir: Path) -> list[list[Any]]:
    """Every index row of every rank, in file order, with the data file's name left out of keys
    (the writer starts data files by the clock)."""
    rows = []
    for index in sorted(dump_dir.glob("rank*/index.jsonl")):
        for line in index.read_bytes().splitlines():
            batch = json.loads(line)
            key_at = batch["fields"].index("key")
            for row in batch["rows"]:
                row[key_at] = row[key_at].split(":")[-1]
                rows.append(row)
    return rows


def _tensors(dump_dir: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    out = {}
    for path in sorted(dump_dir.glob("rank*/data/*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(key).contiguous()
                out[key] = bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return out


def _meta(dump_dir: Path) -> dict[str, Any]:
    meta = json.loads((dump_dir / "llmflow_dump.json").read_text())
    meta.pop("created", None)
    rank = json.loads((dump_dir / "rank0" / "rank.json").read_text())
    rank.pop("bytes", None)
    return {"dump": meta, "rank": rank}


def _assert_same_dump(a: Path, b: Path, any_order: bool = False) -> None:
    """The same rows (in the same order in the index files, unless ``any_order``: the reader sorts
    them), the same metadata and the same tensor bytes."""
    rows_a, rows_b = _index_rows(a), _index_rows(b)
    if any_order:
        rows_a, rows_b = sorted(rows_a, key=repr), sorted(rows_b, key=repr)
    assert len(rows_a) == len(rows_b) and rows_a, (len(rows_a), len(rows_b))
    for i, (x, y) in enumerate(zip(rows_a, rows_b, strict=True)):
        assert x == y, f"row {i}: {x} != {y}"
    assert _meta(a) == _meta(b)
    assert sorted(_tensors(a).items()) == sorted(_tensors(b).items())


def _dump_both(tmp_path: Path, spec: str, dtype: str,
               config: dict[str, Any], run=None) -> tuple[Path, Path]:
    loaded = tiny(spec, dtype)
    ids = prompt_ids()
    runner = run or (lambda out: dump_run(loaded, ids, 3, DumpConfig(dump_path=str(out), token_range="all",
                                                                     **config)))
    runner(tmp_path / "c")
    capture.use_compiled_capture(False)  # every call walked and every leaf made in Python
    try:
        runner(tmp_path / "python")
    finally:
        assert capture.use_compiled_capture(True)
    return tmp_path / "c", tmp_path / "python"


@needs_native
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_compiled_capture_writes_the_dump_the_python_methods_write(tmp_path, family, mode):
    dtype = "bfloat16" if family.endswith("bf16") else "float32"
    c, py = _dump_both(tmp_path, FAMILIES[family], dtype, MODES[mode])
    _assert_same_dump(c, py)


@needs_native
@pytest.mark.parametrize("mode", ["module", "api"])
def test_a_statistics_dump_without_the_kernel_is_the_same_in_c_and_python(tmp_path, monkeypatch, mode):
    """Without the statistics kernel (a machine where it failed its check), every tensor is copied
    for the writer's batched statistics: in C through copies.py, as the Python methods do."""
    monkeypatch.setattr(dump_stats, "_kernel", False)
    c, py = _dump_both(tmp_path, FAMILIES["llama"], "float32", {"data_mode": "statistics", "mode": mode})
    _assert_same_dump(c, py)


@needs_native
@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_the_compiled_capture_takes_every_plain_tensor_and_copies_views_through_copies_py(
        tmp_path, monkeypatch, data_mode):
    """An API dump of Llama: contiguous tensors (their statistics or bytes), repeats, plain
    values, dtypes and Parameters are made in C; the rotary embedding's sliced halves (views that
    are not contiguous) are made in C too, with their copy from ``copies.py`` (what an accelerator's
    tensors take); only the logits, empty tensors and values of other kinds (a torch.device)
    reach the Python methods."""
    reached: dict[str, list] = {"tensor": [], "other": []}
    copied: list[bool] = []
    python_tensor, python_other = DumpSession._tensor, DumpSession._other

    def counting(kind, method):
        def leaf(self, *args, **kwargs):
            reached[kind].append(args)
            return method(self, *args, **kwargs)
        return leaf

    def copying(copy):
        def take(t):
            copied.append(t.is_contiguous())
            return copy(t)
        return take

    monkeypatch.setattr(DumpSession, "_tensor", counting("tensor", python_tensor))
    monkeypatch.setattr(DumpSession, "_other", counting("other", python_other))
    monkeypatch.setattr(capture, "device_copy", copying(capture.device_copy))
    monkeypatch.setattr(capture, "host_copy", copying(capture.host_copy))
    out = tmp_path / "dump"
    config = DumpConfig(dump_path=str(out), token_range="all", data_mode=data_mode, mode="api")
    dump_run(tiny(), prompt_ids(), 3, config)
    rows = _index_rows(out)
    assert all(name == "logits" or t.numel() == 0 for name, _, _, t, *_ in reached["tensor"])
    assert 0 < len(reached["other"]) < len(rows) / 5
    # every view's copy was asked for by the C code (the Python methods saw none of them)
    assert copied.count(False) >= 20


@needs_native
def test_inference_tensors_and_subclasses_take_the_python_path(tmp_path):
    """Inference tensors have no version counter and a subclass may override anything: both are
    left to Python, and the dumps match."""
    class Tagged(torch.Tensor):
        pass

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)
            self.outer = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.inner(x)
            return self.outer(h.as_subclass(Tagged))

    torch.manual_seed(0)
    model = Model()

    def run(out: Path) -> None:
        handle = register_hook(model, DumpConfig(dump_path=str(out), data_mode="statistics"))
        torch.manual_seed(1)
        with torch.inference_mode():
            model(torch.randn(2, 4))
        model(torch.randn(2, 4))
        handle.remove()

    c, py = _dump_both(tmp_path, FAMILIES["llama"], "float32", {}, run=run)
    _assert_same_dump(c / "llmflow_dump", py / "llmflow_dump")  # (register_hook's folder in dump_path)


@needs_native
@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_every_kind_of_value_is_walked_and_labelled_the_same(tmp_path, data_mode):
    """Nested tuples, lists, dicts (int keys too), a named tuple, an OrderedDict, containers deeper
    than the walk goes, dtypes, devices, layouts, memory formats, short and long strings, an
    IntEnum and a str subclass, a model's cache, a class, a list longer than the labels kept,
    objects of no known kind, Parameters, integer and boolean tensors, an empty tensor, a
    transposed view: one dump each way, the same."""
    from collections import OrderedDict, namedtuple
    from enum import IntEnum

    from transformers import DynamicCache

    Pair = namedtuple("Pair", "first second")
    Level = IntEnum("Level", "LOW HIGH")

    class Word(str):
        pass

    class Inner(torch.nn.Module):
        def forward(self, x, spec, *, options=None, flag=True):
            return {"out": x * 2, 3: [x.t(), (x.sum(), None)], "pair": Pair(x[0], x.argmax())}

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.weight = torch.nn.Parameter(torch.ones(3, 3))

        def forward(self, x):
            deep = [[[[[[[[x]]]]]]]]
            out = self.inner(x, (x, [x + 1, {"k": x, 7: torch.dtype}], deep), options=OrderedDict(
                a=torch.float16, b=torch.device("cpu"), c="s" * 300, d=object(), e=self.weight,
                f=torch.zeros(0), g=torch.arange(4), h=torch.ones(2, dtype=torch.bool), i=2.5, j=None,
                k="short", l=Level.HIGH, m=torch.strided, n=torch.channels_last, o=Word("subclass"),
                p=DynamicCache(), q=Pair, r=[x] * 40))
            return out["out"] @ self.weight, out

    torch.manual_seed(0)
    model = Outer()

    def run(out: Path) -> None:
        handle = register_hook(model, DumpConfig(dump_path=str(out), data_mode=data_mode, mode="all"))
        torch.manual_seed(1)
        model(torch.randn(3, 3))
        handle.remove()

    c, py = _dump_both(tmp_path, FAMILIES["llama"], "float32", {}, run=run)
    _assert_same_dump(c / "llmflow_dump", py / "llmflow_dump")
    indexes = {r[3] for r in _index_rows(c / "llmflow_dump")}
    assert {"1.1.1.k", "1.1.1.7", "kw:options.c", "kw:options.e", "3.1.0", "pair.1"} <= indexes
    values = {r[3]: (r[11], r[12]) for r in _index_rows(c / "llmflow_dump")}
    assert values["kw:options.k"] == ("short", "str") and values["kw:options.c"] == (None, "str")
    assert values["kw:options.p"] == (None, "DynamicCache") and values["kw:options.q"] == (None, "type")
    assert values["kw:options.l"] == (2, "Level") and values["kw:options.o"] == ("subclass", "Word")
    assert {"kw:options.r.0", "kw:options.r.31", "kw:options.r.32", "kw:options.r.39"} <= indexes


@pytest.fixture
def looked_at(monkeypatch) -> list[tuple]:
    """The index rows the dump's writer looks at one by one for NaN and Infinity."""
    rows: list[tuple] = []
    real = llmflow_dump._finite_apart

    def finite_apart(batch):
        rows.extend(batch)
        return real(batch)

    monkeypatch.setattr(llmflow_dump, "_finite_apart", finite_apart)
    return rows


@needs_native
@pytest.mark.parametrize("mode", ["module", "api", "all"])
def test_nan_and_infinity_stay_in_the_index_when_the_capture_routes_finite_rows(tmp_path, looked_at, mode):
    """The compiled capture hands the writer its finite rows apart (encoded without a look at each
    row); a tensor that overflowed or holds NaN, and an argument of inf, -inf or NaN, still reach
    the index as Infinity and NaN, in the rows and order the Python methods write."""
    from llmflow.formats import open_dump

    class Scaled(torch.nn.Module):
        def forward(self, x, limit=float("inf"), fill=float("nan"), floor=-float("inf")):
            over = torch.clamp(x * limit, min=floor)  # inf, -inf and NaN (0 * inf) in one tensor
            return over + x.masked_fill(x > 0.5, fill), x * 2.0

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scaled = Scaled()

        def forward(self, x):
            out, finite = self.scaled(x, limit=float("inf"), fill=float("nan"), floor=-float("inf"))
            return out.sum() + finite

    def run(out: Path) -> None:
        model = Model()
        handle = register_hook(model, DumpConfig(dump_path=str(out), data_mode="statistics", mode=mode))
        x = torch.tensor([[0.0, 1.0, -2.0], [3.0, 0.25, -0.5]])
        model(x)
        model(x + 1)
        handle.remove()

    # (looked_at: those holding NaN or Infinity, and those whose statistics the writer computes
    # itself, a bool tensor's, which the capture's kernel does not take)
    c, py = _dump_both(tmp_path, FAMILIES["llama"], "float32", {}, run=run)
    rows = {name: [repr(r) for r in _index_rows(d / "llmflow_dump")]
            for name, d in (("c", c), ("python", py))}
    assert rows["c"] == rows["python"]  # (repr: a NaN equals no NaN)
    non_finite = [r for r in rows["c"] if "nan" in r or "inf" in r]
    others = [r for r in looked_at if r[9] is None or all(math.isfinite(v) for v in r[9][:4])]
    others = [r for r in others if type(r[11]) is not float or math.isfinite(r[11])]
    assert non_finite and len(looked_at) - len(others) == 2 * len(non_finite)  # (each dump's)
    assert {r[6] for r in others} <= {"bool"}
    text = b"".join(p.read_bytes() for p in (c / "llmflow_dump").glob("rank*/index.jsonl"))
    assert b"NaN" in text and b"Infinity" in text and b"-Infinity" in text
    entries = list(open_dump(c / "llmflow_dump").entries())
    values = {e.value for e in entries if e.pytype == "float"}
    assert math.inf in values and -math.inf in values and any(v != v for v in values)
    stats = [e.stats for e in entries if e.stats and e.stats["inf"] > 0]
    assert stats and all(s["nan"] > 0 for s in stats)  # the mixed tensor: both counted
    assert any(e.stats and e.stats["inf"] == 0 and math.isfinite(e.stats["norm"]) for e in entries)


@needs_native
def test_a_family_whose_mask_holds_minus_infinity_keeps_its_other_rows_unlooked_at(tmp_path, looked_at):
    """Gemma-2 (a family the routing was not written on) puts -inf into its prefill's attention
    mask: an API dump over prefill and decode steps writes those rows with -Infinity, the same rows
    in C and in Python, and the writer looks only at them (and at the statistics it computes
    itself)."""
    spec = "tiny-gemma2:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"
    c, py = _dump_both(tmp_path, spec, "float32", {"data_mode": "statistics", "mode": "api"})
    rows = {name: [repr(r) for r in _index_rows(d)] for name, d in (("c", c), ("python", py))}
    assert rows["c"] == rows["python"]  # (repr: a NaN equals no NaN)
    index = _index_rows(c)
    assert {r[0] for r in index} == {0, 1, 2}  # the prefill and two decode steps
    non_finite = [r for r in looked_at if not llmflow_dump.finite_row(r)]
    assert {r[0] for r in non_finite} == {0}  # the prefill's mask
    assert b"-Infinity" in b"".join(p.read_bytes() for p in c.glob("rank*/index.jsonl"))
    others = [r for r in looked_at if llmflow_dump.finite_row(r)]
    assert len(others) < len(index) / 10  # (the writer's own statistics: non-contiguous copies)


@needs_native
def test_a_distributed_rank_keeps_every_capture_compiled_as_in_python(tmp_path, monkeypatch):
    """In a distributed run nothing is indexed as a repeat (collectives rewrite tensors in place
    without a version bump): the C entries register no first captures either."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    c, py = _dump_both(tmp_path, FAMILIES["llama"], "float32",
                       {"data_mode": "statistics", "mode": "module"})
    _assert_same_dump(c, py)
    keys = [r[13] for r in _index_rows(c) if r[6] is not None]
    assert len(keys) == len(set(keys))  # every tensor entry its own key: no repeats


@needs_native
def test_the_counters_are_shared_attributes():
    """The counters both paths update are the C type's members, plain attributes in Python."""
    assert issubclass(DumpSession, NATIVE.Entries)
    session = DumpSession.__new__(DumpSession)
    counters = (session.step, session.order, session.entries, session.bytes, session.stopped)
    assert counters == (-1, 0, 0, 0, None)
    session.order += 5
    session.stopped = "max_bytes"
    assert (session.order, session.stopped) == (5, "max_bytes")
    with pytest.raises(TypeError):
        session.tensor("a", "input", "0", torch.ones(2))  # the leaf takes six arguments


def test_without_the_c_entries_every_leaf_is_python(tmp_path):
    """LLMFLOW_FUSED=0 (as on a machine without a compiler): the session is plain Python and the
    dump is complete."""
    code = ("import llmflow.dump.capture as c; from llmflow.dump.capture import DumpSession as S; "
            "assert c._NATIVE is None and S.tensor is S._tensor and S.other is S._other; print('ok')")
    env = {"LLMFLOW_FUSED": "0", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_build_that_fails_leaves_the_python_path_with_one_warning(tmp_path, monkeypatch, caplog):
    """No compiler (CXX names none): ``extension`` warns once and returns None."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    library = native.NativeLibrary(native.CAPTURE.source, native.CAPTURE.what, flags=native.CAPTURE.flags,
                                   openmp=False, per_target=False)
    monkeypatch.setattr(library, "library_dir", lambda target=None: tmp_path / "kernels")
    assert library.extension("llmflow_capture") is None
    assert library.extension("llmflow_capture") is None  # (asked again: the answer is kept)
    assert caplog.text.count("dump capture in C unavailable") == 1


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no compiler")
def test_the_extension_is_built_against_this_interpreters_headers():
    flags = native.CAPTURE.flags
    assert f"-I{sysconfig.get_paths()['include']}" in flags
    assert any(sys.implementation.cache_tag in f for f in flags)  # one build per Python version
    assert not native.CAPTURE.per_target


@needs_native
def test_the_switch_puts_back_every_method_it_replaces():
    """``use_compiled_capture(False)`` puts the Python methods on DumpSession and ApiMode, and
    ``True`` the compiled ones again (benchmarks time the two side by side in one process)."""
    try:
        assert capture.use_compiled_capture(False) is False
        assert DumpSession.tensor is DumpSession._tensor
        assert DumpSession.op_inputs is DumpSession._op_inputs_walk
        assert ApiMode.__torch_function__ is ApiMode._dispatch
    finally:
        assert capture.use_compiled_capture(True) is True
    assert DumpSession.tensor is NATIVE.Entries.tensor
    assert DumpSession.module_output is NATIVE.Entries.module_output
    assert ApiMode.__torch_function__ is NATIVE.Dispatch.__torch_function__


@needs_native
def test_the_compiled_dispatch_takes_args_and_kwargs_by_name_too(tmp_path):
    """torch passes __torch_function__'s four arguments by position; a caller that names args and
    kwargs (as Python allows for ApiMode._dispatch) gets the same call."""
    model = tiny().model
    handle = register_hook(model, DumpConfig(dump_path=str(tmp_path), mode="api", data_mode="statistics"))
    try:
        mode = handle.recorder.ops_mode
        x = torch.ones(2, 3)
        got = mode.__torch_function__(torch.add, (torch.Tensor,), args=(x, x), kwargs={"alpha": 2})
        assert torch.equal(got, x * 3)
        with pytest.raises(TypeError):
            mode.__torch_function__(torch.add, (), (x, x), args=(x, x))
    finally:
        handle.remove()


@needs_native
@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_a_users_quick_start_script_dumps_the_same_with_and_without_the_compiled_capture(tmp_path, family):
    """msit's quick start as a user runs it (a script of their own in a subprocess: register_hook,
    generate with decode steps, the process just ends), on families the capture was not written
    against, in tensor mode at module and API level: the script with the compiled capture and the
    same script with LLMFLOW_FUSED=0 (no compiled code at all) write the same rows and bytes."""
    script = tmp_path / "user_dump.py"
    script.write_text(
        "import sys, torch\n"
        "from llmflow import DumpConfig, register_hook\n"
        "from llmflow.models import build_tiny\n"
        f"model = build_tiny({family!r}, 'layers=2,hidden=64')\n"
        "register_hook(model, DumpConfig(dump_path=sys.argv[1], mode='all', data_mode='tensor',\n"
        "                                token_range='all'))\n"
        "model.generate(torch.tensor([[5, 17, 42, 9]]), max_new_tokens=4, do_sample=False, pad_token_id=0)\n")
    root = Path(__file__).resolve().parents[2]
    dumps = {}
    for fused in ("1", "0"):
        out = tmp_path / f"dump_fused{fused}"
        env = {**os.environ, "PYTHONPATH": checkout_path(root), "LLMFLOW_FUSED": fused}
        done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        dumps[fused] = out / "llmflow_dump"
    _assert_same_dump(dumps["1"], dumps["0"])
    rows = _index_rows(dumps["1"])
    assert {r[0] for r in rows} >= {0, 1, 2, 3}  # the prefill and the decode steps
    assert any(r[4] == "api" for r in rows) and any(r[4] == "module" for r in rows)
