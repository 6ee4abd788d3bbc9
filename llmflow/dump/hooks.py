"""``register_hook``, ``set_dump_path`` and ``save``: the msit llm compatible entry points.

Steps: every forward call of the root module is one step (prefill = 0, then one per decode step).
Dialogue turns: a root call that starts a new sequence (an empty KV cache, or without a cache,
input ids that do not extend the previous call's) closes the current dump and opens the next, so
two prompts in one process give two dumps. Folders: the k-th turn since the last
``set_dump_path`` (or since ``register_hook``) goes to ``<dump_path>/<dump_tag>`` for k = 0 and
``<dump_path>/<dump_tag>_<k>`` after that; each holds one ``rank{R}`` folder per rank.

The root module's own inputs and outputs are not dumped, except its logits (level ``logits``).
The recorder (``recorder.py``) drives the steps from the root's calls and instruments every
other module and the ops, with the open ``DumpSession`` as its sink; before each step the handle
decides whether it starts a new turn (``_before_step``); ``remove()`` takes it all off again.

``remove()`` is optional: a dump nobody closed is finished when its model is garbage-collected
or when the process exits normally (see ``capture.py``). A forward that raises does not end the
dump: the step keeps what it captured before the exception, the exception (and the innermost
module it came through) is recorded in ``rank.json``, and the next forward goes on dumping.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmflow.dump.capture import DumpSession, inline_writer
from llmflow.dump.config import DumpConfig
from llmflow.dump.recorder import Recorder
from llmflow.errors import UserError
from llmflow.structure import find_cache

log = logging.getLogger("llmflow.dump")
DEFAULT_TAG = "llmflow_dump"
_PATH: dict[str, Any] = {"dump_path": None, "dump_tag": DEFAULT_TAG, "serial": 0}
_HANDLES: weakref.WeakSet[DumpHandle] = weakref.WeakSet()
# dump directories opened under a dump_path in this process -> the handle (its number) that
# opened them: a second model hooked with the same dump_path (a golden and a target in one script)
# takes the next free name instead of writing into, or over, the first one's dump
_OPENED: dict[Path, int] = {}
_NUMBERS = itertools.count()


class DumpHandle:
    """The hooks on one model. ``remove()`` takes them all away and closes the open dump."""

    def __init__(self, model: torch.nn.Module, config: DumpConfig, *, exact_dir: str | Path | None = None,
                 env_factory: Callable[[], dict[str, Any]] | None = None):
        self.model = model
        if "auto" in config.module_list:  # the decoder-layer classes, found from the model's structure
            from llmflow.structure import resolve_module_classes

            names = [m if isinstance(m, str) else m.__name__ for m in config.module_list]
            config = dataclasses.replace(config, module_list=resolve_module_classes(model, names))
        self.config = config
        self.exact_dir = Path(exact_dir) if exact_dir is not None else None
        self.env_factory = env_factory
        self._session: DumpSession | None = None
        self.dumps: list[Path] = []  # every dump directory this handle has written
        self._turn = 0
        self._path_serial = _PATH["serial"]
        self._number = next(_NUMBERS)  # (the key of its dumps in _OPENED)
        self._prev_ids: torch.Tensor | None = None
        self.recorder: Recorder | None = None  # the steps, the sub-modules' and the ops' recorder
        self.on_step: Callable[[int], None] | None = None  # progress callback after each step
        self.inline_writer = inline_writer(model)
        self.enabled = _device_matches(model, config.device_id)
        if self.enabled:
            self._install()
        _HANDLES.add(self)

    def _install(self) -> None:
        m, cfg = self.model, self.config
        chosen = (cfg.wants_module(name, type(sub).__name__) for name, sub in m.named_modules()
                  if sub is not m)
        if cfg.dump_modules and (cfg.module_list or cfg.layer_name) and not any(chosen):
            # (a typo in a class name would dump the logits alone, and a compare would pair only them)
            classes = sorted({type(sub).__name__ for sub in m.modules()})
            log.warning("llmflow dump: module_list %s / layer_name %r match no module of this %s; its module "
                        "classes: %s", [c if isinstance(c, str) else c.__name__ for c in cfg.module_list],
                        cfg.layer_name, type(m).__name__, ", ".join(classes[:20]))
        self.recorder = Recorder(
            m, lambda name, sub: cfg.dump_modules and cfg.wants_module(name, type(sub).__name__),
            inputs=cfg.tensor_part != 1, outputs=cfg.tensor_part != 0, ops=cfg.dump_apis, steps=True)
        self.recorder.before_step = self._before_step
        self.recorder.after_step = self._after_step

    # -- the root: steps and turns ------------------------------------------------------------
    @property
    def session(self) -> DumpSession | None:
        """The dump being written (the recorder's sink), None between dumps."""
        return self._session

    @session.setter
    def session(self, session: DumpSession | None) -> None:
        self._session = session
        if self.recorder is not None:
            self.recorder.attach(session)

    @property
    def in_step(self) -> bool:
        """Is the model's forward running (``save`` targets this dump)?"""
        return self.recorder is not None and self.recorder.in_step

    def _before_step(self, args: tuple, kwargs: dict) -> None:
        """Open the next turn's dump when this root call starts a new sequence (or none is open)."""
        new = self._new_sequence(args, kwargs)
        fresh = self.session is not None and self.session.step < 0  # opened, no step yet
        if self.session is None or self._path_serial != _PATH["serial"] or (new and not fresh):
            self.open_next()

    def _after_step(self, step: int) -> None:
        if self.on_step is not None:
            self.on_step(step)

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
            while True:
                tag = _PATH["dump_tag"] + (f"_{self._turn}" if self._turn else "")
                target = base / tag
                if _OPENED.setdefault(target.absolute(), self._number) == self._number:
                    break
                self._turn += 1  # (another model's dump)
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
        if self.recorder is not None:
            self.recorder.remove()
        self.close_session()
        _HANDLES.discard(self)


def _device_matches(model: torch.nn.Module, device_id: int | None) -> bool:
    """Whether this process dumps: ``device_id`` (msit's) names the one device of a multi-device
    run that dumps. A model on a device without an index (the CPU) counts as device 0. Either
    way, a handle that will dump nothing says so: an empty dump folder later would not."""
    if device_id is None:
        return True
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    index = device.index if device.index is not None else 0
    if index == device_id:
        return True
    if device.index is None:
        log.warning("llmflow dump: DumpConfig(device_id=%d), but the model runs on %s: this process "
                    "dumps nothing (device_id picks an accelerator of a multi-device run; leave it out)",
                    device_id, device.type)
    else:
        log.info("llmflow dump: the model runs on %s, not device %d (device_id): this process dumps "
                 "nothing", device, device_id)
    return False


def _default_env(model: torch.nn.Module) -> dict[str, Any]:
    from llmflow.dump.env import collect_env

    return collect_env(model)


def register_hook(model: torch.nn.Module, config: DumpConfig, hook_type: str = "dump_data") -> DumpHandle:
    """Hook ``model`` so its forward calls are dumped as ``config`` says (msit llm signature). A
    model hooked already has its earlier hook removed first, with a warning: one dump per run."""
    if hook_type != "dump_data":
        raise UserError(f"register_hook: hook_type {hook_type!r} is not supported (only 'dump_data')")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"register_hook: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, DumpConfig):
        raise UserError(f"register_hook: config must be a DumpConfig, got {type(config).__name__}")
    if config.seed is not None:
        from llmflow.seeding import seed_all

        seed_all(config.seed)
    earlier = [h for h in list(_HANDLES) if h.model is model and h.recorder is not None]
    for handle in earlier:  # (a notebook cell run again: two hooks would write every dump twice)
        log.warning("llmflow register_hook: this %s was hooked already; the earlier hook is removed "
                    "(its dump, %s, closed) and this one dumps it", type(model).__name__,
                    handle.dumps[-1] if handle.dumps else "none yet")
        handle.remove()
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

