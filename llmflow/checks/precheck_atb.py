"""An ATB operation rebuilt for the precheck from an ATB tensor dump and its model json.

msit's ATB dump (``msit llm dump --type model tensor``, read by ``formats.atb``) holds each
operation's ``before/intensorN.bin`` and ``after/outtensorN.bin``, nested as the graph runs, and
``model/<pid>/<Model>.json`` whose nodes give each operation's ``opType`` and ``param``::

    {"opName": "RmsNormOperation_0", "opType": "RmsNormOperation",
     "param": {"layerType": 1, "normParam": {"epsilon": 1e-05}}, "inTensors": [...], ...}

Every leaf operation (a node without ``nodes``: a kernel; a graph operation such as
``DecoderLayer`` is checked through its leaves) becomes one call: the intensors in order as its
arguments, the node's ``param`` (an object, or that object as a JSON string) as ``param=``, the
outtensors as its outputs. Its API is the ``opType``; it is replayed by the reference registered
under that name (``references.ATB_BUILTIN``: LinearOperation, RmsNormOperation, ElewiseOperation,
ActivationOperation, SoftmaxOperation, RopeOperation; a user's through ``--reference``), and an
operation with none is listed as not checked: "no reference for ATB op X". Without a model json
the dump names no parameters, and no operation is checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from llmflow.checks.op_call import OpCall, load_outputs
from llmflow.checks.references import ATB
from llmflow.formats.atb import AtbDumpReader
from llmflow.formats.base import Entry

_NO_MODEL = ("no operation parameters in the dump (the model json of msit llm dump --type model "
             "names each operation's opType and param)")


def atb_calls(reader: AtbDumpReader) -> Iterator[OpCall]:
    """The dump's leaf operations in execution order (rank, step, order), one at a time."""
    groups: dict[tuple[int, int, str], list[Entry]] = {}
    for e in reader.entries():
        groups.setdefault((e.rank, e.step, e.name), []).append(e)
    parents = {name.rsplit(".", 1)[0] for (_, _, name) in groups if "." in name}
    models = _model_trees(reader)
    for (_rank, _step, name), entries in groups.items():
        if name in parents:  # a graph operation: its leaves are its calls
            continue
        node = _node(models.get(str(entries[0].extra.get("model", ""))), name)
        if node is not None and node.get("children"):
            continue
        yield _call(reader, entries, node, has_models=bool(models))


def _model_trees(reader: AtbDumpReader) -> dict[str, dict[str, Any]]:
    """Model name -> its tree of nodes (``formats.atb``'s topology: name, type, param, children)."""
    topology = reader.topology() or {}
    return {str(tree.get("type")): tree for tree in topology.get("models", [])}


def _node(tree: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The model json's node of the operation ``name`` (``1_DecoderLayer.0_RmsNorm``), found by
    each level's number, or None."""
    node = tree
    for part in name.split("."):
        if node is None:
            return None
        number = part.split("_", 1)[0]
        node = next((c for c in node.get("children", []) if c["name"].split("_", 1)[0] == number), None)
    return node


def _call(reader: AtbDumpReader, entries: list[Entry], node: dict[str, Any] | None,
          has_models: bool) -> OpCall:
    first = min(entries, key=lambda e: e.order)
    folder_type = first.module_type or first.name.rsplit(".", 1)[-1].split("_", 1)[-1]
    op_type = str(node["type"]) if node is not None else str(folder_type)
    parent = first.name.rsplit(".", 1)[0] if "." in first.name else ""
    call = OpCall(first.name, op_type, first.rank, first.step, first.order, function=ATB, parent=parent)
    inputs = sorted((e for e in entries if e.kind == "input"), key=lambda e: int(e.index))
    outputs = sorted((e for e in entries if e.kind == "output"), key=lambda e: int(e.index))
    param = _param(node)
    if node is None:
        call.reason = _NO_MODEL if not has_models else "the model json has no node for this operation"
    elif isinstance(param, str):
        call.reason = param
    elif not inputs:
        call.reason = "inputs not captured (no before/intensor files)"
    elif not all(e.has_data for e in inputs):
        call.reason = "inputs recorded as statistics only (dump with tensor data)"
    if call.reason is not None:
        load_outputs(call, [e for e in outputs if e.has_data], reader, call.reason)
        return call
    call.args = [reader.load(e) for e in inputs]
    call.kwargs = {"param": param}
    load_outputs(call, outputs, reader, "no output tensor recorded (no after/outtensor files)")
    return call


def _param(node: dict[str, Any] | None) -> dict[str, Any] | str:
    """The node's ``param`` as an object; a string saying why not where it is not one."""
    param = {} if node is None else node.get("param")
    if param is None:
        return {}
    if isinstance(param, str):
        try:
            param = json.loads(param) if param.strip() else {}
        except json.JSONDecodeError:
            return "its param in the model json is not JSON"
    return param if isinstance(param, dict) else "its param in the model json is not an object"
