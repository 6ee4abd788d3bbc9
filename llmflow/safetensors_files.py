"""A safetensors checkpoint read one tensor at a time, and which of its tensors fills which
parameter of a model built without weights.

Both ``models.load_model`` (a Hugging Face directory stored in another dtype than the requested
one, cast tensor by tensor) and ``streamed.load_streamed`` (a decoder layer's weights read while
the layer runs) read a checkpoint this way. Both load only a checkpoint whose tensor names and
shapes are the model's own: where transformers converts a checkpoint on load (Mixtral's per-expert
tensors fused, keys renamed, a base model's names prefixed) ``match_checkpoint`` says so and the
caller loads the model through ``from_pretrained`` instead.
"""

from __future__ import annotations

import copy
import json
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from torch import nn

from llmflow.dtypes import SAFETENSORS_CODES, torch_dtype
from llmflow.errors import DumpFormatError, UserError
from llmflow.regular_files import open_regular, regular_file

MAX_HEADER = 100 << 20  # the most a safetensors header may take (the library's own limit)

#: safetensors dtype codes -> the torch dtypes this torch has (the codes the dump writer writes,
#: declared once in ``llmflow.dtypes``; complex64 among them: Llama 4's rotary hands its attention
#: complex angles)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: dtype for name, code in SAFETENSORS_CODES.items() if (dtype := torch_dtype(name)) is not None}


@dataclass(frozen=True, slots=True)  # (one per tensor of a data file: no __dict__)
class Stored:
    """Where one tensor's bytes are: its file, their absolute offsets, its dtype and shape."""

    file: Path
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]


class SafetensorsFiles:
    """The tensors of a checkpoint directory, read one at a time by name.

    The shards are those ``*.safetensors.index.json`` names (its weight map says which holds a
    tensor), else every ``*.safetensors`` file; each shard's header gives its tensors' offsets.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.stored: dict[str, Stored] = {}
        self.stored_names: dict[str, str] = {}  # a renamed tensor's name -> its name in the file
        for shard in _shards(directory):
            table, why = read_table(shard)
            if why is not None:
                raise UserError(f"{shard}: unreadable safetensors file ({why})")
            for name, stored in table.items():
                if name in self.stored:
                    raise UserError(f"{directory}: tensor {name!r} is in two shards: "
                                    f"{self.stored[name].file.name} and {shard.name}")
                self.stored[name] = stored

    def __contains__(self, name: str) -> bool:
        return name in self.stored

    def renamed(self, rename: Callable[[str], str]) -> SafetensorsFiles:
        """The same tensors under the names ``rename`` gives each (the model's names for a
        checkpoint stored under an older layout's); ``stored_name`` gives a tensor's name in its
        file back. UserError where two tensors would take one name."""
        out = copy.copy(self)
        out.stored, out.stored_names = {}, {}
        for name, stored in self.stored.items():
            new = rename(name)
            if new in out.stored:
                raise UserError(f"{self.directory}: tensors {out.stored_name(new)!r} and {name!r} both "
                                f"stand for {new!r} of the model")
            out.stored[new] = stored
            if new != name:
                out.stored_names[new] = self.stored_name(name)
        return out

    def stored_name(self, name: str) -> str:
        """Tensor ``name``'s name in its file (another where ``renamed`` renamed it)."""
        return self.stored_names.get(name, name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in its stored dtype: a copy-on-write memory mapping of its bytes in
        the file, unmapped when the tensor is freed (so a dropped tensor leaves nothing behind).

        Mapped, not read into fresh memory: the pages come straight from the page cache, and the
        tensor sits at the address offset a whole ``from_pretrained`` load gives it. CPU matrix
        kernels sum in an order that depends on the weights' alignment, so only the same
        alignment computes bit-identical results."""
        s = self.stored[name]
        return self._map(name, s.begin, s.end, s.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (along its first dimension), mapped as ``read``
        maps a whole tensor: a part of a large tensor without the rest of its pages."""
        s = self.stored[name]
        row_bytes = (s.end - s.begin) // s.shape[0]
        return self._map(name, s.begin + start * row_bytes, s.begin + stop * row_bytes,
                         (stop - start, *s.shape[1:]))

    def _map(self, name: str, begin: int, end: int, shape: tuple[int, ...]) -> torch.Tensor:
        s = self.stored[name]
        dtype = SAFETENSORS_DTYPES.get(s.dtype)
        if dtype is None:
            raise UserError(f"{s.file}: tensor {self.stored_name(name)!r} has dtype {s.dtype}, which this "
                            "torch cannot hold")
        size = end - begin
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        first_page = begin - begin % mmap.ALLOCATIONGRANULARITY
        try:
            with open(s.file, "rb") as f:
                mapped = mmap.mmap(f.fileno(), end - first_page, access=mmap.ACCESS_COPY, offset=first_page)
        except (OSError, ValueError) as exc:  # ValueError: the file is shorter than its header says
            raise UserError(f"{s.file}: cannot read tensor {self.stored_name(name)!r} ({exc})") from exc
        data = torch.frombuffer(mapped, dtype=torch.uint8, count=size, offset=begin - first_page)
        return data.view(dtype).reshape(shape)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The torch dtype tensor ``name`` is stored in (None: one this torch cannot hold)."""
        return SAFETENSORS_DTYPES.get(self.stored[name].dtype)


def _shards(directory: Path) -> list[Path]:
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if not indexes:
        return sorted(directory.glob("*.safetensors"))
    shards: set[Path] = set()
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards |= {directory / str(f) for f in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{index}: not a safetensors shard index (no weight_map: {exc})") from exc
    missing = [s.name for s in sorted(shards) if not s.is_file()]
    if missing:
        raise UserError(f"{indexes[0]}: shard {missing[0]} is missing")
    return sorted(shards)


def read_table(path: Path) -> tuple[dict[str, Stored], str | None]:
    """The tensors of a safetensors file whose bytes are all there, and None; or an empty table
    and why the file cannot be used (``"missing"``, ``"not a regular file"``, ``"truncated..."``).
    Each tensor's byte range lies in the file and matches its dtype and shape where the dtype is
    one torch holds, so a load can map it without further checks. The one reader of a
    safetensors header: a dump's data files (``formats``) and a checkpoint's shards read theirs
    here."""
    st = regular_file(path)
    if st is None:
        return {}, "missing" if not os.path.lexists(path) else "not a regular file"
    size = st.st_size
    if size < 8:
        return {}, f"truncated ({size} bytes, not even a safetensors header)"
    try:
        with open_regular(path) as f:
            n = int.from_bytes(f.read(8), "little")
            if n > min(size - 8, MAX_HEADER):
                return {}, f"truncated or not a safetensors file (a {n}-byte header in {size} bytes)"
            head = f.read(n)
    except (OSError, DumpFormatError) as exc:
        return {}, f"unreadable ({getattr(exc, 'strerror', None) or exc})"
    try:
        header = orjson.loads(head)  # (a real dump's data file names thousands of tensors)
    except orjson.JSONDecodeError:
        return {}, "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return {}, "not a safetensors file (its header is not a JSON object)"
    table: dict[str, Stored] = {}
    start = 8 + n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
            return {}, f"not a safetensors file (tensor {key[:60]!r} has no byte range)"
        dtype, shape = info.get("dtype"), info.get("shape")
        if type(dtype) is not str or type(shape) is not list or \
                not all(type(d) is int for d in shape) or (shape and min(shape) < 0):
            return {}, f"not a safetensors file (tensor {key[:60]!r} has no dtype or shape)"
        torch_dtype = SAFETENSORS_DTYPES.get(dtype)
        if torch_dtype is not None and math.prod(shape) * torch_dtype.itemsize != offsets[1] - offsets[0]:
            return {}, (f"not a safetensors file (tensor {key[:60]!r}: {offsets[1] - offsets[0]} bytes "
                        f"for {dtype}{shape})")
        table[key] = Stored(path, start + offsets[0], start + offsets[1], dtype, tuple(shape))
    end = max((t.end for t in table.values()), default=start)
    if end > size:
        return {}, f"truncated ({size} bytes on disk, its header describes {end})"
    return table, None


@dataclass
class CheckpointMatch:
    """Which checkpoint tensor fills each parameter and stored buffer of a model.

    ``parameters``: per parameter, every name it has in the model (tied weights share one
    parameter) and the checkpoint name it is read from. ``buffers``: the persistent buffers the
    checkpoint stores (the rest keep the values the model computed when it was built).
    """

    parameters: list[tuple[list[str], str]]
    buffers: list[str]


def match_checkpoint(model: nn.Module, files: SafetensorsFiles, already: set[str] = frozenset()
                     ) -> CheckpointMatch:
    """Each parameter of ``model`` (built without weights) matched to the checkpoint tensor of its
    name and shape; UserError naming the tensor where the checkpoint is not the model's own as
    stored: a parameter it lacks, a shape that differs, or a tensor the model has no place for
    (transformers converts such checkpoints on load: only ``from_pretrained`` reads them).
    ``already``: checkpoint tensors the caller has placed itself (an msModelSlim checkpoint's
    quantized layers), neither matched nor unknown."""
    directory = files.directory
    parameters: list[tuple[list[str], str]] = []
    for names in _parameter_groups(model, files):
        if already.intersection(names):
            continue
        stored_as = next((n for n in names if n in files), None)
        if stored_as is None:
            raise UserError(f"{directory}: the checkpoint has no tensor {names[0]!r}")
        _check_shape(files, stored_as, holder_of(model, names[0]))
        parameters.append((names, stored_as))
    buffers: list[str] = []
    every_buffer: set[str] = set()
    for name, _buffer in model.named_buffers(remove_duplicate=False):
        every_buffer.add(name)
        module, attr = holder_of(model, name)
        if name in files and name not in already and attr not in module._non_persistent_buffers_set:
            _check_shape(files, name, (module, attr))
            buffers.append(name)
    known = {n for names, _ in parameters for n in names} | every_buffer | set(already)
    unknown = sorted(n for n in files.stored if n not in known)
    if unknown:
        raise UserError(f"{directory}: the checkpoint's tensor {files.stored_name(unknown[0])!r} is not a "
                        f"parameter of the model ({len(unknown)} such tensor(s): transformers converts them "
                        "on load)")
    return CheckpointMatch(parameters, buffers)


def _check_shape(files: SafetensorsFiles, name: str, holder: tuple[nn.Module, str]) -> None:
    module, attr = holder
    tensor = module._parameters.get(attr)
    if tensor is None:
        tensor = module._buffers[attr]
    stored = files.stored[name].shape
    if tuple(tensor.shape) != stored:
        raise UserError(f"{files.directory}: tensor {files.stored_name(name)!r} has shape {list(stored)} in "
                        f"the checkpoint, {list(tensor.shape)} in the model")


def _parameter_groups(model: nn.Module, files: SafetensorsFiles) -> list[list[str]]:
    """The names of each parameter: tied weights share one parameter (the model ties them as its
    config says; a checkpoint may store them under either name), unless the checkpoint stores
    each name, which ``from_pretrained`` then loads untied too."""
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    out: list[list[str]] = []
    for names in groups.values():
        out += [[n] for n in names] if len(names) > 1 and all(n in files for n in names) else [names]
    return out


def holder_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The sub-module that holds the parameter or buffer ``name``, and its attribute name there."""
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr

