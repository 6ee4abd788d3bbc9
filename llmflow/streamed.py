"""A model whose decoder layers' weights are read from its checkpoint only while they run.

The bisect keeps the target whole (it replays the target module by module) and needs the golden
one layer at a time: a layer's recompute, a decode re-run, a sub-module or op replay. So the golden
can be loaded streamed (``load_streamed``): the model is built with its parameters on the meta
device (no memory; buffers such as rotary ``inv_freq`` are computed for real), the modules outside
the decoder layers (embeddings, final norm, lm_head) are loaded whole, and each decoder layer's
parameters are read from the checkpoint's safetensors files when any module inside that layer
starts running and dropped when it returns. A layer's own forward, and a sub-module of it run
alone (``localize/golden.py``, ``localize/ops.py``), both find their weights: every module of a
layer carries a pre-hook and an always-called forward hook that count the layer's running modules.

The weights a layer reads are cast exactly as ``load_model`` casts a whole model (floating tensors
to the requested dtype, an fp16 checkpoint into an fp32 golden), so a streamed and a whole load
compute bit-identical results. A layer's tensors are memory-mapped from the files while the layer
runs and unmapped when it is dropped; nothing is ever copied to disk. Only a checkpoint stored
under the model's own parameter names and shapes can be streamed (``match_checkpoint``); one that
transformers converts on load raises UserError, and the bisect loads that golden whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmflow.errors import UserError
from llmflow.models import LoadedModel, checkpoint_dir, empty_hf_model, resolve_device, resolve_dtype
from llmflow.safetensors_files import SafetensorsFiles, holder_of, match_checkpoint
from llmflow.structure import find_layer_stack


@dataclass
class _Slot:
    """One parameter of a layer: every (module, attribute) that holds it, its checkpoint name and
    its empty (meta) stand-in, put back when the layer's weights are dropped."""

    holders: list[tuple[nn.Module, str]]
    stored_as: str
    empty: nn.Parameter


@dataclass
class LayerWeights:
    """One decoder layer's parameters, in memory while any module inside the layer runs.

    ``running`` counts the layer's modules whose forward has started and not returned: the
    weights are read when it leaves 0 and dropped when it comes back to 0, so a layer's own
    forward reads them once and a sub-module run alone reads them too.
    """

    name: str
    slots: list[_Slot]
    files: SafetensorsFiles
    device: torch.device
    dtype: torch.dtype
    running: int = 0
    loads: int = 0  # how many times the weights were read (tests and the log)
    hooks: list[Any] = field(default_factory=list)

    def enter(self, *_args: Any) -> None:
        self.running += 1  # first: the always-called hook balances it even if the read fails
        if self.running == 1:
            self._load()

    def leave(self, *_args: Any) -> None:
        self.running -= 1
        if self.running == 0:
            self._drop()

    def _load(self) -> None:
        # no torch function mode may see these reads and casts: an op capture running the layer
        # records the layer's own ops, never its weights being loaded
        with torch._C.DisableTorchFunction():
            for slot in self.slots:
                tensor = _cast(self.files.read(slot.stored_as), self.device, self.dtype)
                param = nn.Parameter(tensor, requires_grad=False)
                for module, attr in slot.holders:
                    module._parameters[attr] = param
        self.loads += 1

    def _drop(self) -> None:
        for slot in self.slots:
            for module, attr in slot.holders:
                module._parameters[attr] = slot.empty


def _cast(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """As ``load_model`` casts a whole model: floating tensors to ``dtype``, every tensor to ``device``."""
    tensor = tensor.to(device)
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


@dataclass
class StreamedWeights:
    """What ``load_streamed`` attached to a model: the streamed layers, and the hooks to remove."""

    layers: dict[str, LayerWeights]

    def materialized(self) -> int:
        """How many of the layers' parameters are in memory now (not meta)."""
        return sum(1 for lw in self.layers.values() for s in lw.slots
                   if s.holders[0][0]._parameters[s.holders[0][1]].device.type != "meta")

    def remove(self) -> None:
        for lw in self.layers.values():
            for h in lw.hooks:
                h.remove()
            lw.hooks.clear()


@contextmanager
def layer_weights_held(model: nn.Module, layer: str) -> Iterator[None]:
    """Keep a streamed model's ``layer`` in memory across several calls, read once (a layer run
    step after step); nothing to do for a model held whole."""
    attached = getattr(model, "streamed_weights", None)
    weights = attached.layers.get(layer) if isinstance(attached, StreamedWeights) else None
    if weights is None:
        yield
        return
    weights.enter()
    try:
        yield
    finally:
        weights.leave()


def _inside(name: str, layer: str) -> bool:
    return name.startswith(layer + ".")


def load_streamed(model: str, *, device: str = "cpu", dtype: str = "float32", base_dir: str | Path = ".",
                  layers: str | None = None) -> LoadedModel:
    """``model`` (a spec with a safetensors checkpoint: ``smollm2`` or a Hugging Face directory)
    with its decoder layers streamed from the checkpoint; ``layers`` names the layer list where
    it cannot be found from the structure. The result's model has ``streamed_weights``."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    directory = checkpoint_dir(model, base_dir)
    if directory is None:
        raise UserError(f"model {model!r}: no safetensors checkpoint to stream the weights from "
                        "(smollm2 or a Hugging Face directory with *.safetensors files)")
    files = SafetensorsFiles(directory)
    module, tokenizer = empty_hf_model(directory, dt)
    stack = find_layer_stack(module, layers)
    if stack is None:
        raise UserError(f"model {model!r}: no list of decoder layers found to stream (name it with layers)")

    def layer_of(names: list[str]) -> str | None:
        owners = {next((layer for layer in stack.layers if _inside(n, layer)), None) for n in names}
        return owners.pop() if len(owners) == 1 else None  # shared across layers: held whole

    match = match_checkpoint(module, files)  # UserError where transformers converts the checkpoint
    streamed: dict[str, list[tuple[list[str], str]]] = {layer: [] for layer in stack.layers}
    whole: list[tuple[list[str], str]] = []
    for names, stored_as in match.parameters:
        layer = layer_of(names)
        (streamed[layer] if layer is not None else whole).append((names, stored_as))

    with torch.no_grad():
        _load_whole(module, whole, match.buffers, files)
        _cast_module(module, dev, dt)
    module.eval()
    module.requires_grad_(False)

    attached = StreamedWeights({})
    for layer, groups in streamed.items():
        slots = []
        for names, stored_as in groups:
            holders = [holder_of(module, n) for n in names]
            slots.append(_Slot(holders, stored_as, holders[0][0]._parameters[holders[0][1]]))
        weights = LayerWeights(layer, slots, files, dev, dt)
        for sub in module.get_submodule(layer).modules():
            weights.hooks.append(sub.register_forward_pre_hook(weights.enter))
            weights.hooks.append(sub.register_forward_hook(weights.leave, always_call=True))
        attached.layers[layer] = weights
    module.streamed_weights = attached  # type: ignore[assignment]
    return LoadedModel(module, tokenizer, model, dev, dt)


def _load_whole(module: nn.Module, groups: list[tuple[list[str], str]], buffers: list[str],
                files: SafetensorsFiles) -> None:
    """The parameters outside the decoder layers, and the persistent buffers the checkpoint
    stores, read in whole."""
    with torch._C.DisableTorchFunction():
        for names, stored_as in groups:
            param = nn.Parameter(files.read(stored_as), requires_grad=False)
            for name in names:
                holder, attr = holder_of(module, name)
                holder._parameters[attr] = param
        for name in buffers:
            holder, attr = holder_of(module, name)
            holder._buffers[attr] = files.read(name)


def _cast_module(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """``module.to(device, dtype)`` as ``load_model`` does it, for a model whose layers' parameters
    are meta (which ``to`` refuses to move): those only change dtype; tied parameters stay tied."""
    done: dict[int, nn.Parameter] = {}
    with torch._C.DisableTorchFunction():
        for sub in module.modules():
            for attr, param in sub._parameters.items():
                if param is None:
                    continue
                if id(param) not in done:
                    data = param.data
                    if data.device.type == "meta":
                        data = data.to(dtype) if data.is_floating_point() else data
                    else:
                        data = _cast(data, device, dtype)
                    done[id(param)] = nn.Parameter(data, requires_grad=False)
                sub._parameters[attr] = done[id(param)]
            for attr, buffer in sub._buffers.items():
                if buffer is not None:
                    sub._buffers[attr] = _cast(buffer, device, dtype)


def _named_parameter(module: nn.Module, name: str) -> torch.Tensor:
    holder, attr = holder_of(module, name)
    return holder._parameters[attr]
