"""``register_hook``, ``set_dump_path`` and ``save``: the msit llm compatible entry points.

Steps: every forward call of the root module is one step (prefill = 0, then one per decode step).
Dialogue turns: a root call that starts a new sequence (an empty KV cache, or without a cache,
input ids that do not extend the previous call's) closes the current dump and opens the next, so
two prompts in one process give two dumps. Folders: the k-th turn since the last
``set_dump_path`` (or since ``register_hook``) goes to ``<dump_path>/<dump_tag>`` for k = 0 and
``<dump_path>/<dump_tag>_<k>`` after that; each holds one ``rank{R}`` folder per rank.

The root module's own inputs and outputs are not dumped, except its logits (level ``logits``).
The root carries torch forward hooks (one call per step); every other module gets a recording
``forward`` on its instance instead (see ``DumpHandle._make_forward`` for why), which
``remove()`` takes off again.

``remove()`` is optional: a dump nobody closed is finished when its model is garbage-collected
or when the process exits normally (see ``capture.py``). A forward that raises does not end the
dump: the step keeps what it captured before the exception, the exception (and the innermost
module it came through) is recorded in ``rank.json``, and the next forward goes on dumping.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmflow.dump.api import ApiCaptureMode
from llmflow.dump.capture import DumpSession, inline_writer
from llmflow.dump.config import DumpConfig
from llmflow.errors import UserError
from llmflow.models import logits_of
from llmflow.structure import find_cache

log = logging.getLogger("llmflow.dump")
DEFAULT_TAG = "llmflow_dump"
_PATH: dict[str, Any] = {"dump_path": None, "dump_tag": DEFAULT_TAG, "serial": 0}
_HANDLES: weakref.WeakSet[DumpHandle] = weakref.WeakSet()


class DumpHandle:
    """The hooks on one model. ``remove()`` takes them all away and closes the open dump."""

    def __init__(self, model: torch.nn.Module, config: DumpConfig, *, exact_dir: str | Path | None = None,
                 env_factory: Callable[[], dict[str, Any]] | None = None):
        self.model = model
        self.config = config
        self.exact_dir = Path(exact_dir) if exact_dir is not None else None
        self.env_factory = env_factory
        self.session: DumpSession | None = None
        self.dumps: list[Path] = []  # every dump directory this handle has written
        self.stack: list[str] = []  # modules whose forward is running, innermost last
        self._turn = 0
        self._path_serial = _PATH["serial"]
        self._prev_ids: torch.Tensor | None = None
        self._api = ApiCaptureMode(self) if config.dump_apis else None
        self._api_entered = False
        self._hooks: list[Any] = []  # torch hook handles (the root module's)
        self._wrapped: list[_ForwardWrapper] = []  # submodules whose forward records
        self.on_step: Callable[[int], None] | None = None  # progress callback after each step
        self.in_step = False  # between the root's pre- and post-hook: ``save`` targets this dump
        self.raised_in: str | None = None  # the innermost module an exception of this step left
        self.inline_writer = inline_writer(model)
        self.enabled = _device_matches(model, config.device_id)
        if self.enabled:
            self._install()
        _HANDLES.add(self)

    # -- installation -------------------------------------------------------------------------
    def _install(self) -> None:
        m = self.model
        self._hooks.append(m.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._hooks.append(m.register_forward_hook(self._root_post, with_kwargs=True, always_call=True))
        cfg = self.config
        for name, sub in m.named_modules():
            if sub is m:
                continue
            mtype = type(sub).__name__
            dumped = cfg.dump_modules and cfg.wants_module(name, mtype)
            if not dumped and self._api is None:
                continue  # neither dumped nor needed for API naming: no wrapper, no cost
            # a forward hook already there may change the output after forward returns (a fault
            # injected by a patch, say): record that module's output from a hook of ours run after
            # it, so the dump holds what the module call really returned
            outputs_by_hook = dumped and self.config.tensor_part != 0 and bool(
                sub._forward_hooks or torch.nn.modules.module._global_forward_hooks)
            if outputs_by_hook:
                self._hooks.append(sub.register_forward_hook(self._make_post(name, mtype), always_call=True))
            self._wrapped.append(_ForwardWrapper(sub, self._make_forward(
                sub.forward, name, mtype, dumped, record_outputs=not outputs_by_hook)))

    def _make_forward(self, forward: Callable[..., Any], name: str, mtype: str, dumped: bool,
                      record_outputs: bool = True) -> Callable[..., Any]:
        """``forward`` wrapped to record its inputs and outputs.

        A wrapper on the instance, not torch's forward hooks: with hooks every module call takes
        ``Module._call_impl``'s slow path, measured at ~25 us per call here (1.2x a tiny model's
        decode time before anything is recorded), against ~5 us for one more Python frame. The
        wrapper sees what ``forward`` itself receives, after any pre-hooks the model has.
        """
        want_inputs = dumped and self.config.tensor_part != 1
        want_outputs = dumped and self.config.tensor_part != 0 and record_outputs
        stack = self.stack

        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            s = self.session
            if s is None or not s.active:
                if self._api is None:
                    return forward(*args, **kwargs)
                s = None
            stack.append(name)
            try:
                if s is not None:
                    s.exec_order.append(name)
                    if want_inputs:
                        s.record_call(name, "input", args, kwargs, "module", mtype)
                output = forward(*args, **kwargs)
                if want_outputs and s is not None and s.active:
                    s.record_output(name, output, "module", mtype)
                return output
            except BaseException:  # (no cost until something raises)
                if self.raised_in is None:
                    self.raised_in = name
                raise
            finally:
                if stack and stack[-1] == name:
                    stack.pop()
        return recording_forward

    def _make_post(self, name: str, mtype: str) -> Callable[..., None]:
        def post(module: torch.nn.Module, args: tuple, output: Any) -> None:
            s = self.session
            if s is not None and s.active:
                s.record_output(name, output, "module", mtype)
        return post

    # -- the root: steps and turns ------------------------------------------------------------
    def _root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.stack.clear()
        new = self._new_sequence(args, kwargs)
        fresh = self.session is not None and self.session.step < 0  # opened, no step yet
        if self.session is None or self._path_serial != _PATH["serial"] or (new and not fresh):
            self.open_next()
        assert self.session is not None
        self.session.begin_step()
        self.in_step = True
        self.raised_in = None
        if self._api is not None and self.session.active:
            self._api.__enter__()
            self._api_entered = True

    def _root_post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.in_step = False
        if self._api_entered:
            self._api.__exit__(None, None, None)  # type: ignore[union-attr]
            self._api_entered = False
        s = self.session
        if s is None:
            return
        # torch calls this hook (always_call) with output None from inside its ``except`` when
        # the forward raised: that exception is the one being handled now
        exc = sys.exc_info()[1] if output is None else None
        if exc is not None:
            s.end_step(error=f"{type(exc).__name__}: {exc}".splitlines()[0], module=self.raised_in)
            self.raised_in = None
            return
        self.raised_in = None  # (an exception caught inside the model is not the step's)
        if self.config.logits and output is not None:
            try:
                logits = logits_of(output)
            except TypeError:
                logits = None
            if logits is not None:
                s.record_logits(logits)
        s.end_step()
        if self.on_step is not None:
            self.on_step(s.step)

    def _new_sequence(self, args: tuple, kwargs: dict) -> bool:
        """Does this root call start a new sequence (a new prompt) rather than continue one?"""
        found = find_cache((), kwargs)
        cache = found[1] if found else None
        if cache is not None:
            return int(cache.get_seq_length()) == 0
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            return False
        prev, self._prev_ids = self._prev_ids, ids.detach().clone()
        if cache is not None or kwargs.get("use_cache"):
            return False  # a cache we cannot query: treat it as one sequence
        n = prev.shape[1] if prev is not None else 0
        return prev is None or ids.shape[1] <= n or not torch.equal(ids[:, :n], prev)

    def open_next(self) -> None:
        """Close the current dump (if any) and open the next turn's."""
        if self.session is not None:
            self.session.close()
        if self._path_serial != _PATH["serial"]:
            self._path_serial, self._turn = _PATH["serial"], 0
        if self.exact_dir is not None:
            target = self.exact_dir if self._turn == 0 else Path(f"{self.exact_dir}_{self._turn}")
        else:
            base = Path(_PATH["dump_path"] if _PATH["dump_path"] is not None else self.config.dump_path)
            tag = _PATH["dump_tag"] + (f"_{self._turn}" if self._turn else "")
            target = base / tag
        self._turn += 1
        env = self.env_factory() if self.env_factory else _default_env(self.model)
        self.session = DumpSession(target, self.config, self.model, env=env, inline=self.inline_writer)
        self.dumps.append(target)
        log.info("llmflow: dumping rank %d to %s", self.session.rank, target)

    def close_session(self) -> None:
        """Finish the current dump (complete); the next forward opens a new one."""
        if self.session is not None:
            self.session.close()
            self.session = None

    def remove(self) -> None:
        """Remove every hook and close the open dump."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for w in reversed(self._wrapped):  # innermost last in, first out: nested wraps unwind
            w.remove()
        self._wrapped.clear()
        if self._api_entered:
            self._api.__exit__(None, None, None)  # type: ignore[union-attr]
            self._api_entered = False
        self.close_session()
        _HANDLES.discard(self)


class _ForwardWrapper:
    """Puts a recording ``forward`` on one module instance and takes it off again.

    Only the instance attribute changes (the class and torch stay untouched); ``remove`` puts
    back exactly what was there before, including a ``forward`` another tool had set on the
    instance (accelerate's hooks do that).
    """

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any]):
        self.module = module
        self.had_own = "forward" in module.__dict__
        self.previous = module.__dict__.get("forward")
        self.forward = forward
        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is not self.forward:
            return  # someone wrapped over us: leave their wrapper alone
        if self.had_own:
            self.module.forward = self.previous  # type: ignore[method-assign]
        else:
            del self.module.forward


def _device_matches(model: torch.nn.Module, device_id: int | None) -> bool:
    if device_id is None:
        return True
    p = next(model.parameters(), None)
    index = (p.device.index if p is not None and p.device.index is not None else 0)
    return index == device_id


def _default_env(model: torch.nn.Module) -> dict[str, Any]:
    from llmflow.dump.env import collect_env

    return collect_env(model)


def register_hook(model: torch.nn.Module, config: DumpConfig, hook_type: str = "dump_data") -> DumpHandle:
    """Hook ``model`` so its forward calls are dumped as ``config`` says (msit llm signature)."""
    if hook_type != "dump_data":
        raise UserError(f"register_hook: hook_type {hook_type!r} is not supported (only 'dump_data')")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"register_hook: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, DumpConfig):
        raise UserError(f"register_hook: config must be a DumpConfig, got {type(config).__name__}")
    if config.seed is not None:
        from llmflow.seeding import seed_all

        seed_all(config.seed)
    if "auto" in config.module_list:  # the decoder-layer classes, found from the model's structure
        from llmflow.structure import resolve_module_classes

        names = [m if isinstance(m, str) else m.__name__ for m in config.module_list]
        config.module_list = resolve_module_classes(model, names)
        config.__post_init__()
    return DumpHandle(model, config)


def set_dump_path(dump_path: str = ".", dump_tag: str = "msit_dump", backend: str = "pt") -> None:
    """Send the next dump to ``<dump_path>/<dump_tag>`` (msit llm signature).

    Open dumps are closed, so calling this before each dialogue turn gives one folder per turn.
    """
    if backend != "pt":
        raise UserError(f"set_dump_path: backend {backend!r} is not supported: llmflow dumps torch "
                        "models ('pt'); read ATB dumps with the 'atb' format instead")
    if not dump_tag or "/" in dump_tag or dump_tag in (".", ".."):
        raise UserError(f"set_dump_path: dump_tag {dump_tag!r} must be a plain folder name")
    _PATH.update(dump_path=str(dump_path), dump_tag=dump_tag, serial=_PATH["serial"] + 1)
    for handle in list(_HANDLES):
        handle.close_session()


def save(name: str, value: Any) -> bool:
    """Record ``value`` (a tensor, or nested lists/dicts of them) into the current step of the
    active dump (level ``save``). Returns False, with a warning, when no dump is open."""
    # the model running now, else any open dump: another hooked model never removed must not
    # take values saved from inside this one's forward
    open_now = [h for h in list(_HANDLES) if h.session is not None and not h.session.closed]
    for handle in [h for h in open_now if h.in_step] or open_now:
        s = handle.session
        if s is not None:
            s.record_output(str(name), value, "save", None)
            return True
    log.warning("llmflow.save(%r): no dump is open (call it during a hooked model's run)", name)
    return False

