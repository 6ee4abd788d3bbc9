"""The recorder: the one place that sees a model's module and op calls, for every consumer.

A ``Recorder`` instruments a model and hands what it sees to a *sink*:

  the disk dump (``DumpSession``, capture.py): index rows and tensor copies, step by step;
  memory (memory.py): module calls kept for isolation replay and decode-step replay, op calls
    kept for op replay;
  a byte counter (localize/cost.py): what an API dump would write, without writing it.

The recorder owns what they share: which modules are instrumented and how, the stack of modules
whose forward is running (innermost last), the innermost module an exception left, API naming
(``<module path>/<api>.<n>``, api.py, counted per step), the walk that labels nested inputs
and outputs (``"0"``, ``"1.0"``, ``"kw:<name>"``) and, when asked (``steps=True``), the steps:
every call of the root module is one step (prefill = 0, then one per decode step), begun and
ended by torch hooks on the root (one call per step, so their slow path costs nothing), numbered
from when the sink was attached, and handed to the sink as ``begin_step``/``end_step``. A sink
keeps only its own business: what to keep of a call and where to put it.

Modules get a recording ``forward`` on their instance rather than torch forward hooks: with hooks
every module call takes ``Module._call_impl``'s slow path (~25 us a call, 1.2x a tiny model's
decode time before anything is recorded) against ~5 us for one more Python frame. The wrapper
sees what ``forward`` receives, after any pre-hooks the model has. A module that already carries
forward hooks (a fault injected by a patch may rewrite its output after ``forward`` returns) has
its output recorded by a hook of ours run after those, so sinks get what the call really returned.
Where the dump capture is built, the wrapper is its C twin (capture.cpp's ``RecordingForward``:
the same steps without a Python frame, 0.5-1.4 us less a module call); ``use_compiled_forward``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from llmflow import native
from llmflow.dump.api import ApiMode

Select = Callable[[str, nn.Module], bool]
_NATIVE = None if native.disabled() else native.CAPTURE.extension("llmflow_capture")


class Sink:
    """Where a recorder sends the calls it sees; this base keeps nothing, a sink overrides what it
    keeps. ``active`` is read on every call: while it is False nothing is sent. ``exec_order``,
    when a list, receives every call's name in order."""

    active: bool = True
    exec_order: list[str] | None = None

    def module_inputs(self, name: str, mtype: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A selected module was called (before its forward runs)."""

    def module_output(self, name: str, mtype: str, module: nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        """A selected module returned ``output`` (after any forward hooks of its own)."""

    def wants_op(self, module: str) -> bool:
        """Are the ops called directly inside ``module`` recorded?"""
        return True

    def op_inputs(self, name: str, api: str, func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """A torch API call is about to run."""

    def op_output(self, name: str, api: str, func: Callable[..., Any], output: Any) -> None:
        """The torch API call returned ``output``."""

    def begin_step(self, step: int) -> None:
        """The root module's forward starts step ``step`` (0 for the first since this sink was
        attached). Setting ``active`` here decides whether the step is recorded."""

    def end_step(self, step: int, output: Any, error: str | None, raised_in: str | None) -> None:
        """Step ``step`` is over: the root's forward returned ``output``, or (``output`` None)
        raised ``error`` (``"Type: message"``, first line) innermost in module ``raised_in`` when
        known, or never returned (a KeyboardInterrupt; ended when the next step begins)."""


StepStart = Callable[[tuple, dict], None]


class Recorder:
    """Instruments ``model``'s sub-modules chosen by ``select`` (inputs and/or outputs), and with
    ``ops`` every module (for naming) plus an API mode to enter around the calls to record.

    Names are module paths in the whole model: ``model`` may be a sub-module found at ``prefix``
    (a decoder layer), whose own ops are then named ``<prefix>/<api>.<n>``. The root module itself
    is never wrapped. With ``steps`` each call of it is a step: the sink's ``begin_step`` and
    ``end_step`` around it, with ``ops`` the API mode entered for the steps the sink records;
    ``before_step(args, kwargs)``, when set, runs first and may attach another sink (a dump opens
    a new session per dialogue turn); ``after_step(step)`` runs after a step that returned.
    Without ``steps`` the caller decides when ops are recorded (``recording_ops``).
    ``attach(sink)`` swaps the sink at any time; ``remove()`` takes everything off again.
    """

    # the recording forward in C where it is built (``use_compiled_forward``), else None
    compiled_forward: Any = None

    def __init__(self, model: nn.Module, select: Select, *, inputs: bool = True, outputs: bool = True,
                 ops: bool = False, prefix: str = "", sink: Sink | None = None, steps: bool = False):
        self.sink: Sink | None = sink
        self.prefix = prefix
        self.stack: list[str] = []  # modules whose forward is running, innermost last
        self.raised_in: str | None = None  # the innermost module an exception left
        self.op_counts: dict[str, int] = {}  # "<module>/<api>" -> calls so far this step
        self.step = -1  # the sink's current (or last) step
        self.in_step = False  # between a step's begin and end
        self.before_step: StepStart | None = None
        self.after_step: Callable[[int], None] | None = None
        self.ops_mode: Any = None
        if ops:
            self.ops_mode = ApiMode(self)
        self._ops_entered = False  # the API mode is entered for the current step
        self._hooks: list[Any] = []
        self._wrapped: list[_ForwardWrapper] = []
        if steps:
            self._hooks.append(model.register_forward_pre_hook(self._begin_step, with_kwargs=True))
            self._hooks.append(model.register_forward_hook(self._end_step, with_kwargs=True,
                                                           always_call=True))
        global_hooks = bool(torch.nn.modules.module._global_forward_hooks)
        for sub_name, sub in model.named_modules():
            if sub is model:
                continue
            name = f"{prefix}.{sub_name}" if prefix else sub_name
            chosen = select(name, sub)
            if not chosen and not ops:
                continue  # neither recorded nor needed for op naming: no wrapper, no cost
            mtype = type(sub).__name__
            by_hook = chosen and outputs and bool(sub._forward_hooks or global_hooks)
            if by_hook:
                self._hooks.append(sub.register_forward_hook(self._output_hook(name, mtype), with_kwargs=True,
                                                             always_call=True))
            self._wrapped.append(_ForwardWrapper(sub, self._recording_forward(
                sub, name, mtype, chosen and inputs, chosen and outputs and not by_hook)))

    def attach(self, sink: Sink | None) -> None:
        """Send what is recorded from now on to ``sink``; its steps count from 0."""
        self.sink = sink
        self.step = -1

    # -- steps: the root module's calls (``steps=True``) ------------------------------------------
    def _begin_step(self, _root: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.in_step:  # the last step's forward was left by a KeyboardInterrupt or the like
            # (torch's always_call hooks see only Exception subclasses)
            self._finish_step(None, "the step's forward never returned (interrupted)", None)
        self.op_counts.clear()  # op numbering restarts, no module is running
        self.stack.clear()
        self.raised_in = None
        if self.before_step is not None:
            self.before_step(args, kwargs)
        sink = self.sink
        if sink is None:
            return
        self.step += 1
        self.in_step = True
        sink.begin_step(self.step)
        if self.ops_mode is not None and sink.active:
            self.ops_mode.__enter__()
            self._ops_entered = True

    def _end_step(self, _root: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # torch calls this hook (always_call) with output None from inside its ``except`` when
        # the forward raised: that exception is the one being handled now
        exc = sys.exc_info()[1] if output is None else None
        error = f"{type(exc).__name__}: {exc}".splitlines()[0] if exc is not None else None
        self._finish_step(output, error, self.raised_in if exc is not None else None)

    def _finish_step(self, output: Any, error: str | None, raised_in: str | None) -> None:
        was_in_step, self.in_step = self.in_step, False
        if self._ops_entered:
            self._ops_entered = False
            self.ops_mode.__exit__(None, None, None)
        sink = self.sink
        if sink is None or not was_in_step:
            return
        sink.end_step(self.step, output, error, raised_in)
        if error is None and self.after_step is not None:
            self.after_step(self.step)

    def recording_ops(self) -> Any:
        """A context in which torch API calls are recorded (nothing when built without ``ops``)."""
        return self.ops_mode if self.ops_mode is not None else nullcontext()

    def _recording_forward(self, module: nn.Module, name: str, mtype: str, want_inputs: bool,
                           want_outputs: bool) -> Callable[..., Any]:
        forward = module.forward
        stack = self.stack
        naming = self.ops_mode is not None
        if self.compiled_forward is not None:  # the same steps in C
            return self.compiled_forward(self, stack, forward, module, name, mtype, want_inputs, want_outputs,
                                         naming)

        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            sink = self.sink
            if sink is None or not sink.active:
                if not naming:
                    return forward(*args, **kwargs)
                sink = None
            stack.append(name)
            try:
                if sink is not None:
                    if sink.exec_order is not None:
                        sink.exec_order.append(name)
                    if want_inputs:
                        sink.module_inputs(name, mtype, module, args, kwargs)
                output = forward(*args, **kwargs)
                if want_outputs and sink is not None and sink.active:
                    sink.module_output(name, mtype, module, args, kwargs, output)
                return output
            except BaseException:  # (no cost until something raises)
                if self.raised_in is None:
                    self.raised_in = name
                raise
            finally:
                if stack and stack[-1] == name:
                    stack.pop()
        # inspect.signature reports the module's own forward's (transformers passes an encoder
        # only the keywords its forward names), as for a wrapper made with functools.wraps
        recording_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        return recording_forward

    def _output_hook(self, name: str, mtype: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            sink = self.sink
            if sink is not None and sink.active:
                sink.module_output(name, mtype, module, args, kwargs, output)
        return hook

    def remove(self) -> None:
        """Take every wrapper and hook off (nested wraps unwind innermost first); the sink gets
        nothing more, even through a wrapper another tool's wrapper keeps in the chain."""
        if self._ops_entered:  # removed from inside a step
            self._ops_entered = False
            self.ops_mode.__exit__(None, None, None)
        self.sink = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for w in reversed(self._wrapped):
            w.remove()
        self._wrapped.clear()


def use_compiled_forward(on: bool = True) -> bool:
    """Recorders made from now on wrap modules with the compiled recording forward (``on``,
    where it is built: the default) or the Python closure; returns whether the compiled one is in
    use now (``capture.use_compiled_capture`` switches it with the rest of the capture)."""
    compiled = on and _NATIVE is not None
    Recorder.compiled_forward = _NATIVE.RecordingForward if compiled else None
    return compiled


use_compiled_forward(True)


class _ForwardWrapper:
    """Puts a recording ``forward`` on one module instance and takes it off again.

    Only the instance attribute changes (the class and torch stay untouched); ``remove`` puts
    back exactly what was there before, including a ``forward`` another tool had set on the
    instance (accelerate's hooks do that). Recorders may stack on one module (a dump and a
    replay's capture) and come off in any order.
    """

    def __init__(self, module: nn.Module, forward: Callable[..., Any]):
        self.module = module
        self.had_own = "forward" in module.__dict__
        self.previous = module.__dict__.get("forward")
        self.forward = forward
        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is not self.forward:
            # someone wrapped over us: leave their wrapper alone, and leave word on our function
            # so that theirs, when it comes off, puts back what was there before ours
            self.forward._llmflow_unwrapped = (self.had_own, self.previous)  # type: ignore[attr-defined]
            return
        had_own, previous = self.had_own, self.previous
        while had_own and hasattr(previous, "_llmflow_unwrapped"):  # wrappers removed beneath us
            had_own, previous = previous._llmflow_unwrapped
        if had_own:
            self.module.forward = previous  # type: ignore[method-assign]
        else:
            del self.module.forward


# -- the walk over a call's values ----------------------------------------------------------------
class Leaves(Protocol):
    """What a flattening sink does with each leaf the walk reaches."""

    def tensor(self, name: str, kind: str, index: str, t: torch.Tensor, level: str,
               module_type: str | None) -> None: ...

    def other(self, name: str, kind: str, index: str, value: Any, level: str,
              module_type: str | None) -> None:
        """A parameter (``nn.Parameter``), or a value that is not a tensor or container."""


MAX_DEPTH = 6  # deeper containers are leaves
_POSITIONAL = tuple(str(i) for i in range(32))  # index labels of positional values
_KEYWORD: dict[str, str] = {}  # keyword -> "kw:<keyword>" (a module's keywords repeat every call)


def walk_inputs(leaves: Leaves, name: str, kind: str, args: tuple, kwargs: dict | None, level: str,
                module_type: str | None, tensors_only: bool = False) -> None:
    """Every leaf of a call's inputs: positional ``"0"``, ``"1.0"``..., keyword ``"kw:<name>"``.

    ``tensors_only`` skips leaves that are neither tensors nor parameters. Runs with torch
    function modes off, so what sinks compute is not itself recorded.
    """
    # (per call of every module: labels come from tables, a plain tensor skips ``_walk``)
    tensor = leaves.tensor
    with torch._C.DisableTorchFunction():
        for i, a in enumerate(args):
            label = _POSITIONAL[i] if i < len(_POSITIONAL) else str(i)
            if type(a) is torch.Tensor:
                tensor(name, kind, label, a, level, module_type)
            else:
                _walk(leaves, name, kind, label, a, level, module_type, tensors_only, 0)
        if kwargs:
            for k, v in kwargs.items():
                label = _KEYWORD.get(k) or _KEYWORD.setdefault(k, f"kw:{k}")
                if type(v) is torch.Tensor:
                    tensor(name, kind, label, v, level, module_type)
                else:
                    _walk(leaves, name, kind, label, v, level, module_type, tensors_only, 0)


def walk_output(leaves: Leaves, name: str, output: Any, level: str, module_type: str | None,
                tensors_only: bool = False) -> None:
    """Every leaf of a call's output (kind ``output``): a tensor is ``"0"``; tuples ``"0"``,
    ``"1"``...; dicts by key."""
    with torch._C.DisableTorchFunction():
        if type(output) is torch.Tensor:
            leaves.tensor(name, "output", "0", output, level, module_type)
        elif isinstance(output, (tuple, list)):
            for i, v in enumerate(output):
                label = _POSITIONAL[i] if i < len(_POSITIONAL) else str(i)
                _walk(leaves, name, "output", label, v, level, module_type, tensors_only, 0)
        elif isinstance(output, dict):
            for k, v in output.items():
                _walk(leaves, name, "output", str(k), v, level, module_type, tensors_only, 0)
        else:
            _walk(leaves, name, "output", "0", output, level, module_type, tensors_only, 0)


def _walk(leaves: Leaves, name: str, kind: str, index: str, value: Any, level: str,
          module_type: str | None, tensors_only: bool, depth: int) -> None:
    if type(value) is torch.Tensor:  # the common case first
        leaves.tensor(name, kind, index, value, level, module_type)
    elif type(value) is nn.Parameter:  # a weight handed to an op (Parameter's own isinstance is Python
        leaves.other(name, kind, index, value, level, module_type)  # code, ~1 us: asked of the rest only)
    elif isinstance(value, torch.Tensor):
        if isinstance(value, nn.Parameter):
            leaves.other(name, kind, index, value, level, module_type)
        else:
            leaves.tensor(name, kind, index, value, level, module_type)
    elif isinstance(value, (tuple, list)) and depth < MAX_DEPTH:
        if not value:  # a leaf of its own (``torch.tensor([])``, ``torch.zeros(())``): a replay needs it
            if not tensors_only:
                leaves.other(name, kind, index, value, level, module_type)
            return
        for i, v in enumerate(value):
            _walk(leaves, name, kind, f"{index}.{i}", v, level, module_type, tensors_only, depth + 1)
    elif isinstance(value, dict) and depth < MAX_DEPTH:
        for k, v in value.items():
            _walk(leaves, name, kind, f"{index}.{k}", v, level, module_type, tensors_only, depth + 1)
    elif not tensors_only:
        leaves.other(name, kind, index, value, level, module_type)
