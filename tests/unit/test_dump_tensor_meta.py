"""The capture's tensor metadata reader (``llmflow/dump/tensor_meta.cpp``): it reads what torch's
Python bindings read, declines what it cannot read, is built against this process's torch, and a
dump written with it is the dump written without it, in every mode."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch

from llmflow import native
from llmflow.dump import DumpConfig, capture, dump_run, tensor_meta

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import prompt_ids, tiny  # noqa: E402
from test_dump_native_capture import FAMILIES, MODES, _assert_same_dump  # noqa: E402

# where the capture is compiled and torch ships its headers, the reader must build and pass its check
CAN_BUILD = capture._NATIVE is not None and (Path(torch.__file__).parent / "include" / "torch").is_dir()
needs_reader = pytest.mark.skipif(not CAN_BUILD, reason="no C++ compiler, Python or torch headers here")


@needs_reader
def test_the_reader_builds_and_passes_its_check_here():
    assert tensor_meta.address() != 0
    assert ctypes.sizeof(tensor_meta.TensorMeta) == tensor_meta.META_BYTES  # the C++ structs' size


def _reader_reads(t: torch.Tensor) -> tuple | None:
    meta = tensor_meta.read(tensor_meta.reader(), t)
    return None if meta is None else tensor_meta.meta_view(meta)


def _cases() -> dict[str, torch.Tensor]:
    base = torch.randn(4, 6, 8)
    bumped = torch.zeros(3, 5)
    bumped.mul_(2).add_(1)
    leaf = torch.ones(4, requires_grad=True)
    return {"contiguous": base, "transposed": base.transpose(0, 2), "sliced": base[:, 2:, ::2],
            "offset view": base[1], "bfloat16": base.to(torch.bfloat16), "float16": base.half(),
            "int64": torch.arange(10), "bool": base > 0, "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "expanded": torch.ones(1, 5).expand(4, 5), "version bumped": bumped, "requires grad": leaf,
            "grad result": leaf * 3, "eight dims": torch.ones(1, 2, 1, 2, 1, 2, 1, 2),
            "channels last": torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
            "conjugate": torch.randn(3, dtype=torch.complex64).conj(),
            "negative view": torch.ones(3)._neg_view()}


@needs_reader
@pytest.mark.parametrize("case", list(_cases()))
def test_the_reader_reads_what_torchs_python_bindings_read(case):
    t = _cases()[case]
    assert _reader_reads(t) == tensor_meta.bindings_view(t)


@needs_reader
def test_the_reader_declines_what_it_cannot_read():
    with torch.inference_mode():
        inference = torch.ones(3)  # no version counter
    assert _reader_reads(inference) is None
    assert _reader_reads(torch.ones([1] * (tensor_meta.MAX_DIMS + 1))) is None
    assert _reader_reads(torch.eye(3).to_sparse()) is None  # no storage: its values are not its memory
    assert _reader_reads(torch.empty(4, device="meta")) is not None  # not on the CPU: no data pointer
    assert tensor_meta.read(tensor_meta.reader(), torch.empty(4, device="meta")).data is None


@needs_reader
@pytest.mark.parametrize("mode", list(MODES))
def test_a_dump_read_through_the_reader_is_the_dump_read_through_python(tmp_path, mode):
    """Every mode (statistics and tensors, module and API, CRC32, max_bytes, one side of the ops)
    on a bf16 Qwen2: the same rows, keys, statistics and bytes with the reader and without it."""
    loaded = tiny(FAMILIES["qwen2-bf16"], "bfloat16")
    ids = prompt_ids()

    def dump(out: Path) -> None:
        dump_run(loaded, ids, 3, DumpConfig(dump_path=str(out), token_range="all", **MODES[mode]))

    dump(tmp_path / "reader")
    tensor_meta.use_reader(False)
    try:
        assert tensor_meta.address() == 0
        dump(tmp_path / "bindings")
    finally:
        tensor_meta.use_reader(True)
    assert tensor_meta.address() != 0
    _assert_same_dump(tmp_path / "reader", tmp_path / "bindings")


def test_the_reader_is_built_against_this_torch():
    """Its build's hash covers torch's version and path (another torch is another build), and it
    links torch's libraries with their folder as the run path."""
    flags, link = native.TENSOR_META.flags, native.TENSOR_META.link
    root = Path(torch.__file__).parent
    assert f"-DLLMFLOW_TORCH={torch.__version__}" in flags and f"-I{root / 'include'}" in flags
    assert f"-Wl,-rpath,{root / 'lib'}" in link and "-ltorch_python" in link
    assert not native.TENSOR_META.per_target and native.TENSOR_META in native.LIBRARIES


def test_without_a_compiler_the_reader_is_none_with_one_warning(tmp_path, monkeypatch, caplog):
    """No compiler (CXX names none): no reader, one warning; sessions read through Python."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native.TENSOR_META, "library_dir", lambda target=None: tmp_path / "kernels")
    monkeypatch.setattr(tensor_meta, "_reader", None)
    assert tensor_meta.address() == 0
    assert tensor_meta.address() == 0  # (asked again: the answer is kept)
    assert caplog.text.count("dump tensor metadata reader unavailable") == 1
