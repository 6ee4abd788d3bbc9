"""``DumpConfig``: what to capture, msit llm compatible (same field names and defaults) plus
llmflow's own fields (``data_mode``, ``crc32``, ``max_bytes``, ``logits``).

This is the one declaration of the dump settings: each field carries its description and, when
the ``dump`` stage offers it as a parameter, its JSON-schema type (``stage_properties()`` builds
the stage's parameters from them, ``from_params`` the config from the stage's validated
parameters, ``to_json`` the record in llmflow_dump.json).

Every field is validated when the config is created; a bad value raises a one-line ``UserError``
naming the field, e.g. ``DumpConfig.tensor_part: expected 0, 1 or 2, got 5``.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields
from typing import Any

from llmflow.errors import UserError

MODES = ("module", "api")
_NULLABLE_STR = {"type": ["string", "null"]}


def setting(default: Any, description: str, stage: dict[str, Any] | None = None) -> Any:
    """A ``DumpConfig`` field: its default, what it means, and its JSON-schema type as a ``dump``
    stage parameter (None: not a stage parameter; the stage has its own way to say it)."""
    meta = {"description": description, "stage": stage}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DumpConfig:
    """What to dump and where; each field's description is in its declaration below
    (``DumpConfig.describe()`` lists them)."""

    dump_path: str = setting(
        ".", "Folder the dump goes to (register_hook adds a per-dialogue-turn folder below it, see "
        "set_dump_path; dump_run writes into it directly).")
    token_range: list[int] | str = setting(
        [0], "Steps to dump (0 = prefill, 1.. = decode steps), or 'all'.",
        {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}}, {"const": "all"}]})
    module_list: list[Any] = setting(
        [], "Module classes (or class names) to dump; empty = every module; 'auto' = the model's "
        "decoder-layer class(es), found from its structure.",
        {"type": "array", "items": {"type": "string"}})
    tensor_part: int = setting(2, "0 inputs, 1 outputs, 2 both.", {"type": "integer", "enum": [0, 1, 2]})
    device_id: int | None = setting(None, "Dump only when the model runs on this device index (None = any).")
    dump_last_logits: bool = setting(
        False, "Dump only the model's final logits of each step, no intermediate tensors.",
        {"type": "boolean"})
    mode: str | list[str] = setting(
        "module", "Capture module inputs/outputs ('module'), torch API calls ('api'), both ('all' or "
        "['module', 'api']), or none (logits, weights and save() only).",
        {"type": "string", "enum": ["module", "api", "all", "none"]})
    dump_weight: bool = setting(False, "Also write every parameter once (kind weight, step -1).",
                                {"type": "boolean"})
    layer_name: str | None = setting(
        None, "Glob over module paths (only * is special), e.g. model.layers.3*; also filters API calls "
        "by their calling module and weights by their parameter name.", _NULLABLE_STR)
    seed: int | None = setting(None, "When set, llmflow.seeding.seed_all(seed) runs at register_hook.")
    data_mode: str = setting(
        "tensor", "'tensor' (full tensors) or 'statistics' (dtype, shape, min/max/mean/norm, NaN/Inf "
        "counts; no tensor data).", {"type": "string", "enum": ["tensor", "statistics"]})
    crc32: bool = setting(False, "In statistics mode also record a CRC32 of each tensor's bytes (costs a "
                                 "copy of each); a compare of two such dumps then asks for bitwise identity "
                                 "(a differing CRC32 fails its row).", {"type": "boolean"})
    max_bytes: int | None = setting(
        None, "Stop dumping (with a warning; the dump stays readable and says it was cut short) once this "
        "many bytes of tensor data have been captured; None = no limit.",
        {"type": ["integer", "null"], "minimum": 1})
    logits: bool = setting(True, "Record the last position's logits of every step (level 'logits'), "
                                 "whatever the token_range; compare and bisect need them.")

    def __post_init__(self) -> None:
        # msit's DumpConfig takes None for its default in these fields (a script's
        # ``DumpConfig(dump_path=args.dump_path, token_range=args.tokens)`` with flags left out)
        defaults = (("dump_path", "."), ("token_range", [0]), ("module_list", []), ("mode", "module"))
        for name, default in defaults:
            if getattr(self, name) is None:
                setattr(self, name, default)
        if isinstance(self.module_list, str):  # module_list="auto", or one class name
            self.module_list = [self.module_list]
        self.dump_path = str(self.dump_path)
        self.token_range = _check_token_range(self.token_range)
        if not isinstance(self.module_list, (list, tuple)):
            raise UserError(f"DumpConfig.module_list: expected a list of module classes or class "
                            f"names, got {type(self.module_list).__name__}")
        for m in self.module_list:
            if not (isinstance(m, str) or (isinstance(m, type) and _is_module_class(m))):
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
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dump_path"}
        out["module_list"] = sorted(self._type_names)
        return out

    # -- the dump stage's view of the same fields --------------------------------------------------
    @classmethod
    def stage_properties(cls) -> dict[str, dict[str, Any]]:
        """JSON-schema properties of the fields the ``dump`` stage takes as parameters, with this
        class's defaults and descriptions."""
        out = {}
        for f in fields(cls):
            stage = f.metadata.get("stage")
            if stage is not None:
                default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
                out[f.name] = {**stage, "default": default, "description": f.metadata["description"]}
        return out

    @classmethod
    def from_params(cls, params: dict[str, Any], dump_path: str) -> DumpConfig:
        """The config the ``dump`` stage's (validated) parameters describe; a setting not given
        keeps this class's default."""
        given = {name: params[name] for name in cls.stage_properties() if name in params}
        return cls(dump_path=dump_path, **given)

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Field name -> what it means."""
        return {f.name: f.metadata["description"] for f in fields(cls)}


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


def _is_module_class(cls: type) -> bool:
    """A torch.nn.Module subclass. torch is imported here, not at the top: a class object given
    means torch is loaded already, and ``llmflow validate``/``plan`` read DumpConfig's fields
    without paying for torch's import."""
    import torch

    return issubclass(cls, torch.nn.Module)
