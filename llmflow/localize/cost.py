"""What a localisation costs, against what the brute-force way would have cost.

The brute-force way is msit's: an API-level dump of every op's inputs and outputs on both sides,
for every generated token, then compare everything. ``estimate_api_dump_bytes`` measures what
that would write for one model without writing it: it runs the prefill and one decode step with
the dump's recorder sending its op calls to a byte counter (the dump's own API naming and walk
decide what counts) and extrapolates the decode step over the remaining tokens.

Recording every op in Python is what makes that run slow (about half a bisect's time at 1B), so
only the first decoder layer's ops and those outside the layer stack are recorded; the other
layers run plain (torch function modes off) and count as the first one's bytes. Identical dense
layers write identical bytes, so that is exact there; an MoE layer's routing (which experts run,
on how many tokens) differs from layer to layer, so there it is an extrapolation, and the result
says which (``method``).

The two sides of a port run the same ops on the same shapes; only the dtype differs. So one run
(the target's) estimates both: ``api_dump_estimates`` counts each tensor's bytes by dtype, and the
golden's estimate counts the tensors in the target's compute dtype at the golden dtype's size
(tensors a model keeps in another dtype, such as a norm's float32 internals, stay as they are).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmflow.dump.recorder import Recorder, Sink, walk_inputs, walk_output
from llmflow.structure import find_layer_stack


def dir_bytes(path: str | Path | None) -> int:
    """Total size of the files under ``path`` (0 when it does not exist)."""
    if not path or not Path(path).exists():
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


class _ByteCounter(Sink):
    """A recorder sink counting what the dump's API mode writes: tensor inputs and outputs of every
    recorded op, each tensor once per step (the dump stores a tensor handed to several ops once),
    weights (``nn.Parameter``) not at all (the dump records their shape only). Ops of ``layer``
    (a module path) count apart from the rest."""

    def __init__(self, layer: str | None) -> None:
        self.active = False  # inside the model's forward (the dump records nothing between steps)
        self.layer_names = (f"{layer}.", f"{layer}/") if layer else None  # its modules' and its ops' names
        # per step: bytes of the ops outside ``layer``, and of ``layer``'s ops, by (dtype, the
        # dtype it was cast from: a cast's output, which the same op in the other dtype may not make)
        self.outside: list[dict[tuple[torch.dtype, torch.dtype | None], int]] = []
        self.in_layer: list[dict[tuple[torch.dtype, torch.dtype | None], int]] = []
        self.seen: list[torch.Tensor] = []  # kept alive so ids stay unique within a step
        self.ids: set[int] = set()
        self.first_input: torch.Tensor | None = None  # the op's first tensor input, while it runs
        self.cast_from: torch.dtype | None = None  # the op's output is a cast of it from this dtype

    def begin_step(self, step: int) -> None:
        self.outside.append({})
        self.in_layer.append({})
        self.seen.clear()
        self.ids.clear()
        self.active = True

    def end_step(self, step: int, output: Any, error: str | None, raised_in: str | None) -> None:
        self.active = False

    def op_inputs(self, name: str, api: str, func: Any, args: tuple, kwargs: dict) -> None:
        self.first_input = next((a for a in args if isinstance(a, torch.Tensor)), None)
        walk_inputs(self, name, "input", args, kwargs, "api", api, tensors_only=True)

    def op_output(self, name: str, api: str, func: Any, output: Any) -> None:
        src = self.first_input
        if (isinstance(output, torch.Tensor) and src is not None and output.is_floating_point()
                and src.is_floating_point() and output.dtype != src.dtype and output.shape == src.shape):
            self.cast_from = src.dtype
        walk_output(self, name, output, "api", api, tensors_only=True)
        self.first_input = self.cast_from = None

    def tensor(self, name: str, kind: str, index: str, t: torch.Tensor, level: str,
               mtype: str | None) -> None:
        if id(t) in self.ids:
            return
        self.ids.add(id(t))
        self.seen.append(t)
        if level == "api":  # (the outputs of a layer run plain arrive with level "module": seen only)
            inside = self.layer_names is not None and name.startswith(self.layer_names)
            part = self.in_layer[-1] if inside else self.outside[-1]
            key = (t.dtype, self.cast_from)
            part[key] = part.get(key, 0) + t.numel() * t.element_size()

    def other(self, *_a: Any) -> None: ...  # parameters and plain values: no tensor bytes


def _run_plain(layers: list[tuple[str, nn.Module]], counter: _ByteCounter) -> Callable[[], None]:
    """Make ``layers`` run with torch function modes off, so the API mode records none of their
    ops; their outputs count as seen (a full recording counts them inside the layer, and the next
    op must not count them again). Returns what puts their forwards back."""
    def plain(name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def plain_forward(*args: Any, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunction():
                output = forward(*args, **kwargs)
            if counter.active:
                walk_output(counter, name, output, "module", None, tensors_only=True)
            return output
        return plain_forward

    restore = []
    for name, layer in layers:
        restore.append((layer, "forward" in layer.__dict__, layer.__dict__.get("forward")))
        layer.forward = plain(name, layer.forward)  # type: ignore[method-assign]

    def put_back() -> None:
        for layer, had_own, previous in reversed(restore):
            if had_own:
                layer.forward = previous  # type: ignore[method-assign]
            else:
                del layer.forward
    return put_back


def estimate_api_dump_bytes(model: nn.Module, input_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Bytes an API-level dump (inputs + outputs of every op) of ``new_tokens`` greedy steps of
    ``model`` would write: ``api_dump_estimates`` for the model's own dtype."""
    return api_dump_estimates(model, input_ids, new_tokens, [None])[0]


@torch.no_grad()
def api_dump_estimates(model: nn.Module, input_ids: list[int], new_tokens: int,
                       dtypes: list[torch.dtype | None]) -> list[dict[str, Any]]:
    """Bytes an API-level dump (inputs + outputs of every op) of ``new_tokens`` greedy steps would
    write, from one run of ``model``: prefill measured, one decode step measured, the rest
    extrapolated from it; one estimate per entry of ``dtypes``: None for the model itself, a dtype
    for the same ops run in that dtype (the tensors in the model's parameter dtype counted at its
    size).

    Per step: the ops outside the layer stack plus the first layer's times the number of layers
    (``method`` ``"one layer x N"``, ``layers`` N); a model without a layer stack has every op
    recorded (``"every op"``). ``outside_layers_bytes`` and ``one_layer_bytes`` give the parts
    (prefill, decode step).
    """
    from llmflow.models import greedy_generate

    stack = find_layer_stack(model)
    modules = dict(model.named_modules())
    names = list(stack.layers) if stack is not None and len(stack.layers) > 1 else []
    counter = _ByteCounter(names[0] if names else None)
    recorder = Recorder(model, lambda _n, _m: False, ops=True, sink=counter, steps=True)
    put_back = _run_plain([(n, modules[n]) for n in names[1:]], counter)
    try:
        greedy_generate(model, input_ids, min(2, max(1, new_tokens)))
    finally:
        put_back()
        recorder.remove()
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return [_extrapolate(counter, own, dtype, len(names), len(input_ids), new_tokens) for dtype in dtypes]


def _extrapolate(counter: _ByteCounter, own: torch.dtype | None, as_dtype: torch.dtype | None,
                 n_layers: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """One estimate from the counted bytes: ``own``'s tensors at ``as_dtype``'s size, and casts
    between the two dropped (in ``as_dtype`` such a cast returns its input: nothing new to write);
    ``as_dtype`` None: as counted."""
    def size(parts: dict[tuple[torch.dtype, torch.dtype | None], int]) -> int:
        if own is None or as_dtype is None or as_dtype == own:
            return sum(parts.values())
        total = 0.0
        for (dtype, cast_from), nbytes in parts.items():
            if {dtype, cast_from} == {own, as_dtype}:
                continue
            total += nbytes * (as_dtype.itemsize / own.itemsize if dtype == own else 1.0)
        return int(total)

    outside = [size(part) for part in counter.outside[:2]]
    in_layer = [size(part) for part in counter.in_layer[:2]]
    layers = max(n_layers, 1)
    steps = [o + layer * layers for o, layer in zip(outside, in_layer, strict=True)] or [0]
    decode = steps[1] if len(steps) > 1 else steps[0] / max(prompt_len, 1)
    total = int(steps[0] + decode * max(new_tokens - 1, 0))
    return {"prefill_bytes": int(steps[0]), "decode_step_bytes": int(decode), "total_bytes": total,
            "method": "one layer x N" if n_layers else "every op", "layers": layers,
            "outside_layers_bytes": outside, "one_layer_bytes": in_layer}
