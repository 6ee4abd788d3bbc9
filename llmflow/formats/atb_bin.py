"""The ATB ``.bin`` tensor file, read bounded and validated.

A ``.bin`` file is a text header of ``name=value`` lines followed by raw little-endian bytes.
ATB writes it with ``Mki::BinFile``: first the system attributes ``$Version``, ``$Object.Count``
(number of binary objects) and ``$Object.Length`` (total bytes of all objects), then the user
attributes in the order they were added (``format``, ``dtype``, ``dims``), then one
``$Object.<name>=<offset>,<length>`` line per object, then ``$End=1``; the object bytes follow
the newline of ``$End=1`` directly. A dumped tensor looks like::

    $Version=1.0
    $Object.Count=1
    $Object.Length=8192
    format=2
    dtype=1
    dims=1,4096
    $Object.data=0,8192
    $End=1
    <8192 bytes>

``format`` is the ACL storage format (2 = ND; 29 = FRACTAL_NZ, a tiled layout whose bytes do not
reshape to ``dims`` directly: such tensors are flagged in ``extra`` and loaded flat-reshaped as
ATB wrote them). ``dtype`` is the ACL dtype code (``DTYPES``). ``dims`` is comma-separated.

The statistics variant (``msit llm dump`` with statistics only) has no object: ``$Object.Count=0``,
``$Object.Length=0`` and user attributes ``format``, ``dtype``, ``dims``, ``max``, ``min``,
``mean``, ``l2norm``.

Reading never trusts the header: the header must end within ``MAX_HEADER`` bytes, ``$Object.Length``
and every object's offset/length must fit in the bytes actually on disk, and ``dims`` times the
dtype size must equal the ``data`` object's length, all checked before anything is allocated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmflow.dtypes import dtype_name
from llmflow.errors import DumpFormatError
from llmflow.formats._safe import MAX_DIM, MAX_DIMS, expect, file_size
from llmflow.regular_files import open_regular

MAX_HEADER = 64 << 10
MAX_LINES = 256
_INT = re.compile(r"-?[0-9]{1,20}")

# ACL dtype codes (aclDataType) that torch can hold
DTYPES: dict[int, torch.dtype] = {
    0: torch.float32, 1: torch.float16, 2: torch.int8, 3: torch.int32, 4: torch.uint8,
    6: torch.int16, 9: torch.int64, 11: torch.float64, 12: torch.bool, 27: torch.bfloat16,
}
CODES: dict[torch.dtype, int] = {v: k for k, v in DTYPES.items()}
FORMAT_ND = 2
FORMAT_NZ = 29
STAT_ATTRS = {"max": "max", "min": "min", "mean": "mean", "l2norm": "norm"}


@dataclass
class BinHeader:
    """A parsed, validated header. ``data`` is ``(absolute offset, length)`` of the tensor bytes."""

    path: Path
    dtype_code: int
    dims: tuple[int, ...]
    format: int = FORMAT_ND
    data: tuple[int, int] | None = None
    stats: dict[str, float] | None = None
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_code]

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def _int(value: str, path: Path, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    value = value.strip()
    expect(_INT.fullmatch(value) is not None, path, f"{what}: {value[:40]!r} is not an integer")
    n = int(value)
    expect(lo <= n <= hi, path, f"{what}: {n} out of range [{lo}, {hi}]")
    return n


def _float(value: str, path: Path, what: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise DumpFormatError(f"{path}: {what}: {value[:40]!r} is not a number") from None


def read_header(path: Path) -> BinHeader:
    """Parse and validate the header of an ATB ``.bin`` file (reads at most ``MAX_HEADER`` bytes)."""
    size = file_size(path)
    try:
        with open_regular(path) as f:
            head = f.read(min(size, MAX_HEADER))
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    end = head.find(b"$End=1\n")
    if end < 0:
        why = "truncated" if size < MAX_HEADER else f"no $End=1 line in the first {MAX_HEADER} bytes"
        raise DumpFormatError(f"{path}: not an ATB .bin tensor file ({why}: header never ends)")
    body_start = end + len(b"$End=1\n")
    try:
        lines = head[:end].decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise DumpFormatError(f"{path}: ATB .bin header is not text") from None
    expect(len(lines) <= MAX_LINES, path, f"ATB .bin header has {len(lines)} lines")
    attrs: dict[str, str] = {}
    objects: dict[str, tuple[int, int]] = {}
    total: int | None = None
    available = size - body_start
    for no, line in enumerate(lines, 1):
        if not line:
            continue
        name, eq, value = line.partition("=")
        expect(bool(eq) and bool(name), path, f"header line {no} is not name=value: {line[:60]!r}")
        if name == "$Object.Length":
            total = _int(value, path, "$Object.Length")
            expect(total <= available, path, f"$Object.Length={total} but only {available} bytes "
                                             "follow the header (truncated or lying header)")
        elif name.startswith("$Object.") and name != "$Object.Count":
            off, comma, length = value.partition(",")
            expect(bool(comma), path, f"{name}: expected offset,length, got {value[:40]!r}")
            objects[name[len("$Object."):]] = (_int(off, path, f"{name} offset"),
                                               _int(length, path, f"{name} length"))
        elif not name.startswith("$"):
            expect(name not in attrs, path, f"attribute {name!r} repeated")
            attrs[name] = value
    for key in ("dtype", "dims"):
        expect(key in attrs, path, f"ATB .bin header has no {key!r} line")
    code = _int(attrs["dtype"], path, "dtype", -1, 1 << 31)
    expect(code in DTYPES, path, f"unknown ATB dtype code {code} (known: "
                                 f"{', '.join(f'{k}={str(v)[6:]}' for k, v in DTYPES.items())})")
    dims_text = attrs["dims"].strip()
    parts = [p for p in dims_text.split(",")] if dims_text else []
    expect(len(parts) <= MAX_DIMS, path, f"dims has {len(parts)} dimensions (at most {MAX_DIMS})")
    dims = tuple(_int(p, path, "dims", 0, MAX_DIM) for p in parts)
    fmt = _int(attrs.get("format", str(FORMAT_ND)), path, "format", -1, 1 << 31)
    header = BinHeader(path, code, dims, fmt, attrs=attrs)
    if "data" in objects:
        off, length = objects["data"]
        limit = total if total is not None else available
        expect(off + length <= limit, path, f"$Object.data={off},{length} lies outside the "
                                            f"{limit} object bytes")
        need = math.prod(dims) * DTYPES[code].itemsize
        expect(need == length, path, f"dims {list(dims)} of {header.dtype_name} need {need} bytes, "
                                     f"the data object holds {length}")
        header.data = (body_start + off, length)
    elif any(k in attrs for k in STAT_ATTRS):
        header.stats = {ours: _float(attrs[k], path, k) for k, ours in STAT_ATTRS.items() if k in attrs}
    else:
        raise DumpFormatError(f"{path}: ATB .bin file has neither a data object nor statistics")
    return header


def load_bin(path: Path, header: BinHeader | None = None) -> torch.Tensor:
    """The tensor of an ATB ``.bin`` file, in its own dtype, shaped ``dims``."""
    h = header or read_header(path)
    if h.data is None:
        raise DumpFormatError(f"{path}: statistics-only ATB file, it holds no tensor data")
    offset, length = h.data
    size = file_size(path)
    expect(offset + length <= size, path, f"truncated: {length} data bytes claimed, "
                                          f"{max(size - offset, 0)} on disk")
    buf = bytearray(length)
    try:
        with open_regular(path) as f:
            f.seek(offset)
            got = f.readinto(buf)
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    expect(got == length, path, f"truncated: {length} data bytes claimed, {got} read")
    flat = torch.frombuffer(buf, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
    return flat.view(h.dtype).reshape(h.dims)


