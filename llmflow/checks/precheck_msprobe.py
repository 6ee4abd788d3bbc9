"""An msprobe API call (levels L1 and mix, task tensor) rebuilt for the precheck from its dump.json record.

msprobe writes each API call's arguments as it received them: ``input_args`` (a list, ``null``
for ``None``), ``input_kwargs`` and ``output``, each value either a tensor (``"type":
"torch.Tensor"`` with a ``data_name`` file in ``dump_tensor_data``) or a described value::

    {"type": "int", "value": 2}            int, float, bool, str, numpy scalars (float32, int64 ...)
    {"type": "slice", "value": [0, 4, null]}    {"type": "ellipsis", "value": "..."}
    {"type": "torch.Size", "value": [1, 4]}     {"type": "torch.dtype", "value": "torch.float32"}
    {"type": "torch.device", "value": "cpu"}    {}  (an object msprobe could not describe)

The arguments are rebuilt from that structure (nested lists as tuples, as the calls had them);
each tensor's bytes come through the reader's ``load`` (``torch.load(weights_only=True)``), found
by the index the reader gave the value. The record name tells which torch callable ran:
``Functional.silu`` is ``torch.nn.functional.silu``, ``Torch.matmul`` is ``torch.matmul``,
``Tensor.__rsub__`` the ``Tensor`` method itself (``2 - x`` is ``x.__rsub__(2)``, not
``torch.sub(x, 2)``). Other groups (``NPU``, ``Aten``, ``Distributed``) resolve by API name:
the references registry, then torch.
"""

from __future__ import annotations

from typing import Any

from llmflow.checks.op_call import OpCall, load_outputs
from llmflow.dump.arguments import Unrebuildable, decode_value
from llmflow.formats.base import Entry, api_of
from llmflow.formats.msprobe import MsprobeDumpReader

#: msprobe's API group -> the owner of the callable, as ``references.lookup`` spells it
GROUP_OWNERS = {"Functional": "torch.nn.functional", "Torch": "torch", "Tensor": "Tensor"}
_SCALARS = ("int", "float", "bool", "str", "NoneType")


def msprobe_call(reader: MsprobeDumpReader, entries: list[Entry]) -> OpCall:
    """One API call of an msprobe dump (``entries``: its input and output entries)."""
    first = entries[0]
    call = OpCall(first.name, api_of(first.name), first.rank, first.step, first.order)
    found = reader.api_call(first)
    if found is None:  # (the reader names every API entry's call; a caller passing others is wrong)
        call.reason = "no dump.json record for this call"
        return call
    call.record = found.record_name
    if found.group in GROUP_OWNERS:
        call.function = f"{GROUP_OWNERS[found.group]}.{found.api}"
    inputs = {e.index: e for e in entries if e.kind == "input"}
    outputs = [e for e in entries if e.kind == "output"]
    record = found.record
    if "input_args" not in record and "input_kwargs" not in record:
        call.reason = "inputs not captured (dumped with data_mode output?)"
    elif not outputs:
        call.reason = "output not captured (dumped with data_mode input?)"
    if call.reason is not None:
        return call
    try:
        args = record.get("input_args") or []
        call.args = [_value(v, str(i), inputs, reader) for i, v in enumerate(args)]
        kwargs = record.get("input_kwargs") or {}
        call.kwargs = {str(k): _value(v, f"kw:{k}", inputs, reader) for k, v in kwargs.items()}
    except Unrebuildable as exc:
        call.reason = str(exc)
        return call
    load_outputs(call, outputs, reader, "no output tensor recorded (dump with task tensor)")
    return call


def _value(node: Any, index: str, inputs: dict[str, Entry], reader: MsprobeDumpReader) -> Any:
    """One argument from its dump.json value; ``index`` as the reader labels it (``"0"``,
    ``"1.0"``, ``"kw:dim"``). ``Unrebuildable`` says why an argument cannot be rebuilt."""
    if node is None:
        return None
    if isinstance(node, list):
        return tuple(_value(v, f"{index}.{i}", inputs, reader) for i, v in enumerate(node))
    if not isinstance(node, dict) or not node:
        raise Unrebuildable(f"input {index} is a value msprobe could not describe")
    kind = node.get("type")
    if not isinstance(kind, str):  # a dict of values (a ModelOutput, a dict argument)
        return {str(k): _value(v, f"{index}.{k}", inputs, reader) for k, v in node.items()}
    if "dtype" in node and "shape" in node:  # a tensor (torch.Tensor, a Parameter's type name)
        entry = inputs.get(index)
        if entry is None or not entry.has_data:
            raise Unrebuildable(f"input {index} recorded as statistics only (dump with task tensor)")
        return reader.load(entry)
    value = node.get("value")
    if kind in _SCALARS or (kind.startswith(("float", "int", "uint", "bool")) and "." not in kind):
        return value  # (numpy scalars are written as their Python value)
    if kind == "slice" and isinstance(value, list) and len(value) == 3:
        return slice(*value)
    if kind == "ellipsis":
        return Ellipsis
    if kind == "torch.Size" and isinstance(value, list):
        return tuple(int(v) for v in value)
    if kind in ("torch.dtype", "torch.device"):
        try:
            return decode_value(value, kind.removeprefix("torch."))
        except Unrebuildable as exc:
            raise Unrebuildable(f"input {index} is {exc}, which the dump does not name") from None
    raise Unrebuildable(f"input {index} is a {kind} value, which a dump cannot hold")
