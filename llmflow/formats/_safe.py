"""Safe reading helpers shared by the foreign-format readers (msit, ATB, msprobe).

Every dump we read was written by someone else's tool and may be truncated, corrupt or hostile.
The rules these helpers enforce, so that the readers do not have to remember them:

* every read is bounded: a file is measured with ``stat`` before it is read, and a size claimed
  by a header is checked against the bytes actually on disk before anything is allocated;
* nothing is unpickled: ``.pth``/``.pt`` files go through ``torch.load(weights_only=True)``, and a
  file that needs code to load is refused in one line that says so (``refused_pickle``; torch's
  warning about the pickle protocol of such a file is silenced); ``.npy`` goes through
  ``numpy.load(allow_pickle=False)``;
* directory walks follow symlinked directories but detect loops (a directory that is its own
  ancestor) and stop at a depth and entry budget, so a crafted tree can neither hang nor exhaust
  memory;
* every failure is a ``DumpFormatError`` naming the file: callers never see ``OSError``,
  ``UnicodeDecodeError``, ``json.JSONDecodeError``, ``RecursionError`` or pickle errors.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llmflow.errors import DumpFormatError
from llmflow.regular_files import open_regular

MAX_INDEX_BYTES = 512 << 20  # dump.json / statistics.csv / model json: refuse anything larger
MAX_WALK_DEPTH = 64
MAX_WALK_ENTRIES = 5_000_000
MAX_DIMS = 16
MAX_DIM = 1 << 48

_NUM = re.compile(r"(\d+)")

# torch's weights-only loader warns about a file's pickle protocol before it refuses the file:
# the refusal says all there is to say
warnings.filterwarnings("ignore", message=r"Detected pickle protocol \d+ in the checkpoint",
                        category=UserWarning)
_TORCH_NOISE = ("Weights only load failed", "Please file an issue", "Check the documentation")
NEVER_UNPICKLED = ("llmflow never unpickles a file (torch.load weights_only=True): save tensors with "
                   "safetensors, or torch.save of tensors alone")


def natural_key(name: str) -> tuple:
    """Sort key that orders ``2_x`` before ``10_x`` (numbers compared as numbers)."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(name))


def file_size(path: Path) -> int:
    try:
        st = path.stat()
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if not path.is_file():
        raise DumpFormatError(f"{path}: not a regular file")
    return st.st_size


def read_bounded(path: Path, limit: int = MAX_INDEX_BYTES) -> bytes:
    """The whole file, refusing one larger than ``limit`` bytes."""
    size = file_size(path)
    if size > limit:
        raise DumpFormatError(f"{path}: {size} bytes, larger than the {limit} bytes allowed for it")
    with open_regular(path) as f:
        try:
            return f.read(limit + 1)
        except OSError as exc:
            raise DumpFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def read_text(path: Path, limit: int = MAX_INDEX_BYTES) -> str:
    try:
        return read_bounded(path, limit).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DumpFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def read_json(path: Path, limit: int = MAX_INDEX_BYTES, max_depth: int | None = None) -> Any:
    """Parsed JSON, or a ``DumpFormatError`` naming the file (bad syntax, too deep, too big).
    ``max_depth``: also refuse a document nested deeper than that (see ``check_depth``)."""
    obj = loads_json(read_text(path, limit), path)
    if max_depth is not None:
        check_depth(obj, path, max_depth)
    return obj


def loads_json(text: str | bytes, where: Path | str) -> Any:
    """``json.loads``, every failure a one-line ``DumpFormatError`` naming ``where``.

    Nesting deeper than the interpreter's recursion limit makes ``json`` raise ``RecursionError``
    (not a ``ValueError``): caught here like any other malformed input.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise DumpFormatError(f"{where}: not valid JSON (nested too deeply to read)") from None
    except ValueError as exc:
        raise DumpFormatError(f"{where}: not valid JSON ({exc})") from exc


def check_depth(obj: Any, where: Path | str, limit: int) -> None:
    """Refuse JSON data nested deeper than ``limit`` levels (iteratively: no recursion here).

    A document that parses can still be deep enough to overflow the recursive code that walks it
    later (a module tree, an environment diff); the files we check are small and shallow.
    """
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise DumpFormatError(f"{where}: JSON nested deeper than {limit} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def path_inside(root: Path, name: str) -> Path:
    """``root / name``, refused (``DumpFormatError``) when it resolves outside ``root``: a dump's
    metadata file that is a link to elsewhere must not be read as the dump's (it could copy any
    file the user can read into a report)."""
    path = Path(root) / name
    real, base = path.resolve(), Path(root).resolve()
    if base not in real.parents:
        raise DumpFormatError(f"{path}: resolves outside the dump (to {real}); refusing to read it")
    return path


def expect(cond: bool, path: Path | str, message: str) -> None:
    """Raise a ``DumpFormatError`` naming ``path`` unless ``cond``."""
    if not cond:
        raise DumpFormatError(f"{path}: {message}")


def check_shape(dims: Any, path: Path | str) -> tuple[int, ...]:
    """A shape as a tuple of ints; refuses non-integers, negatives and absurd sizes."""
    expect(isinstance(dims, (list, tuple)), path, f"shape {dims!r} is not a list")
    expect(len(dims) <= MAX_DIMS, path, f"shape has {len(dims)} dimensions (at most {MAX_DIMS})")
    out = []
    for d in dims:
        expect(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM, path,
               f"bad dimension {d!r} in shape {list(dims)!r}")
        out.append(int(d))
    return tuple(out)


def refused_pickle(path: Path | str, exc: BaseException) -> str | None:
    """The one line that says why ``torch.load(weights_only=True)`` refused ``path``, when ``exc``
    is that refusal (None otherwise): the file holds pickled Python objects, or is a pickle that is
    not a ``torch.save`` of tensors. torch's own text (re-run with weights_only=False) is left out."""
    text = str(exc)
    if not isinstance(exc, pickle.UnpicklingError) or "weights_only" not in text.lower():
        return None
    found = re.search(r"GLOBAL ([\w.]+)", text)
    said = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    lines = [ln.strip() for ln in text.splitlines()]
    other = next((ln for ln in lines if ln and not ln.startswith(_TORCH_NOISE)), "")
    detail = (said.group(1) if said else other).strip().rstrip(".")
    if found:
        return f"{path}: holds pickled Python objects besides tensors ({found.group(1)}); {NEVER_UNPICKLED}"
    return (f"{path}: not tensors saved with torch.save (a pickle of other Python objects, or a damaged "
            f"file{': ' + detail[:120] if detail else ''}); {NEVER_UNPICKLED}")


def torch_load(path: Path, mmap: bool = False) -> torch.Tensor:
    """A tensor from a ``.pth``/``.pt`` file, never running code from it.

    ``weights_only=True`` restricts unpickling to tensors and plain containers; a file whose
    pickle names any other global is refused. A file holding something other than one tensor
    (a dict, a list) is refused too: dumps hold one tensor per file. ``mmap=True`` maps the data
    instead of reading it (to learn dtype and shape cheaply); legacy non-zip files are read.
    """
    size = file_size(path)
    try:
        zipped = False
        if mmap and size > 4:
            with open(path, "rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"
        # str(): torch 2.1 memory-maps only a path given as str
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as exc:  # UnpicklingError, RuntimeError (zip/storage), EOFError, ... all one answer
        refused = refused_pickle(path, exc)
        if refused:
            raise DumpFormatError(refused) from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DumpFormatError(f"{path}: refused or unreadable tensor file (weights_only load: "
                              f"{first[:300]})") from exc
    if isinstance(obj, torch.nn.Parameter):
        obj = obj.detach()
    if not isinstance(obj, torch.Tensor):
        raise DumpFormatError(f"{path}: holds a {type(obj).__name__}, not a tensor")
    return obj


#: a zip archive's last record (torch.save writes no archive comment after it)
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22


def cut_short(path: Path) -> str | None:
    """Why a ``.pt``/``.pth``/``.npy`` data file cannot be whole, from its ends alone (no load): a
    zip-format torch file whose last bytes are not the archive's end record, an ``.npy`` shorter
    than its header says; None where it looks whole (or is of another kind). Two small reads: run
    for every file a dump's index names, where a load would read the whole file."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(128)
            if head[:4] == b"PK\x03\x04":
                if size < _ZIP_END_SIZE:
                    return "cut short: smaller than a zip archive's end record"
                f.seek(size - _ZIP_END_SIZE)
                if f.read(4) != _ZIP_END:
                    return "cut short: no zip end record at its end (a copy stopped early?)"
                return None
            if head[:6] == b"\x93NUMPY":
                return _npy_cut_short(f, size)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except DumpFormatError as exc:  # (not a regular file)
        return str(exc).removeprefix(f"{path}: ")
    return None


def _npy_cut_short(f: Any, size: int) -> str | None:
    """``cut_short`` of an open ``.npy`` file of ``size`` bytes: its header's shape and dtype give
    its length."""
    import numpy as np
    from numpy.lib import format as npy_format

    readers = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}
    try:
        f.seek(0)
        read_header = readers.get(npy_format.read_magic(f))
        if read_header is None:
            return None  # (a later format version: judged when loaded)
        shape, _, dtype = read_header(f)
    except Exception as exc:  # ValueError (a bad header), EOFError
        return f"unreadable .npy header ({exc})"
    if dtype.hasobject:
        return None  # (refused when loaded: objects are never read)
    need = f.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return f"cut short: {size} bytes, its header says {need}" if size < need else None


def numpy_load(path: Path) -> torch.Tensor:
    """A tensor from a ``.npy`` file (``allow_pickle=False``; object arrays are refused)."""
    import numpy as np

    file_size(path)
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode=None)
    except Exception as exc:  # ValueError (pickle/object arrays, bad header), OSError, EOFError
        raise DumpFormatError(f"{path}: unreadable .npy file ({exc})") from exc
    if not isinstance(arr, np.ndarray):
        raise DumpFormatError(f"{path}: not a single .npy array")
    try:
        return torch.from_numpy(np.ascontiguousarray(arr))
    except TypeError as exc:
        raise DumpFormatError(f"{path}: numpy dtype {arr.dtype} has no torch equivalent") from exc


def list_dir(path: Path) -> list[os.DirEntry]:
    """Directory entries sorted naturally by name; a ``DumpFormatError`` if unreadable."""
    try:
        with os.scandir(path) as it:
            items = list(it)
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot list directory ({exc.strerror or exc})") from exc
    items.sort(key=lambda d: natural_key(d.name))
    return items


def is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symlinks: walk() guards against loops
    except OSError:
        return False


def _dir_key(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return (st.st_dev, st.st_ino)


class Walker:
    """Bounded, loop-safe recursive listing shared by one reader's whole scan."""

    def __init__(self, max_depth: int = MAX_WALK_DEPTH, max_entries: int = MAX_WALK_ENTRIES):
        self.max_depth = max_depth
        self.max_entries = max_entries
        self.seen = 0

    def children(self, path: Path, ancestors: tuple[tuple[int, int], ...]
                 ) -> Iterator[tuple[os.DirEntry, tuple[tuple[int, int], ...] | None]]:
        """``(entry, chain)`` for each child: a directory's chain of ancestor keys (itself
        included, to pass to the next call), ``None`` for a file."""
        if len(ancestors) > self.max_depth:
            raise DumpFormatError(f"{path}: directories nested deeper than {self.max_depth} levels")
        for entry in list_dir(path):
            self.seen += 1
            if self.seen > self.max_entries:
                raise DumpFormatError(f"{path}: more than {self.max_entries} files in the dump")
            if is_dir(entry):
                key = _dir_key(Path(entry.path))
                if key in ancestors:
                    raise DumpFormatError(f"{entry.path}: symlink loop (the directory contains itself)")
                yield entry, ancestors + (key,)
            else:
                yield entry, None

    def root(self, path: Path) -> tuple[tuple[int, int], ...]:
        return (_dir_key(path),)

    def files(self, path: Path) -> Iterator[Path]:
        """Every file under ``path``, depth first in natural order."""
        stack = [(path, self.root(path))]
        while stack:
            d, anc = stack.pop()
            subdirs = []
            for entry, chain in self.children(d, anc):
                if chain is None:
                    yield Path(entry.path)
                else:
                    subdirs.append((Path(entry.path), chain))
            stack.extend(reversed(subdirs))


MSIT_DUMP_PREFIXES = ("msit_dump", "ait_dump")
_DEVICE_DIR = re.compile(r"^(?P<device>[A-Za-z]*)(?P<id>\d*)_(?P<pid>\d+)$")


def locate_msit(path: Path, sub: str) -> tuple[Path, str | None] | None:
    """Find the ``sub`` folder (``torch_tensors`` or ``tensors``) of an msit dump from any of the
    paths a user may give: the ``msit_dump_*`` folder, its parent (the ``dump_path``: the newest
    ``msit_dump_*`` in it wins), the ``sub`` folder itself, or one ``{device}_{pid}`` folder in it.
    Returns ``(sub folder, device folder name or None)``; None when ``path`` is none of these.
    Cheap: a few ``stat`` calls and at most one directory listing.
    """
    p = Path(path)
    try:
        if not p.is_dir():
            return None
        if p.name == sub:
            return p, None
        if (p / sub).is_dir():
            return p / sub, None
        if p.parent.name == sub and _DEVICE_DIR.match(p.name):
            return p.parent, p.name
        with os.scandir(p) as it:
            found = sorted(d.name for d in it
                           if d.name.startswith(MSIT_DUMP_PREFIXES) and (p / d.name / sub).is_dir())
    except OSError:
        return None
    return (p / found[-1] / sub, None) if found else None


def device_dirs(sub_dir: Path, only: str | None = None) -> list[tuple[int, str, Path]]:
    """``(rank, device label, folder)`` for the ``{device}_{pid}`` folders, ranks given in order of
    device id (then pid): ``npu0_77``, ``npu1_78`` -> ranks 0, 1."""
    found = []
    for d in list_dir(sub_dir):
        m = _DEVICE_DIR.match(d.name)
        if m and is_dir(d) and (only is None or d.name == only):
            dev_id = int(m["id"]) if m["id"] else -1
            found.append(((dev_id, int(m["pid"])), d.name, Path(d.path)))
    found.sort(key=lambda x: x[0])
    return [(rank, name, p) for rank, (_, name, p) in enumerate(found)]


def device_pid(name: str) -> str:
    m = _DEVICE_DIR.match(name)
    return m["pid"] if m else ""
