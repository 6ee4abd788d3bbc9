"""Isolation from the target's dump: the GOLDEN module run on the TARGET's recorded inputs.

The other direction (``replay.py``) reloads the target model and runs each target module on the
golden inputs. A target that cannot be reloaded in the bisect's process (N ranks under torchrun,
an NPU/ATB graph) still leaves, in its module-mode dump, each module's inputs and output. Running
the golden module on those same inputs and comparing with the target's recorded output measures
what the target module adds itself: both sides start from one input, so only the module's own
computation differs.

A tensor-parallel dump holds one folder per rank, each with rank-local tensors. How a module's
shards relate to the golden's tensors comes from their shapes (``compare/shards.merge_of``: the
golden's input shapes from the golden dump, its output shape from the golden module's run):

* inputs whole on every rank (column-parallel linears, norms, containers whose output is
  all-reduced): the golden module runs on each rank's own input; its output, or the rank's slice of
  it (``concat:D``), against that rank's output is the rank's own error. The module's error is the
  joined one (slices) or the worst rank's (replicated copies).
* inputs sliced over the ranks (a row-parallel linear, an activation on a column-parallel
  output): the golden module runs once on the concatenated inputs. A sliced output still gives
  each rank's slice an error of its own; a reduced output is the module's alone (no rank named),
  and where the ranks' outputs of the golden's shape differ they are partial products whose sum
  the all-reduce after the module makes (an all-reduced tensor is the same on every rank).

A mapping file (the compare's, ``BisectInputs.mapping``) overrides the shapes: its ``shards``
rule matching a module's target name gives that module's output merge (``sum`` is a sum even where
the ranks' outputs happen to be equal), and a target module the golden model does not have (a port
that renamed its modules) is replayed as the golden module its name rules give
(``Mapping.module_names``). Rows, candidates and the raw errors carry the golden's names.

A rank is named only when its own error stands out from the other ranks' (``shards.standout``).

A decode step's attention also reads the target's KV cache, whose contents no dump holds. A
dump with the module's inputs at every step 0..t (token_range all) holds what wrote that cache:
the golden module is run on those inputs step after step with a ``DynamicCache`` of its own (or
the model family's own subclass of it; one per rank), and its output at step t against the
recorded one is the module's own error at t. The target's cache was written by the target's own
keys and values from the same inputs, so only the module's computation differs: a decode-kernel
fault stands out at decode steps only. Such a row says so (``source``: "target dump, steps
0..t"). Where an earlier step's inputs are missing, the cache kind is not one
``calls.cache_class`` can make empty, or the inputs are sliced over the ranks, the
attention stays not replayable, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from copy import deepcopy as copy_module
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmflow.compare.mappings import CONCAT, REPLICATED, SUM, Mapping, ShardRule
from llmflow.compare.shards import (
    join_tensors,
    merge_of,
    rule_merge,
    shard_errors,
    share_errors,
    standout,
    unreduced,
)
from llmflow.dtypes import OP_ERROR_FLOOR, dtype_name
from llmflow.dump.arguments import is_cache_type
from llmflow.dump.memory import Call, flatten_outputs
from llmflow.formats.base import DumpReader, Entry
from llmflow.localize.calls import (
    NO_INPUTS,
    build_call,
    cache_class,
    cast_inputs,
    entry_value,
    first_call,
    fresh_cache,
)
from llmflow.localize.moe import add_expert_error, block_routing_forced, rounding_flips, router_of
from llmflow.localize.own_error import own_error
from llmflow.localize.rounding import cast_copy
from llmflow.streamed import layer_weights_held
from llmflow.structure import layer_of_name

#: why an attention cannot be replayed from the target's dump at a decode step
CACHE_NOT_DUMPED = ("its input {index} is the target's KV cache ({pytype}), whose contents no dump holds: "
                    "not replayable from the target dump at a decode step")
#: why an attention's cache cannot be refilled: an earlier step's inputs are not in the dump
STEP_MISSING = ("its input {index} is the target's KV cache ({pytype}); refilling it needs the module's "
                "inputs at every step 0..{step}, and the target dump holds {what} at step {missing}{where}: "
                "not replayable from the target dump at a decode step (dump with token_range all and "
                "data_mode tensor)")
#: why an attention's cache cannot be refilled: a cache kind a private copy cannot stand for
CACHE_KIND = ("its input {index} is the target's KV cache ({pytype}), whose contents no dump holds, and only "
              "a DynamicCache (or the model family's own subclass of it) is refilled from the recorded "
              "inputs: not replayable from the target dump at a decode step")
#: why an attention's cache cannot be refilled: its inputs are sliced over the ranks
CACHE_SLICED = ("its input {index} is the target's KV cache ({pytype}) and its inputs are sliced over the "
                "ranks: not replayable from the target dump at a decode step")
#: why a row-parallel module's error names no rank
NO_RANK_REDUCED = ("its inputs are sliced over the ranks and its output reduced (row-parallel): the "
                   "error is the module's, no rank's own; a dump of its output before the all-reduce (each "
                   "rank's partial product), or of its weights (dump_weight), names the rank")
#: why a module whose ranks hold partial products of whole inputs names no rank
NO_RANK_WHOLE_INPUTS = ("its output is the ranks' partial products of inputs whole on every rank: how the "
                        "module splits its work over the ranks is inside it, so no rank's share is known")
#: why the output of a module whose ranks all give the same one names no rank
NO_RANK_SAME_OUTPUT = ("every rank gives the same output (reduced inside the module, or computed whole on "
                       "each), so its error is no one rank's")
#: why partial products of a module not linear in its sliced inputs name no rank
NOT_ADDITIVE = ("its output is the ranks' partial products, and the golden module is not linear in its "
                "sliced inputs: no rank's share of its output can be computed")
#: why partial products that all stray from their shares name no rank
NO_RANK_SHARES = ("its output is the ranks' partial products, and no rank's departure from its share of the "
                  "golden output stands out from the others': the error is the module's, no rank's own")
#: a dumped weight shard this close to its golden slice (relative L2; a bf16 copy of an fp32
#: weight is within 4e-3) is the golden's own weight
WEIGHT_SHARD_MATCH = 1e-2
#: how far the golden shares' sum may be from its output, relative (its dtype's rounding allowed for)
ADDITIVE_TOLERANCE = 1e-4


def module_entries(reader: DumpReader, step: int) -> dict[str, dict[int, list[Entry]]]:
    """Module name -> rank -> its entries at ``step``, names in rank 0's execution order."""
    found: dict[str, dict[int, list[Entry]]] = {}
    for e in reader.entries():
        if e.step == step and e.level == "module":
            found.setdefault(e.name, {}).setdefault(e.rank, []).append(e)
    return found


def _earlier_entries(reader: DumpReader, step: int) -> dict[str, dict[int, dict[int, list[Entry]]]]:
    """Module name -> rank -> step -> its entries at the steps before ``step``, for the modules that
    read a KV cache (one read of the index for all of them)."""
    readers = {e.name for e in reader.entries() if e.level == "module" and e.step == step
               and e.kind == "input" and not e.is_tensor and is_cache_type(e.pytype)}
    found: dict[str, dict[int, dict[int, list[Entry]]]] = {}
    for e in reader.entries():
        if e.step < step and e.level == "module" and e.name in readers:
            found.setdefault(e.name, {}).setdefault(e.rank, {}).setdefault(e.step, []).append(e)
    return found


def golden_names(reader: DumpReader, step: int, golden_modules: Collection[str],
                 mapping: Mapping | None = None,
                 recorded: dict[str, dict[int, list[Entry]]] | None = None) -> dict[str, str]:
    """Target module name -> the golden module it is, for the modules ``reader`` recorded at
    ``step`` (``recorded``: its ``module_entries`` there, where read already): the same name where
    the golden has it, else the name the mapping's rules give (one the golden has). Modules neither
    names are left out."""
    recorded = module_entries(reader, step) if recorded is None else recorded
    found = {name: name for name in recorded if name in golden_modules}
    if mapping is not None:
        rest = [(name, by_rank[min(by_rank)][0].module_type) for name, by_rank in recorded.items()
                if name not in found]
        found.update({t: g for t, g in mapping.module_names(rest).items() if g in golden_modules})
    return found


def golden_input_shapes(reader: DumpReader, step: int) -> dict[tuple[str, str], list[int]]:
    """(module, input index) -> the golden's shape at ``step`` (what joined shards must make), of
    the module's first call there, the one replayed (``first_call``: Llama 4's qk_norm is called on
    the queries, then on the keys, of other shapes)."""
    inputs = [e for e in reader.entries() if e.step == step and e.level == "module" and e.kind == "input"
              and e.rank == 0 and e.is_tensor and e.shape is not None]
    shapes: dict[tuple[str, str], list[int]] = {}
    for e in sorted(inputs, key=lambda e: e.order):
        shapes.setdefault((e.name, e.index), list(e.shape))
    return shapes


def _input_merge(name: str, index: str, shards: list[Entry], golden_shapes: dict[tuple[str, str], list[int]],
                 module: nn.Module) -> str | None:
    """How one input's shards join: by the golden dump's shape of that input; without it (a golden
    dump of the decoder layers only), a linear's input by its ``in_features``, and other shards of
    one shape are taken as replicated copies."""
    shapes = [list(s.shape) for s in shards]
    golden = golden_shapes.get((name, index))
    if golden is None and isinstance(module, nn.Linear) and index == "0" and shapes[0]:
        golden = [*shapes[0][:-1], module.in_features]
    if golden is None:
        return REPLICATED if all(s == shapes[0] for s in shapes) else None
    return merge_of(golden, shapes)


def _input_shards(name: str, inputs: dict[int, list[Entry]], golden_shapes: dict[tuple[str, str], list[int]],
                  module: nn.Module) -> tuple[dict[str, list[Entry]], dict[str, str]] | str:
    """Each input's entries across the ranks (rank order) by index, the same call structure on
    every rank, and how each tensor input's shards join into the golden's (``_input_merge``); why
    they do not, as a string."""
    ranks = sorted(inputs)
    shards: dict[str, list[Entry]] = {}
    for i in [e.index for e in inputs[ranks[0]]]:
        found = [next((e for e in inputs[r] if e.index == i), None) for r in ranks]
        if any(e is None for e in found):
            return f"input {i} is not recorded on every rank"
        shards[i] = found  # type: ignore[assignment]
    merges: dict[str, str] = {}
    for i, entries in shards.items():
        if entries[0].is_tensor:
            merge = _input_merge(name, i, entries, golden_shapes, module)
            if merge is None:
                shapes = [e.shape for e in entries]
                return f"input {i}: the ranks' shapes {shapes} do not join into the golden's"
            merges[i] = merge
    return shards, merges


def _not_replayable(name: str, module_type: str | None, reason: str) -> dict[str, Any]:
    return {"name": name, "module_type": module_type, "replayable": False, "reason": reason}


def _call(name: str, module_type: str | None, inputs: list[tuple[str, Any]], outputs: dict[str, torch.Tensor],
          step: int) -> Call:
    """A Call of the target's recorded inputs; a KV cache at a decode step is not replayable here."""
    call = build_call(name, inputs, [], step=step, module_type=module_type)
    call.outputs = outputs
    for index, value in inputs:
        as_value = isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], torch.Tensor)
        if step > 0 and as_value and is_cache_type(value[1]):
            call.reason = CACHE_NOT_DUMPED.format(index=index, pytype=value[1])
    if call.reason == "no output tensor recorded":
        call.reason = None
    return call


def _decode_cache(inputs: list[Entry]) -> tuple[str, str] | None:
    """(index, pytype) of the KV cache among a call's recorded inputs, None where it has none."""
    return next(((e.index, e.pytype) for e in inputs if not e.is_tensor and is_cache_type(e.pytype)), None)


def _earlier_inputs(name: str, ranks: list[int], target: DumpReader, step: int,
                    earlier: dict[int, dict[int, list[Entry]]] | None
                    ) -> tuple[dict[int, list[list[Entry]]], tuple[int, int, str] | None]:
    """Each rank's recorded inputs of module ``name`` at steps 0..``step``-1 (its first call per
    step), from ``earlier`` (rank -> step -> entries) or the dump; the first (step, rank, what the
    dump holds there) without replayable inputs, None where every step has them."""
    if earlier is None:
        earlier = {}
        for e in target.entries():
            if e.name == name and e.level == "module" and e.step < step:
                earlier.setdefault(e.rank, {}).setdefault(e.step, []).append(e)
    found: dict[int, list[list[Entry]]] = {}
    for s in range(step):
        for r in ranks:
            ins = first_call(earlier.get(r, {}).get(s, []))[0]
            if not ins:
                return found, (s, r, "no inputs")
            if any(e.is_tensor and not e.has_data for e in ins):
                return found, (s, r, "statistics only")
            found.setdefault(r, []).append(ins)
    return found, None


def _golden_over_steps(name: str, module: nn.Module, module_type: str | None,
                       steps: list[list[tuple[str, Any]]], golden: Any, index: str) -> torch.Tensor | str:
    """The golden module run on one rank's recorded inputs of steps 0..t in order, with a
    ``DynamicCache`` of its own that its calls fill (so at step t it holds the keys and values the
    golden module makes from the target's inputs): its output ``index`` at step t, or why not."""
    kind = next((v[1] for _i, v in steps[-1] if isinstance(v, tuple) and len(v) == 2
                 and not isinstance(v[0], torch.Tensor) and is_cache_type(v[1])), "DynamicCache")
    cache = fresh_cache(golden.model, kind)
    out: torch.Tensor | None = None
    with layer_weights_held(golden.model, layer_of_name(name) or name):  # a streamed layer read once
        for s, inputs in enumerate(steps):
            call = build_call(name, inputs, [], step=s, module_type=module_type, cache=cache)
            if call.reason not in (None, "no output tensor recorded"):
                return f"step {s}: {call.reason}"
            out = _run_golden(module, call, golden).get(index)
    return out if out is not None else f"the golden module gave no output {index}"


def _run_golden(module: nn.Module, call: Call, golden: Any) -> dict[str, torch.Tensor]:
    """The golden module's outputs on the call's inputs (cast to the golden's device and dtype)."""
    with torch.no_grad():
        out = module(*cast_inputs(call.args, golden.device, golden.dtype, module),
                     **cast_inputs(call.kwargs, golden.device, golden.dtype, module))
    return flatten_outputs(out)


def replay_module(name: str, module: nn.Module, by_rank: dict[int, list[Entry]], target: DumpReader,
                  golden: Any, step: int, golden_shapes: dict[tuple[str, str], list[int]],
                  all_ranks: list[int] | None = None,
                  earlier: dict[int, dict[int, list[Entry]]] | None = None, *,
                  rules: Sequence[ShardRule] = (), target_name: str | None = None,
                  weights: dict[int, dict[str, Entry]] | None = None) -> dict[str, Any]:
    """One module's own error from the target dump (see the module docstring): a row as
    ``replay.replay_call`` gives, plus ``sharding`` (how its shards joined), ``rank_errors``
    (each rank's own rel_l2, rank order; empty where no rank has one) and ``shard_rank`` (the rank
    whose own error stands out, else None). A module reading a KV cache at a decode step is run
    over steps 0..``step`` (``earlier``: rank -> step -> its entries before ``step``; None: read
    from the dump) and its row has ``source``. ``name`` is the golden module's name,
    ``target_name`` the target's (default: the same), which the mapping's shards ``rules`` match.
    ``weights``: rank -> the module's dumped parameters by name, which name a rank where the
    output cannot (``_rank_by_weights``)."""
    ranks = sorted(by_rank)
    ruled = rule_merge(target_name or name, rules)  # the output merge a shards rule imposes
    module_type = by_rank[ranks[0]][0].module_type
    lacking = sorted(set(all_ranks or ranks) - set(ranks))
    if lacking:  # a shard or copy missing: what the others hold is not the whole tensor
        return _not_replayable(name, module_type, f"not recorded on rank(s) {', '.join(map(str, lacking))}")
    calls = {r: first_call(by_rank[r]) for r in ranks}
    if any(not ins for ins, _outs in calls.values()):
        return _not_replayable(name, module_type, NO_INPUTS)
    outs_by_rank = {r: {e.index: e for e in outs if e.is_tensor and e.has_data}
                    for r, (_i, outs) in calls.items()}
    index = "0" if "0" in outs_by_rank[ranks[0]] else min(outs_by_rank[ranks[0]], default=None)
    if index is None or any(index not in o for o in outs_by_rank.values()):
        return _not_replayable(name, module_type, "no output tensor recorded on every rank")
    if any(e.is_tensor and not e.has_data for ins, _o in calls.values() for e in ins):
        return _not_replayable(name, module_type,
                               "inputs dumped as statistics only (dump with data_mode tensor)")
    gathered = _input_shards(name, {r: ins for r, (ins, _o) in calls.items()}, golden_shapes, module)
    if isinstance(gathered, str):
        return _not_replayable(name, module_type, gathered)
    shards, merges = gathered
    sliced = sorted({m for m in merges.values() if m.startswith(CONCAT)})
    cache = _decode_cache(calls[ranks[0]][0]) if step > 0 else None
    history: dict[int, list[list[Entry]]] | None = None
    if cache is not None:  # the module reads the target's KV cache: refill a private one, or say why not
        cache_index, pytype = cache
        if cache_class(golden.model, pytype) is None:
            return _not_replayable(name, module_type, CACHE_KIND.format(index=cache_index, pytype=pytype))
        if sliced:
            return _not_replayable(name, module_type, CACHE_SLICED.format(index=cache_index, pytype=pytype))
        history, missing = _earlier_inputs(target_name or name, ranks, target, step, earlier)
        if missing is not None:
            missing_step, missing_rank, held = missing
            where = f" on rank {missing_rank}" if len(ranks) > 1 else ""
            return _not_replayable(name, module_type, STEP_MISSING.format(
                index=cache_index, pytype=pytype, step=step, missing=missing_step, what=held, where=where))
    target_outs = [target.load(outs_by_rank[r][index]) for r in ranks]
    try:
        if not sliced and ruled != SUM:  # a sum of partial outputs needs the golden's one whole output
            row = _per_rank(name, module, shards, ranks, target, golden, step, index, target_outs,
                            module_type, history, rules, target_name or name)
            if history is not None and row["replayable"]:
                row["source"] = f"target dump, steps 0..{step}"
            if (row["replayable"] and len(ranks) > 1 and row["shard_rank"] is None and "unreduced" not in row
                    and all(torch.equal(target_outs[0], t) for t in target_outs[1:])):
                # one output on every rank (reduced inside the module, as an expert-parallel experts
                # module all-reduces its ranks' experts): its weight shards may still name the rank
                row["rank_note"] = NO_RANK_SAME_OUTPUT
                if weights:
                    _rank_by_weights(row, name, module, golden, weights, ranks, target)
            return row
        loaded = {i: [target.load(e) for e in entries] for i, entries in shards.items() if i in merges}
        joined = [(i, join_tensors(merges[i], loaded[i]) if i in merges else entry_value(target, entries[0]))
                  for i, entries in shards.items()]
        call = _call(name, module_type, joined, {}, step)
        if call.reason:
            return _not_replayable(name, module_type, call.reason)
        golden_out = _run_golden(module, call, golden).get(index)
    except Exception as exc:  # a module that refuses the target's inputs is reported, not fatal
        return _not_replayable(name, module_type, f"replay failed: {type(exc).__name__}: {str(exc)[:160]}")
    if golden_out is None:
        return _not_replayable(name, module_type, f"the golden module gave no output {index}")
    merge = merge_of(list(golden_out.shape), [list(t.shape) for t in target_outs], target_name or name, rules)
    if merge is None:
        return _not_replayable(name, module_type, f"output {index}: the ranks' shapes do not join into the "
                                                   f"golden's {list(golden_out.shape)}")
    by_rule = ruled is not None and merge.partition(":")[0] == ruled.partition(":")[0]  # the shapes allow it
    copies_differ = any(not torch.equal(target_outs[0], t) for t in target_outs[1:])
    if merge == REPLICATED and copies_differ and not by_rule:
        merge = SUM  # an all-reduced output is the same on every rank: these are partial products
    sharding = f"inputs {', '.join(sliced) or 'whole'}, output {merge}"
    sharding += " (shards rule)" if by_rule else ""
    if merge == REPLICATED and copies_differ:  # copies by the rule: each against the golden, the worst kept
        errors = shard_errors(golden_out, merge, target_outs)
        worst = max(range(len(ranks)), key=lambda k: errors[k])
        row = {"name": name, "module_type": module_type, "replayable": True, "output": index,
               **own_error(golden_out, target_outs[worst])}
        add_expert_error(row, module, call, golden_out, target_outs[worst])
        return _with_ranks(row, sharding, errors, ranks)
    joined_out = join_tensors(merge, target_outs)
    row: dict[str, Any] = {"name": name, "module_type": module_type, "replayable": True, "output": index,
                           **own_error(golden_out, joined_out)}
    add_expert_error(row, module, call, golden_out, joined_out)
    if merge.startswith(CONCAT):  # each rank's slice of the output depends on its own slice of the input
        return _with_ranks(row, sharding, shard_errors(golden_out, merge, target_outs), ranks)
    if merge == SUM and sliced and len(ranks) > 1:  # partial products: each rank's share of the golden's
        shares = _golden_shares(name, module, golden, joined, loaded, merges, index, golden_out, step,
                                module_type)
        if isinstance(shares, str):
            row.update(sharding=sharding, rank_errors=[], shard_rank=None, rank_note=shares)
            return row
        relative, absolute = share_errors(shares, target_outs)
        row = _with_ranks(row, sharding, relative, ranks)
        by_size = standout(absolute, ranks)
        rounding = OP_ERROR_FLOOR.get(dtype_name(golden_out.dtype), 0.0)  # under it, nothing to name
        if row["shard_rank"] is not None and (by_size is None or by_size[0] != row["shard_rank"]
                                              or relative[ranks.index(row["shard_rank"])] < rounding):
            row.update(shard_rank=None, rank_note=None if max(relative) < rounding else NO_RANK_SHARES)
        return row
    note = (NO_RANK_REDUCED if sliced else NO_RANK_WHOLE_INPUTS) if len(ranks) > 1 else None
    row.update(sharding=sharding, rank_errors=[], shard_rank=None, rank_note=note)
    if note is not None and weights:  # the ranks' outputs are one sum: their weight shards may still tell
        _rank_by_weights(row, name, module, golden, weights, ranks, target)
    return row


def _rank_by_weights(row: dict[str, Any], name: str, module: nn.Module, golden: Any,
                     weights: dict[int, dict[str, Entry]], ranks: list[int], target: DumpReader) -> None:
    """Where a module's output names no rank, the rank whose dumped weight shard differs from its
    slice of the golden module's weight (msprobe dumps each module's parameters; llmflow's with
    ``dump_weight``): ``rank_errors`` (each rank's worst parameter), ``shard_rank`` and a
    ``rank_source``; where every shard matches, the note says the fault is not in the weights."""
    experts = getattr(module, "num_experts", None)  # a fused experts module: one row block per expert
    with layer_weights_held(golden.model, layer_of_name(name) or name):
        params = dict(module.named_parameters(recurse=False))
        errors = [0.0] * len(ranks)
        by_expert = [0.0] * experts if isinstance(experts, int) and experts > 1 else []
        compared = []
        for pname, param in params.items():
            entries = [weights.get(r, {}).get(pname) for r in ranks]
            if any(e is None or not e.has_data for e in entries):
                continue
            merge = merge_of(list(param.shape), [list(e.shape) for e in entries])  # type: ignore[union-attr]
            if merge is None or merge == SUM:
                continue
            shards = [target.load(e).to(torch.float64) for e in entries]  # type: ignore[arg-type]
            golden_param = param.detach().cpu()
            for k, e in enumerate(shard_errors(golden_param, merge, shards)):
                errors[k] = max(errors[k], e)
            if by_expert and param.dim() == 3 and param.shape[0] == len(by_expert) and merge == f"{CONCAT}:0":
                # the experts split over the ranks (expert parallelism): each expert's rows on their own
                for k, e in enumerate(shard_errors(golden_param, merge, list(torch.cat(shards).split(1)))):
                    by_expert[k] = max(by_expert[k], e)
            compared.append(pname)
    if not compared:
        return
    rounding = OP_ERROR_FLOOR.get(dtype_name(next(iter(params.values())).dtype), 0.0)
    named = standout(errors, ranks)
    if named is not None and named[1] >= rounding:
        row.update(rank_errors=errors, shard_rank=named[0], rank_note=None,
                   rank_source=f"its weight shards ({', '.join(compared)}) in the target dump")
        expert = standout(by_expert, list(range(len(by_expert))))
        if expert is not None and expert[1] >= rounding:
            row["weight_expert"] = expert[0]
    elif max(errors) < WEIGHT_SHARD_MATCH:
        row["rank_note"] += (f"; its weight shards ({', '.join(compared)}) match the golden's on every rank: "
                             "the fault is in its computation or its all-reduce, not a shard")


def _golden_shares(name: str, module: nn.Module, golden: Any, joined: list[tuple[str, Any]],
                   loaded: dict[str, list[torch.Tensor]], merges: dict[str, str], index: str,
                   golden_out: torch.Tensor, step: int, module_type: str | None
                   ) -> tuple[list[torch.Tensor], torch.Tensor] | str:
    """Each rank's share of the golden module's output where the target's ranks left partial
    products: the golden module run on the joined inputs with every other rank's slice zeroed,
    less its output on all-zero slices (a bias: the response to nothing), and that response. A
    module linear in its sliced inputs (a row-parallel linear) has shares that sum back to its
    output; one that is not (a norm, an activation) has no shares: why, as a string."""
    with layer_weights_held(golden.model, layer_of_name(name) or name):  # a streamed layer read once
        linear = _linear_shares(module, golden, joined, loaded, merges)
        return linear if linear is not None else _zeroed_shares(name, module, golden, joined, loaded, merges,
                                                                index, golden_out, step, module_type)


def _linear_shares(module: nn.Module, golden: Any, joined: list[tuple[str, Any]],
                   loaded: dict[str, list[torch.Tensor]], merges: dict[str, str]
                   ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """A plain ``nn.Linear`` whose one input is sliced on its features: each rank's share is its
    slice times those columns of the weight, one matmul in all where zeroed inputs would cost one
    per rank (a 70B down_proj on 8 ranks: 9x the replay's own work). None for any other module."""
    slices = loaded.get("0")
    if type(module) is not nn.Linear or len(joined) != 1 or slices is None \
            or merges.get("0") != f"{CONCAT}:{slices[0].dim() - 1}":
        return None
    weight, shares, start = module.weight, [], 0
    for x in slices:
        width = x.shape[-1]
        x = x.to(weight.device, golden.dtype if x.is_floating_point() else x.dtype)
        with torch.no_grad():
            shares.append(F.linear(x, weight[:, start:start + width]).double().cpu())
        start += width
    bias = module.bias.detach().double().cpu() if module.bias is not None else torch.zeros(())
    return shares, bias.expand_as(shares[0])


def _zeroed_shares(name: str, module: nn.Module, golden: Any, joined: list[tuple[str, Any]],
                   loaded: dict[str, list[torch.Tensor]], merges: dict[str, str], index: str,
                   golden_out: torch.Tensor, step: int, module_type: str | None
                   ) -> tuple[list[torch.Tensor], torch.Tensor] | str:
    """The shares of any module, by zeroing: see ``_golden_shares``."""
    world = len(next(iter(loaded.values())))

    def run(keep: int | None) -> torch.Tensor | None:
        inputs = [(i, join_tensors(merges[i], [t if r == keep else torch.zeros_like(t)
                                                for r, t in enumerate(loaded[i])]))
                  if i in loaded and merges[i].startswith(CONCAT) else (i, v) for i, v in joined]
        return _run_golden(module, _call(name, module_type, inputs, {}, step), golden).get(index)

    try:
        response = run(None)
        shares = [run(k) for k in range(world)]
    except Exception as exc:  # a module that refuses zeroed inputs leaves its rank unnamed, the row stands
        return (f"its output is the ranks' partial products; the golden module refused a rank's slice "
                f"alone ({type(exc).__name__}: {str(exc)[:160]})")
    if response is None or any(s is None for s in shares):
        return NOT_ADDITIVE
    shares = [s.double().cpu() - response.double().cpu() for s in shares]  # type: ignore[union-attr]
    total = torch.stack(shares).sum(0) + response.double().cpu()
    ref = float(torch.linalg.vector_norm(golden_out.double().cpu()))
    slack = max(ADDITIVE_TOLERANCE, 4 * torch.finfo(golden_out.dtype).eps)
    if float(torch.linalg.vector_norm(total - golden_out.double().cpu())) > slack * ref:
        return NOT_ADDITIVE
    return shares, response.double().cpu()


def _per_rank(name: str, module: nn.Module, shards: dict[str, list[Entry]], ranks: list[int],
              target: DumpReader, golden: Any, step: int, index: str, target_outs: list[torch.Tensor],
              module_type: str | None, history: dict[int, list[list[Entry]]] | None = None,
              rules: Sequence[ShardRule] = (), target_name: str = "") -> dict[str, Any]:
    """Inputs whole on every rank: the golden module on each rank's own input (once where the ranks'
    inputs are equal bit for bit), each rank's output (or slice) against it. With ``history`` (rank
    -> its input entries at steps 0..``step``-1), each rank's golden module runs over those steps
    first, filling a KV cache of its own."""
    golden_outs: list[torch.Tensor] = []
    calls: list[Call | None] = []  # each rank's golden call (None: run over the steps before)
    seen: list[tuple[list[Any], torch.Tensor, Call]] = []
    same_inputs = True  # every rank's tensor inputs at this step equal to rank 0's, bit for bit
    for k, r in enumerate(ranks):
        inputs = [(i, entry_value(target, entries[k])) for i, entries in shards.items()]
        tensors = [v for _i, v in inputs if isinstance(v, torch.Tensor)]
        if k == 0:
            first = tensors
        else:
            same_inputs = same_inputs and len(tensors) == len(first) and all(
                torch.equal(a, b) for a, b in zip(first, tensors, strict=True))
        if history is not None:
            steps = [[(e.index, entry_value(target, e)) for e in ins] for ins in history[r]]
            ran = _golden_over_steps(name, module, module_type, [*steps, inputs], golden, index)
            if isinstance(ran, str):
                return _not_replayable(name, module_type, ran)
            golden_outs.append(ran)
            calls.append(None)
            continue
        again = next(((out, call) for before, out, call in seen if len(before) == len(tensors)
                      and all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))), None)
        if again is None:
            call = _call(name, module_type, inputs, {}, step)
            if call.reason:
                return _not_replayable(name, module_type, call.reason)
            out = _run_golden(module, call, golden).get(index)
            if out is None:
                return _not_replayable(name, module_type, f"the golden module gave no output {index}")
            again = (out, call)
            seen.append((tensors, *again))
        golden_outs.append(again[0])
        calls.append(again[1])
    merge = merge_of(list(golden_outs[0].shape), [list(t.shape) for t in target_outs], target_name, rules)
    if merge is None:
        return _not_replayable(name, module_type, f"output {index}: the ranks' shapes "
                               f"{[list(t.shape) for t in target_outs]} do not join into the golden's "
                               f"{list(golden_outs[0].shape)}")
    if merge.startswith(CONCAT):  # rank k's slice of the golden output computed from rank k's input
        dim = int(merge.partition(":")[2])
        sizes = [t.shape[dim] for t in target_outs]
        golden_joined = torch.cat([torch.split(g, sizes, dim=dim)[k] for k, g in enumerate(golden_outs)],
                                  dim=dim)
        row = {"name": name, "module_type": module_type, "replayable": True, "output": index,
               **own_error(golden_joined, join_tensors(merge, target_outs))}
        errors = shard_errors(golden_joined, merge, target_outs)
        return _with_ranks(row, f"inputs whole, output {merge}", errors, ranks)
    per_rank = [own_error(g, t) for g, t in zip(golden_outs, target_outs, strict=True)]
    whole = [m["rel_l2"] for m in per_rank]  # (what ``unreduced`` weighs partial products against)
    for metrics, call, g, t in zip(per_rank, calls, golden_outs, target_outs, strict=True):
        if call is not None:  # (a fused experts module: its worst expert's tokens too)
            add_expert_error(metrics, module, call, g, t)
    worst = max(range(len(ranks)), key=lambda k: per_rank[k]["rel_l2"])
    row = {"name": name, "module_type": module_type, "replayable": True, "output": index, **per_rank[worst]}
    row = _with_ranks(row, f"inputs whole, output {merge}", [m["rel_l2"] for m in per_rank], ranks)
    if len(ranks) > 1 and same_inputs and any(not torch.equal(target_outs[0], t) for t in target_outs[1:]):
        # one input on every rank, outputs of the golden's shape that differ: partial products left
        # unreduced make this module the fault, whatever the modules after it show
        summed = unreduced(golden_outs[0], target_outs, whole[worst])
        if summed is not None:
            row["unreduced"] = summed
    return row


def rounding_of(name: str, module: nn.Module, by_rank: dict[int, list[Entry]], target: DumpReader,
                golden: Any, step: int, golden_shapes: dict[tuple[str, str], list[int]], dtype: torch.dtype,
                *, target_name: str | None = None) -> dict[str, Any] | None:
    """The golden module's own rounding in ``dtype`` on the target's recorded inputs: own_error of
    the golden module cast to ``dtype`` (``rounding.py``) against the golden module, both on those
    inputs (the first rank's; inputs sliced over the ranks joined as the replay joins them; over the
    steps before where it reads a KV cache). None where the module routes tokens (its own choice in
    the lower dtype is no rounding), reads a KV cache with sliced inputs (not refilled, as in the
    replay), or the inputs cannot be rebuilt."""
    if router_of(module) is not None:
        return None
    ranks = sorted(by_rank)
    calls = {r: first_call(by_rank[r])[0] for r in ranks}
    ins, outs = first_call(by_rank[ranks[0]])
    index = "0" if any(e.index == "0" for e in outs) else min((e.index for e in outs), default=None)
    if not ins or index is None or any(e.is_tensor and not e.has_data for e in ins):
        return None
    gathered = _input_shards(name, calls, golden_shapes, module)
    if isinstance(gathered, str):
        return None
    shards, merges = gathered
    sliced = {i for i, merge in merges.items() if merge.startswith(CONCAT)}
    if sliced and (step > 0 and _decode_cache(ins) is not None
                   or any(not e.has_data for i in sliced for e in shards[i])):
        return None
    # a sliced input joined from every rank's shard (only those loaded); the rest are the first rank's
    inputs = [(i, join_tensors(merges[i], [target.load(e) for e in entries]) if i in sliced
               else entry_value(target, entries[0])) for i, entries in shards.items()]
    try:
        return _rounding_of(name, module, ins, inputs, index, target, golden, step, dtype, ranks[0],
                            target_name)
    except Exception:  # (a device too full for the copy, a module that cannot be copied): not checked
        return None


def _rounding_of(name: str, module: nn.Module, ins: list[Entry], inputs: list[tuple[str, Any]], index: str,
                 target: DumpReader, golden: Any, step: int, dtype: torch.dtype, rank: int,
                 target_name: str | None) -> dict[str, Any] | None:
    """``rounding_of`` once its inputs are known: the two runs, and their own error."""
    module_type = ins[0].module_type
    lower = SimpleNamespace(model=golden.model, device=golden.device, dtype=dtype)  # the golden, cast
    with layer_weights_held(golden.model, layer_of_name(name) or name):
        cast = cast_copy(module, golden.device, dtype)
        if step > 0 and _decode_cache(ins) is not None:
            history, missing = _earlier_inputs(target_name or name, [rank], target, step, None)
            if missing is not None:
                return None
            steps = [[(e.index, entry_value(target, e)) for e in past] for past in history[rank]]
            ran = [_golden_over_steps(name, m, module_type, [*steps, inputs], side, index)
                   for m, side in ((module, golden), (cast, lower))]
            if any(isinstance(out, str) for out in ran):
                return None
            return {"name": name, "replayable": True, **own_error(ran[0], ran[1])}
        call = _call(name, module_type, inputs, {}, step)
        if call.reason:
            return None
        exact, rounded = (_run_golden(m, call, side).get(index)
                          for m, side in ((module, golden), (cast, lower)))
    if exact is None or rounded is None:
        return None
    return {"name": name, "replayable": True, **own_error(exact, rounded)}


def _with_ranks(row: dict[str, Any], sharding: str, errors: list[float], ranks: list[int]) -> dict[str, Any]:
    """The row with each rank's own error and the rank that stands out (one rank: none to name)."""
    named = standout(errors, ranks) if len(ranks) > 1 else None
    row.update(sharding=sharding if len(ranks) > 1 else None, rank_errors=errors if len(ranks) > 1 else [],
               shard_rank=named[0] if named else None, rank_note=None)
    return row


def replay_target_dump(golden: Any, golden_dump: DumpReader, target_dump: DumpReader, *, golden_step: int,
                       target_step: int, select: Callable[[str, nn.Module], bool],
                       advance: Callable[[], None] | None = None,
                       mapping: Mapping | None = None, routing: bool = False) -> Iterator[dict[str, Any]]:
    """One row per selected module the target dump recorded at ``target_step``, in its execution
    order: the golden model's module of the same name, or of the name ``mapping`` gives it, run on
    the target's inputs (``replay_module``). Modules the golden model does not have are skipped.
    ``routing``: an MoE block whose golden router, on the target's input, routes a few tokens
    otherwise than the target recorded, as rounding's near ties do (``moe.rounding_flips``), is
    replayed again with the target's routing forced into its router (row ``routing: "target"``,
    ``own_routing_rel_l2`` its error with the golden router's): those tokens are no error of the
    block's, and its router's own replay judges the router."""
    modules = dict(golden.model.named_modules())
    shapes = golden_input_shapes(golden_dump, golden_step)
    ranks = target_dump.ranks()
    earlier = _earlier_entries(target_dump, target_step)
    names = golden_names(target_dump, target_step, modules, mapping)
    rules = mapping.shards if mapping is not None else ()
    weights = _weight_entries(target_dump) if len(ranks) > 1 else {}
    entries = module_entries(target_dump, target_step)
    for target_name, by_rank in entries.items():
        name = names.get(target_name)
        if name is None or not select(name, modules[name]):
            continue

        def replay(target_name: str = target_name, by_rank: dict[int, list[Entry]] = by_rank,
                   name: str = name) -> dict[str, Any]:
            return replay_module(name, modules[name], by_rank, target_dump, golden, target_step, shapes,
                                 ranks, earlier.get(target_name, {}), rules=rules, target_name=target_name,
                                 weights=weights.get(target_name))
        found = router_of(modules[name]) if routing else None
        yield _with_target_routing(name, modules[name], found, replay, entries, target_name, target_dump) \
            if found is not None else replay()
        if advance is not None:
            advance()


def _with_target_routing(name: str, block: nn.Module, found: tuple[str, nn.Module],
                         replay: Callable[[], dict[str, Any]], entries: dict[str, dict[int, list[Entry]]],
                         target_name: str, target: DumpReader) -> dict[str, Any]:
    """An MoE block's row (``replay_target_dump``'s ``routing``): replayed with its golden router's
    own routing, and again with the target's where they differ as rounding's near ties do."""
    attr, router = found
    seen: list[Any] = []
    handle = router.register_forward_hook(lambda _m, _a, out: seen.append(out) and None)
    try:
        row = replay()
    finally:
        handle.remove()
    recorded = _recorded_routing(entries.get(f"{target_name}.{attr}"), target)
    if not row.get("replayable") or not seen or recorded is None:
        return row
    dtype = next((e.dtype for e in first_call(next(iter(entries[target_name].values())))[0]
                  if e.is_tensor and e.dtype and "float" in e.dtype), "float32")
    if not rounding_flips(flatten_outputs(seen[0]), recorded, dtype):
        return row
    with block_routing_forced(name, block, recorded) as fired:
        forced = replay()
    if not forced.get("replayable") or not fired:
        return row
    forced.update(routing="target", own_routing_rel_l2=row["rel_l2"])
    return forced


def _recorded_routing(by_rank: dict[int, list[Entry]] | None,
                      target: DumpReader) -> dict[str, torch.Tensor] | None:
    """A router's recorded outputs (index -> tensor) at the step, where every rank recorded the
    same (a rank whose tokens differ would force another rank's routing); None otherwise."""
    if not by_rank:
        return None
    outputs = []
    for rank in sorted(by_rank):
        outs = {e.index: target.load(e) for e in first_call(by_rank[rank])[1] if e.is_tensor and e.has_data}
        if not outs:
            return None
        outputs.append(outs)
    first = outputs[0]
    same = all(o.keys() == first.keys() and all(torch.equal(o[k], first[k]) for k in first)
               for o in outputs[1:])
    return first if same else None


def _weight_entries(reader: DumpReader) -> dict[str, dict[int, dict[str, Entry]]]:
    """Module name -> rank -> its dumped parameters by their own name (``weight``, ``bias``)."""
    found: dict[str, dict[int, dict[str, Entry]]] = {}
    for e in reader.entries():
        if e.kind == "weight" and "." in e.name:
            module, _, pname = e.name.rpartition(".")
            found.setdefault(module, {}).setdefault(e.rank, {})[pname] = e
    return found


def recorded_outputs(reader: DumpReader, step: int) -> Callable[[str], Call | None]:
    """Module name -> a Call holding the outputs ``reader`` recorded for it at ``step`` (rank 0, its
    first call), None where it recorded none: the target's routing, which ``moe.routing_forced``
    gives the golden routers of a decoder layer replayed whole on the target's inputs."""
    def call_of(name: str) -> Call | None:
        entries = [e for e in reader.entries() if e.step == step and e.rank == 0 and e.level == "module"
                   and e.name == name]
        outs = {e.index: reader.load(e) for e in first_call(entries)[1] if e.is_tensor and e.has_data}
        return Call(name, outputs=outs) if outs else None
    return call_of


def target_routing(golden: Any, golden_dump: DumpReader, target_dump: DumpReader, step: int,
                   layers: Collection[str], dtype: torch.dtype) -> Callable[[str], Call | None]:
    """Router name -> a Call holding the routing the target chose at ``step`` (``moe.routing_forced``
    gives it to the golden routers of a decoder layer replayed whole): the router's outputs the
    target dump recorded; where it recorded none (a dump of the decoder layers alone), the routing
    a copy of the golden layer in the target's ``dtype`` picks on the target's recorded inputs
    (one rank; a faithful port's rounding routes near-tied experts as that copy does). None for a
    router neither gives."""
    recorded = recorded_outputs(target_dump, step)
    modules = dict(golden.model.named_modules())
    routers = {layer: [f"{n}.{found[0]}" for n, m in modules.items()
                       if n.startswith(layer + ".") and (found := router_of(m)) is not None]
               for layer in layers}
    estimated: dict[str, Call] = {}
    unrecorded = [layer for layer, names in routers.items() if names and recorded(names[0]) is None]
    if unrecorded and len(target_dump.ranks()) == 1:
        entries = module_entries(target_dump, step)
        shapes, earlier = golden_input_shapes(golden_dump, step), _earlier_entries(target_dump, step)
        in_dtype = replace(golden, dtype=dtype)
        for layer in (name for name in unrecorded if name in entries):
            with layer_weights_held(golden.model, layer):
                copy = copy_module(modules[layer]).to(dtype)
            seen: dict[str, Any] = {}
            hooks = [copy.get_submodule(name[len(layer) + 1:]).register_forward_hook(
                lambda _m, _a, out, name=name, seen=seen: seen.__setitem__(name, out))
                for name in routers[layer]]
            try:  # over steps 0..step at a decode step: each router's last output is the step's
                replay_module(layer, copy, entries[layer], target_dump, in_dtype, step, shapes,
                              earlier=earlier.get(layer, {}))
            finally:
                for hook in hooks:
                    hook.remove()
            estimated.update({name: Call(name, outputs=flatten_outputs(out)) for name, out in seen.items()})

    def call_of(name: str) -> Call | None:
        return recorded(name) or estimated.get(name)
    return call_of


def raw_errors_joined(golden: DumpReader, target: DumpReader, golden_step: int, target_step: int,
                      mapping: Mapping | None = None) -> dict[str, dict[str, float]]:
    """Output ``"0"`` of every module both dumps hold (a target module under the golden name
    ``mapping``'s rules give it), keyed by the golden's name: error metrics of the target's output,
    its ranks' shards joined as their shapes or the mapping's shards rules say (the inherited error;
    a one-rank target's output as it is, so a shape that differs from the golden's counts as an
    infinite error)."""
    def outs(reader: DumpReader, step: int) -> dict[str, dict[int, Entry]]:
        found: dict[str, dict[int, Entry]] = {}
        for e in reader.entries():
            if (e.step == step and e.level == "module" and e.kind == "output" and e.index == "0"
                    and e.has_data and e.is_tensor):
                found.setdefault(e.name, {}).setdefault(e.rank, e)
        return found
    g, t = outs(golden, golden_step), outs(target, target_step)
    names = golden_names(target, target_step, g, mapping)
    rules = mapping.shards if mapping is not None else ()
    raw: dict[str, dict[str, float]] = {}
    for target_name, by_rank in t.items():
        name = names.get(target_name)
        if name is None:
            continue
        reference = g[name][min(g[name])]
        shards = [by_rank[r] for r in sorted(by_rank)]
        merge = merge_of(reference.shape, [s.shape for s in shards], target_name, rules)
        if merge is None and len(shards) > 1:
            continue
        tensors = [target.load(s) for s in shards]
        raw[name] = own_error(golden.load(reference), join_tensors(merge, tensors) if merge else tensors[0])
    return raw


#: how close the golden's final norm and lm_head, run on its own last decoder layer's output, must
#: come to its recorded logits for them to be its whole tail (a softcap or a scale in the model's
#: forward between them and the logits leaves them further off, and the tail is not replayed)
TAIL_CHECK_REL_L2 = 1e-3


def _step_tensors(reader: DumpReader, step: int, names: Collection[str]) -> dict[str, list[Entry]]:
    """Name -> the tensors with data ``reader`` records for it at ``step`` (one pass over the
    index, however many names: a 70B dump's step holds ~10^5 entries)."""
    found: dict[str, list[Entry]] = {}
    for e in reader.entries():
        if e.step == step and e.name in names and e.is_tensor and e.has_data:
            found.setdefault(e.name, []).append(e)
    return found


def _held_tensor(entries: list[Entry], kind: str, index: str | None) -> Entry | None:
    """Of one name's ``entries`` (``_step_tensors``), the first ``kind`` on the lowest rank with
    ``index`` (None: the first floating input), or None."""
    found = [e for e in entries if e.kind == kind and (index is None or e.index == index)
             and (index is not None or (e.dtype or "").startswith(("float", "bfloat")))]
    return min(found, key=lambda e: (e.rank, e.order), default=None)


def layer_updates(reader: DumpReader, step: int, layers: dict[str, str]) -> dict[str, float]:
    """Golden layer name -> ||output - input|| of its hidden states in ``reader`` at ``step``
    (lowest rank; ``layers``: golden name -> the name ``reader`` records it under): what the layer
    adds to the residual stream, part of the scale its own error is measured against
    (``own_error.relative_to_update``). Layers without both tensors of one shape are left out."""
    held = _step_tensors(reader, step, set(layers.values()))
    updates: dict[str, float] = {}
    for name, recorded in layers.items():
        out = _held_tensor(held.get(recorded, []), "output", "0")
        inp = _held_tensor(held.get(recorded, []), "input", None)
        if out is not None and inp is not None and out.shape == inp.shape:
            updates[name] = float((reader.load(out).double() - reader.load(inp).double()).norm())
    return updates


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((n for n, m in model.named_modules() if m is module and n), None)


def _final_norm(model: nn.Module, stack: Any) -> str | None:
    """The one norm beside the decoder-layer list (``model.norm``, ``transformer.ln_f``), or None."""
    parent = stack.path.rpartition(".")[0]
    owner = model.get_submodule(parent) if parent else model
    norms = [f"{parent}.{n}" if parent else n for n, m in owner.named_children()
             if "norm" in type(m).__name__.lower()]
    return norms[0] if len(norms) == 1 else None


def outside_layer_rows(golden: Any, golden_dump: DumpReader, target_dump: DumpReader, *, golden_step: int,
                       target_step: int, stack: Any, held: dict[str, str]) -> tuple[list[dict[str, Any]],
                                                                                     list[str]]:
    """Rows for the model's code before its first decoder layer and after its last, where the
    target dump holds neither's modules (a dump of the decoder layers alone); and why a side was
    left out. ``held``: target module name -> golden name, of the modules the target dump holds.

    * After the layers (``covers``: the final norm and lm_head): the golden's final norm and
      lm_head run on the target's recorded output of its last decoder layer, against the target's
      recorded logits: the tail's own error, as any module's. First they are run on the golden's
      own last-layer output, which must give the golden's logits: where the model's forward does
      more between them (a logit softcap, a scale), the tail is not replayed.
    * Before the layers: the hidden states entering the first decoder layer, golden against
      target. Given the same token ids that is the embedding's own error (its input is the ids
      themselves), but the dumps do not record the ids: the row carries ``inputs_unverified`` and
      can point at the embedding, not convict it.
    """
    model = golden.model
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    golden_held = set(held.values())
    by_golden = {g: t for t, g in held.items()}
    first, last = stack.layers[0], stack.layers[-1]
    embed = _module_name(model, model.get_input_embeddings())
    g_held = _step_tensors(golden_dump, golden_step, {first, last, "logits"})
    t_held = _step_tensors(target_dump, target_step,
                           {by_golden[n] for n in (first, last) if n in by_golden} | {"logits"})
    if embed is not None and embed not in golden_held and first in by_golden:
        g = _held_tensor(g_held.get(first, []), "input", None)
        t = _held_tensor(t_held.get(by_golden[first], []), "input", g.index if g else None)
        if g is None or t is None:
            notes.append(f"{embed}: {first}'s input is not in both dumps")
        elif g.shape != t.shape:
            notes.append(f"{embed}: {first}'s input has shape {list(g.shape)} in the golden and "
                         f"{list(t.shape)} in the target")
        else:
            rows.append({"name": embed, "module_type": type(model.get_submodule(embed)).__name__,
                         "replayable": True, "output": "0", "covers": [embed], "inputs_unverified": True,
                         **own_error(golden_dump.load(g), target_dump.load(t))})
    head = model.get_output_embeddings()
    lm_head = _module_name(model, head)
    if lm_head is None or lm_head in golden_held or last not in by_golden:
        return rows, notes
    tail = [n for n in (_final_norm(model, stack), lm_head) if n is not None]
    h_g = _held_tensor(g_held.get(last, []), "output", "0")
    h_t = _held_tensor(t_held.get(by_golden[last], []), "output", "0")
    l_g = _held_tensor(g_held.get("logits", []), "output", "0")
    l_t = _held_tensor(t_held.get("logits", []), "output", "0")
    if h_g is None or h_t is None or l_g is None or l_t is None:
        notes.append(f"{' and '.join(tail)}: {last}'s output or the logits are not in both dumps")
        return rows, notes

    def run_tail(hidden: torch.Tensor) -> torch.Tensor:
        p = next(head.parameters())
        x = hidden.to(p.device, p.dtype)[..., -1:, :] if hidden.dim() >= 2 else hidden.to(p.device, p.dtype)
        with torch.no_grad():
            for name in tail:
                x = model.get_submodule(name)(x)
        return x.reshape(-1).float().cpu()

    try:
        check = own_error(golden_dump.load(l_g), run_tail(golden_dump.load(h_g)))
        replayed = run_tail(target_dump.load(h_t))
    except Exception as exc:  # a tail that needs more than the hidden states: reported, not fatal
        notes.append(f"{' and '.join(tail)}: replay failed: {type(exc).__name__}: {str(exc)[:160]}")
        return rows, notes
    if not check["rel_l2"] <= TAIL_CHECK_REL_L2:
        notes.append(f"{' and '.join(tail)}: run on the golden's own {last} output they are "
                     f"{check['rel_l2']:.2g} from its logits (the model's forward does more between them)")
        return rows, notes
    target_logits = target_dump.load(l_t).reshape(-1)
    if target_logits.numel() != replayed.numel():
        notes.append(f"{' and '.join(tail)}: the target's logits hold {target_logits.numel()} values, the "
                     f"golden's {replayed.numel()}")
        return rows, notes
    rows.append({"name": lm_head, "module_type": type(head).__name__, "replayable": True, "output": "0",
                 "covers": tail, **own_error(replayed, target_logits)})
    return rows, notes
