"""``DumpConfig``: what to capture, msit llm compatible (same field names and defaults) plus
llmflow's own fields (``data_mode``, ``crc32``, ``max_bytes``, ``logits``).

Every field is validated when the config is created; a bad value raises a one-line ``UserError``
naming the field, e.g. ``DumpConfig.tensor_part: expected 0, 1 or 2, got 5``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from llmflow.errors import UserError

MODES = ("module", "api")


@dataclass
class DumpConfig:
    """What to dump and where.

    dump_path: folder the dump goes to (``register_hook`` adds a per-dialogue-turn folder below it,
      see ``set_dump_path``; ``dump_run`` writes into it directly).
    token_range: steps to dump (0 = prefill, 1.. = decode steps), or ``"all"``.
    module_list: module classes (or class names) to dump; empty = every module.
    tensor_part: 0 inputs, 1 outputs, 2 both.
    device_id: dump only when the model runs on this device index (None = any).
    dump_last_logits: dump only the model's final logits of each step, no intermediate tensors.
    mode: "module", "api", ["module", "api"], "all", or "none" (only logits/weights/save).
    dump_weight: write every parameter once (kind weight, step -1).
    layer_name: glob (only ``*`` is special) over module paths, e.g. ``model.layers.3*``; also
      filters API calls by their calling module and weights by their parameter name.
    seed: when set, ``llmflow.seeding.seed_all(seed)`` runs at ``register_hook``.
    data_mode: "tensor" (full tensors) or "statistics" (dtype, shape, min/max/mean/norm, NaN/Inf
      counts; no tensor data).
    crc32: in statistics mode also record a CRC32 of each tensor's bytes (costs a host copy).
    max_bytes: stop dumping (with a warning, the dump stays readable) once this many bytes of
      tensor data have been captured; None = no limit.
    logits: record the last position's logits of every step (level "logits"), whatever the
      token_range; compare and bisect need them.
    """

    dump_path: str = "."
    token_range: list[int] | str = field(default_factory=lambda: [0])
    module_list: list[Any] = field(default_factory=list)
    tensor_part: int = 2
    device_id: int | None = None
    dump_last_logits: bool = False
    mode: str | list[str] = "module"
    dump_weight: bool = False
    layer_name: str | None = None
    seed: int | None = None
    data_mode: str = "tensor"
    crc32: bool = False
    max_bytes: int | None = None
    logits: bool = True

    def __post_init__(self) -> None:
        self.dump_path = str(self.dump_path)
        self.token_range = _check_token_range(self.token_range)
        if not isinstance(self.module_list, (list, tuple)):
            raise UserError(f"DumpConfig.module_list: expected a list of module classes or class "
                            f"names, got {type(self.module_list).__name__}")
        for m in self.module_list:
            if not (isinstance(m, str) or (isinstance(m, type) and issubclass(m, torch.nn.Module))):
                raise UserError(f"DumpConfig.module_list: {m!r} is neither a torch.nn.Module class "
                                "nor a class name")
        if self.tensor_part not in (0, 1, 2) or isinstance(self.tensor_part, bool):
            raise UserError(f"DumpConfig.tensor_part: expected 0, 1 or 2, got {self.tensor_part!r}")
        if self.device_id is not None and (not isinstance(self.device_id, int) or self.device_id < 0):
            raise UserError(f"DumpConfig.device_id: expected a device index >= 0, got {self.device_id!r}")
        self.mode = _check_mode(self.mode)
        if self.layer_name is not None and not isinstance(self.layer_name, str):
            raise UserError(f"DumpConfig.layer_name: expected a string, got {self.layer_name!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise UserError(f"DumpConfig.seed: expected an integer, got {self.seed!r}")
        if self.data_mode not in ("tensor", "statistics"):
            raise UserError(f"DumpConfig.data_mode: expected 'tensor' or 'statistics', got "
                            f"{self.data_mode!r}")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes <= 0):
            raise UserError(f"DumpConfig.max_bytes: expected a positive number of bytes, got "
                            f"{self.max_bytes!r}")
        for flag in ("dump_last_logits", "dump_weight", "crc32", "logits"):
            if not isinstance(getattr(self, flag), bool):
                raise UserError(f"DumpConfig.{flag}: expected true or false, got {getattr(self, flag)!r}")
        self._layer_re = glob_regex(self.layer_name) if self.layer_name else None
        self._type_names = {m if isinstance(m, str) else m.__name__ for m in self.module_list}

    # -- questions the capture code asks on the hot path --------------------------------------
    def wants_step(self, step: int) -> bool:
        return self.token_range == "all" or step in self.token_range  # type: ignore[operator]

    def wants_module(self, name: str, module_type: str) -> bool:
        if self._type_names and module_type not in self._type_names:
            return False
        return self.wants_name(name)

    def wants_name(self, name: str) -> bool:
        return self._layer_re is None or bool(self._layer_re.fullmatch(name))

    @property
    def dump_modules(self) -> bool:
        return "module" in self.mode and not self.dump_last_logits

    @property
    def dump_apis(self) -> bool:
        return "api" in self.mode and not self.dump_last_logits

    def to_json(self) -> dict[str, Any]:
        """The settings as JSON (module classes by name), recorded in llmflow_dump.json."""
        return {
            "token_range": self.token_range, "module_list": sorted(self._type_names),
            "tensor_part": self.tensor_part, "device_id": self.device_id,
            "dump_last_logits": self.dump_last_logits, "mode": self.mode,
            "dump_weight": self.dump_weight, "layer_name": self.layer_name, "seed": self.seed,
            "data_mode": self.data_mode, "crc32": self.crc32, "max_bytes": self.max_bytes,
            "logits": self.logits,
        }


def glob_regex(pattern: str) -> re.Pattern[str]:
    """msit's layer_name glob: ``*`` matches anything, every other character is literal.

    msit names start with ``root.``; llmflow's do not, so a leading ``root.`` is dropped.
    """
    if pattern.startswith("root."):
        pattern = pattern[len("root."):]
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))


def _check_token_range(value: Any) -> list[int] | str:
    if value == "all":
        return "all"
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple, range)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise UserError(f"DumpConfig.token_range: expected a list of step numbers >= 0 or 'all', "
                        f"got {value!r}")
    return sorted(set(value))


def _check_mode(value: Any) -> list[str]:
    if value == "all":
        return list(MODES)
    if value == "none":  # generate only; logits (and weights, if asked) are still recorded
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or any(m not in MODES for m in items):
        raise UserError(f"DumpConfig.mode: expected 'module', 'api', ['module', 'api'], 'all' or 'none', "
                        f"got {value!r}")
    return [m for m in MODES if m in items]
