"""The compiled capture's tensor metadata reader (``tensor_meta.cpp``): its address, or 0.

The capture (``capture.cpp``) reads a tensor's metadata (``TensorMeta``: version counter,
device, contiguity, element and byte counts, data pointer, sizes, layout...) through this one C++
call when it is built, and through torch's Python bindings when it is not: the same values either
way, checked once per build against those bindings here. Built on first need (~20 s once per
torch: torch's headers are large; the install step builds it ahead), or never with
``LLMFLOW_FUSED=0``.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from llmflow import native

MAX_DIMS = 8  # tensor_meta.cpp's
META_BYTES = 112  # sizeof(TensorMeta) as both C++ files assert it


class TensorMeta(ctypes.Structure):
    """tensor_meta.cpp's (and capture.cpp's) TensorMeta."""

    _fields_ = [("version", ctypes.c_int64), ("numel", ctypes.c_int64), ("nbytes", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("sizes", ctypes.c_int64 * MAX_DIMS), ("ndim", ctypes.c_int32),
                ("has_version", ctypes.c_int8), ("is_cpu", ctypes.c_int8), ("contiguous", ctypes.c_int8),
                ("requires_grad", ctypes.c_int8), ("strided", ctypes.c_int8), ("is_neg", ctypes.c_int8),
                ("is_conj", ctypes.c_int8)]


def bindings_view(t: torch.Tensor) -> tuple:
    """What the capture reads of ``t`` through torch's Python bindings, in ``meta_view``'s order."""
    return (t._version, t.is_cpu, t.numel(), t.nbytes, t.is_contiguous(), t.requires_grad, tuple(t.shape),
            t.data_ptr() if t.is_cpu and t.numel() else None, t.layout == torch.strided, t.is_neg(),
            t.is_conj())


def meta_view(meta: TensorMeta) -> tuple:
    """The same of what the reader read."""
    return (meta.version, bool(meta.is_cpu), meta.numel, meta.nbytes, bool(meta.contiguous),
            bool(meta.requires_grad), tuple(meta.sizes[:meta.ndim]), meta.data, bool(meta.strided),
            bool(meta.is_neg), bool(meta.is_conj))


ARGTYPES = [ctypes.py_object, ctypes.POINTER(TensorMeta)]
_lock = threading.Lock()
_reader: ctypes._CFuncPtr | bool | None = None  # None: not loaded yet; False: unavailable or off


def read(reader: ctypes._CFuncPtr, t: torch.Tensor) -> TensorMeta | None:
    """What ``reader`` reads of ``t``, or None where it leaves ``t`` to the Python bindings."""
    meta = TensorMeta()
    return meta if reader(t, ctypes.byref(meta)) == 1 else None


def _agrees(reader: ctypes._CFuncPtr) -> bool:
    """The reader gives what torch's Python bindings give, on the tensors a capture meets."""
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    grad = torch.ones(3, requires_grad=True)
    bumped = torch.zeros(5)
    bumped.add_(1)
    cases = [base, base.transpose(0, 2), base[:, 1:], base.to(torch.bfloat16), torch.tensor([7, 8]),
             torch.tensor(3.5), torch.empty(0, 4), grad, grad * 2, bumped,
             base.reshape(1, 1, 1, 1, 1, 1, 2, 12)]
    complex_ = torch.randn(4, dtype=torch.complex64)
    cases += [complex_.conj(), torch.ones(3)._neg_view()]
    for t in cases:
        meta = read(reader, t)
        if meta is None or meta_view(meta) != bindings_view(t):
            return False
    with torch.inference_mode():
        inference = torch.ones(2)
    return read(reader, inference) is None and read(reader, torch.ones([1] * (MAX_DIMS + 1))) is None


def reader() -> ctypes._CFuncPtr | None:
    """The reader (built and checked on first call), or None: none here (no compiler, no torch
    headers, a failed check, ``LLMFLOW_FUSED=0``, or ``use_reader(False)``)."""
    global _reader
    if _reader is None:
        with _lock:
            if _reader is None:
                fn = None if native.disabled() else native.TENSOR_META.function(
                    "llmflow_tensor_meta", ARGTYPES, ctypes.c_int, _agrees,
                    fallback="torch's Python bindings")
                _reader = fn if fn is not None else False
    return _reader or None


def address() -> int:
    """The reader's address for ``capture.cpp``, or 0 where there is none (see ``reader``)."""
    fn = reader()
    return ctypes.cast(fn, ctypes.c_void_p).value or 0 if fn is not None else 0


def use_reader(on: bool) -> None:
    """Let dump sessions made from now on read tensors through the reader (``on``, where it is
    built) or through torch's Python bindings: for measuring the two side by side and for the
    tests that check both write the same dump."""
    global _reader
    _reader = None if on else False
