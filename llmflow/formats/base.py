"""The one view of a dump that every reader gives: a list of ``Entry`` rows and lazy tensor loads.

Every dump format (llmflow's own, msit torch, ATB ``.bin``, msprobe) has a reader module in this
package that subclasses ``DumpReader``. ``llmflow.formats.open_dump(path)`` detects the format.
The compare, overflow-scan, bisect and report code only ever see this interface.

Naming conventions shared by all readers (foreign names are translated to these):
  * module entries are named by their path in ``named_modules()`` of the model, no ``root.``
    prefix: ``model.layers.3.mlp.down_proj``;
  * API entries are ``<calling module path>/<api name>.<n>``, ``n`` counting calls of that API
    inside that module within one step: ``model.layers.3.self_attn/matmul.0``; a call from the
    root module has an empty module path: ``/embedding.0``;
  * logits are the entry ``name="logits"``, ``level="logits"``, kind ``output``: the last
    position's logits of each step, shape ``[batch, vocab]``;
  * weights have ``kind="weight"``, ``step=-1``, name = the parameter's full name
    (``model.layers.0.mlp.down_proj.weight``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

KINDS = ("input", "output", "weight")


def api_of(name: str) -> str:
    """The API an API entry's name calls: ``model.layers.0.mlp/silu.0`` -> ``silu``."""
    return name.rsplit("/", 1)[-1].rsplit(".", 1)[0]
LEVELS = ("module", "api", "logits", "weight", "save")
STAT_KEYS = ("max", "min", "mean", "norm", "nan", "inf")


@dataclass(slots=True)  # no __dict__ per entry: a dump makes ~1000 of them a decode step
class Entry:
    """One dumped value.

    index: which value of the call: ``"0"``, ``"1"`` for positional inputs and outputs, dotted for
      nested structures (``"1.0"``: first element of the second output), ``"kw:<name>"`` for
      keyword inputs (``"kw:position_embeddings.0"``), ``"0"`` for weights and logits.
    order: execution order within (rank, step); inputs of a call come before its outputs.
    stats: keys of STAT_KEYS (floats; nan/inf are counts) when known, else None.
    has_data: False for statistics-only entries and for non-tensor values.
    value / pytype: for non-tensor inputs, the JSON value when simple (None, bool, int, float,
      str) and the Python type name (``"DynamicCache"``): replay needs both.
    key: the reader's handle to load the bytes (unique within one reader).
    """

    step: int
    rank: int
    name: str
    kind: str
    index: str
    level: str
    order: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    module_type: str | None = None
    stats: dict[str, float] | None = None
    has_data: bool = True
    value: Any = None
    pytype: str | None = None
    key: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape) if self.shape is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Entry:
        known = ENTRY_FIELDS
        fields = {k: v for k, v in d.items() if k in known}
        if fields.get("shape") is not None:
            fields["shape"] = tuple(map(int, fields["shape"]))
        if len(fields) < len(d):  # keys of no field join ``extra``
            extra = fields.get("extra", {})
            if isinstance(extra, dict):  # (anything else is refused where the entry is checked)
                fields["extra"] = {**extra, **{k: v for k, v in d.items() if k not in known}}
        return cls(**fields)


ENTRY_FIELDS = frozenset(Entry.__dataclass_fields__)  # the names an index row's fields may have


class DumpReader(ABC):
    """A dump on disk, opened read-only. Cheap to construct; tensors load lazily.

    Readers never unpickle (``torch.load(weights_only=True)`` at most) and never execute
    anything from the dump. Corrupt input raises ``llmflow.errors.DumpFormatError`` naming the file.
    Readers must be picklable (they are re-opened in worker processes from ``path``).
    """

    format: ClassVar[str] = ""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    @abstractmethod
    def detect(cls, path: Path) -> bool:
        """True when ``path`` looks like a dump of this format (cheap: a few stat/open calls)."""

    @classmethod
    def dump_folder(cls, path: Path) -> Path:
        """The folder of the dump ``detect`` claims at ``path``: ``path`` itself, unless the format
        also takes the folder a dump was written under (msit's ``dump_path``), which is not the
        dump's (a folder beside the dump in it is the user's)."""
        return Path(path)

    @abstractmethod
    def entries(self) -> list[Entry]:
        """Every entry, sorted by (rank, step, order)."""

    @abstractmethod
    def load(self, entry: Entry) -> torch.Tensor:
        """The tensor of one entry, on CPU, in its original dtype (bf16 stays bf16)."""

    def topology(self) -> dict[str, Any] | None:
        """The module tree ``{"name", "type", "children": [...], "params": {name: shape}}``."""
        return None

    def env(self) -> dict[str, Any] | None:
        """The recorded environment (versions, env vars, model config, seed settings)."""
        return None

    def problems(self) -> list[str]:
        """Why this dump cannot be trusted as whole, one line each (empty when it can): a writer
        that never closed, index rows whose data file is missing or unreadable, a torn index.
        A compare or bisect on a dump with problems never reports PASSED."""
        return []

    def native_names(self, query: str) -> set[str]:
        """The entry names a name of the dump's own tool stands for (msprobe's record names,
        ``Functional.linear.13.forward``), so a user can ask ``inspect`` for a tensor as that tool
        named it; empty where the format names entries as llmflow does."""
        return set()

    def steps(self) -> list[int]:
        return sorted({e.step for e in self.entries() if e.step >= 0})

    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.entries()})
