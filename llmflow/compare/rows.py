"""One report row per ``Pair``: the work a compare worker does (load, compare, judge).

Runs in worker processes (or dask workers): a ``Job`` carries the two readers (picklable, they
re-open their files lazily in each process) and the options, ``run_chunk`` turns a list of pairs
into small row dicts. Tensors are loaded one pair at a time and dropped right after, so a worker's
memory is a few tensors whatever the dump size.

Every row says where its tensors lie (``golden_data_path``/``target_data_path``: a locator that
``llmflow inspect`` opens), each side's statistics, the metrics, a problem ``code``
(``llmflow.compare.codes``) with its verdict, and a reason naming what tripped.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from llmflow.compare.algorithms import load_algorithms, run_algorithm
from llmflow.compare.codes import RANK_OF_VALUE, Code
from llmflow.compare.columns import STATS
from llmflow.compare.mappings import REPLICATED, SUM
from llmflow.compare.match import Pair
from llmflow.compare.metrics import compare_tensors, judge
from llmflow.compare.shards import (
    PARTS_JOIN,
    LostShards,
    join_tensors,
    joined_shape,
    joined_stats,
    lost_reason,
    shard_errors,
    shards_label,
    standout,
    unreduced,
    worst_copy_note,
)
from llmflow.compare.statistics import compare_stats, side_stats
from llmflow.compare.thresholds import coarser
from llmflow.dtypes import dtype_class
from llmflow.formats import locator, locator_prefix
from llmflow.formats.base import DumpReader, Entry
from llmflow.structure import is_experts, is_router

ID_COLUMNS = ["step", "target_step", "rank", "name", "target_name", "kind", "index", "order", "match",
              "module_type", "golden_dtype", "target_dtype", "golden_shape", "target_shape"]
LOGITS_COLUMNS = ["golden_top1", "target_top1", "top1_match", "top5_overlap"]
TAIL_COLUMNS = ["verdict", "code", "reason", "tripped", "golden_data_path", "target_data_path"]


class LoadFailed(Exception):
    """A tensor of one side that could not be read: lost data, named by side, entry and rank."""

    def __init__(self, side: str, entry: Entry, cause: Exception):
        super().__init__(f"the {side} dump's {entry.name} {entry.kind} {entry.index} (rank {entry.rank}, "
                         f"step {entry.step}) could not be read: {type(cause).__name__}: {cause}")


@dataclass
class Job:
    """Everything a worker needs besides the pairs themselves."""

    golden: DumpReader
    target: DumpReader
    algorithms: list[str] = field(default_factory=list)
    base_dir: str = "."
    stats_only: bool = False
    thresholds: dict | None = None
    target_dtype: str | None = None  # given: judges every float row
    model_dtype: str | None = None  # recorded in the dumps: judges rows at it or coarser
    kl: str = "all"  # rows that get the KL divergence: "all", or "logits" (CompareOptions.kl)
    _algs: dict | None = field(default=None, repr=False)
    _prefixes: tuple[str, str] | None = field(default=None, repr=False)
    _load_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_algs"] = None  # functions from file.py refs are re-imported in each process
        del state["_load_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _load_lock=threading.Lock())

    def load(self, reader: DumpReader, entry: Entry) -> torch.Tensor:
        """``reader.load(entry)``, one load at a time: a compare may run its pairs in several
        threads, and a reader (a plugin's too) need not be safe to call from two at once. Loading
        is the small part of a pair (llmflow dumps are mapped, not read); comparing is not
        serialised."""
        with self._load_lock:
            try:
                return reader.load(entry)
            except Exception as exc:
                raise LoadFailed(self._side(reader), entry, exc) from exc

    def _side(self, reader: DumpReader) -> str:
        return "golden" if reader is self.golden else "target" if reader is self.target else "a"

    def algs(self) -> dict:
        if self._algs is None:
            self._algs = load_algorithms(self.algorithms, self.base_dir)
        return self._algs

    def prefixes(self) -> tuple[str, str]:
        """``locator_prefix`` of the golden and the target reader (computed once)."""
        if self._prefixes is None:
            self._prefixes = (locator_prefix(self.golden), locator_prefix(self.target))
        return self._prefixes


def _shape(e: Entry | None) -> list[int] | None:
    return list(e.shape) if e is not None and e.shape is not None else None


def base_row(p: Pair, job: Job | None = None) -> dict[str, Any]:
    """The identifying columns of a pair's row (and, with ``job``, where its tensors lie)."""
    g, t0 = p.golden, (p.targets[0] if p.targets else None)
    ref = g or t0
    assert ref is not None
    several = len(p.targets) > 1  # a many-to-one mapping (their sum), or a sharded target's ranks
    row = {
        "step": p.golden_step, "target_step": p.target_step, "rank": p.rank,
        "name": g.name if g else None,
        "target_name": (PARTS_JOIN.join(t.name for t in p.targets) if several and not p.merge else t0.name)
        if t0 else None,
        "kind": ref.kind, "index": ref.index, "order": ref.order, "match": p.match,
        "module_type": ref.module_type,
        "golden_dtype": g.dtype if g else None,
        "target_dtype": t0.dtype if t0 else None,
        "golden_shape": _shape(g), "target_shape": _shape(t0),
    }
    if p.merge:
        row["target_shape"] = joined_shape(p.merge, [t.shape or () for t in p.targets])
        row["shards"] = shards_label(len(p.targets), p.merge)
    if job is not None:
        gp, tp = job.prefixes()
        row["golden_data_path"] = locator(job.golden, g, gp) if g else ""
        row["target_data_path"] = (
            PARTS_JOIN.join(filter(None, (locator(job.target, t, tp) for t in p.targets))) if several
            else locator(job.target, t0, tp) if t0 else "")
    return row


def judge_dtype(p: Pair, target_dtype: str | None, model_dtype: str | None = None) -> str:
    """The dtype whose thresholds judge a pair: integer data stays exact; else the given
    ``target_dtype``; else the model's dtype recorded in the dumps (a bf16 model's logits reach the
    dump upcast to fp32, and are judged at bf16), or the tensor's own where that is coarser
    (an fp8 output of a bf16 model); else the tensor's own dtype."""
    t_dtype = p.targets[0].dtype if p.targets else None
    if dtype_class(t_dtype) == "integer" or dtype_class(p.golden.dtype if p.golden else None) == "integer":
        return "integer"
    if target_dtype:
        return target_dtype
    own = t_dtype or "float32"
    return coarser(model_dtype, own) if model_dtype else own


def _stats_of(job: Job, reader: DumpReader, e: Entry) -> dict[str, float] | None:
    if e.stats:
        return e.stats
    if not e.has_data:
        return None
    x = job.load(reader, e).double().reshape(-1)
    stats = side_stats(x)
    if math.isnan(stats["norm"]):  # no finite element: the norm of none is 0, as a metrics row says
        stats["norm"] = 0.0
    return {**stats, "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}


def _sum_stats(stats: list[dict[str, float] | None]) -> dict[str, float] | None:
    if len(stats) == 1:
        return stats[0]
    return None  # statistics of a sum cannot be derived from the parts' statistics


def _recorded_stats(row: dict[str, Any], side: str, e: Entry | None) -> None:
    """An unmatched row's statistics: what its entry recorded (no tensor is read for it)."""
    for s in STATS:
        v = (e.stats or {}).get(s) if e is not None else None
        row[f"{side}_{s}"] = float(v) if v is not None else None


def _logits_columns(g: torch.Tensor, t: torch.Tensor) -> dict[str, Any]:
    """Greedy-token agreement of two logits tensors ``[batch, vocab]`` (first row)."""
    g1, t1 = g.reshape(-1, g.shape[-1])[0].float(), t.reshape(-1, t.shape[-1])[0].float()
    k = min(5, g1.numel())
    gt, tt = torch.topk(g1, k).indices.tolist(), torch.topk(t1, k).indices.tolist()
    # top-1 as greedy generate picks it (argmax of the float logits: the first of tied maxima);
    # topk may order a tie of two bf16 logits the other way and date a divergence a step early
    g_top, t_top = int(torch.argmax(g1)), int(torch.argmax(t1))
    return {"golden_top1": g_top, "target_top1": t_top, "top1_match": g_top == t_top,
            "top5_overlap": len(set(gt) & set(tt)) / k}


def compute_row(job: Job, p: Pair) -> dict[str, Any]:
    """The full row of one pair; never raises (an unreadable tensor is a ``load_error`` row)."""
    row = base_row(p, job)
    if p.unmatched:
        code = Code.UNMATCHED_GOLDEN if p.golden is not None else Code.UNMATCHED_TARGET
        _recorded_stats(row, "golden", p.golden)
        _recorded_stats(row, "target", p.targets[0] if len(p.targets) == 1 else None)
        row.update(verdict="unmatched", code=code.value, reason=p.match)
        return row
    assert p.golden is not None
    if isinstance(p, LostShards):  # (lost data: nothing to load, nothing a fault of the target's)
        _recorded_stats(row, "golden", p.golden)
        _recorded_stats(row, "target", None)
        row.update(verdict="fail", code=Code.LOAD_ERROR.value, reason=lost_reason(p))
        return row
    try:
        use_stats = job.stats_only or not p.golden.has_data or not all(t.has_data for t in p.targets)
        ranks_said = None
        if use_stats:
            g_stats = _stats_of(job, job.golden, p.golden)
            t_stats = [_stats_of(job, job.target, t) for t in p.targets]
            row.update(compare_stats(g_stats, joined_stats(p.merge, t_stats, p.targets) if p.merge
                                     else _sum_stats(t_stats)))
        else:
            g = job.load(job.golden, p.golden)
            if p.merge:
                t, ranks_said = _joined_target(job, p, g, row)
            elif len(p.targets) == 1:
                t = job.load(job.target, p.targets[0])
            else:
                t = job.load(job.target, p.targets[0]).float()
                for extra in p.targets[1:]:
                    t = t + job.load(job.target, extra).float()
            row.update(compare_tensors(g, t, kl=job.kl == "all" or "logits" in p.levels))
            if "logits" in p.levels and g.dim() >= 1 and g.shape == t.shape and g.numel():
                row.update(_logits_columns(g, t))
            algs = job.algs()
            if algs:
                gf, tf = g.float(), t.float()
                if gf.shape != tf.shape and gf.numel() == tf.numel():
                    tf = tf.reshape(gf.shape)
                for name, func in algs.items():
                    if gf.shape == tf.shape:
                        row.update(run_algorithm(name, func, gf, tf))
                    else:
                        row.update({name: math.nan, f"{name}_message": "skipped: shape mismatch"})
            del g, t
        dtype = judge_dtype(p, job.target_dtype, job.model_dtype)
        j = judge(row, dtype, job.thresholds)
        row.update(verdict=j.verdict, code=j.code, reason=j.reason,
                   tripped=",".join(f"{m}={lv}" for m, lv in j.tripped.items()))
        if ranks_said is not None and j.verdict != "pass":
            row["reason"] = f"{ranks_said}; {row['reason']}"
        differs = _checksums_differ(p) if use_stats else None
        if differs and RANK_OF_VALUE[j.code] > RANK_OF_VALUE[Code.CHECKSUM_DIFFERS.value]:
            row.update(verdict="fail", code=Code.CHECKSUM_DIFFERS.value,
                       reason="; ".join(r for r in (differs, row["reason"]) if r))
        if dtype == "integer" and j.code == Code.THRESHOLD_FAIL.value and _routing_indices(p):
            _as_routing(row)
    except LoadFailed as exc:  # a corrupt tensor file must not stop a 100k-row compare
        row.update(verdict="fail", code=Code.LOAD_ERROR.value, reason=f"error: {exc}")
    except Exception as exc:
        row.update(verdict="fail", code=Code.LOAD_ERROR.value, reason=f"error: {type(exc).__name__}: {exc}")
    return row


def _checksums_differ(p: Pair) -> str | None:
    """Why a statistics row fails bitwise, or None: both sides recorded a CRC-32 of the tensor's
    bytes (msprobe ``summary_mode: md5``, llmflow ``crc32``) for one tensor of the same dtype and
    shape, and they differ. Statistics within tolerance do not make such a pair pass: a dump taken
    with checksums asks whether the bytes are identical (a rerun, a refactor, a determinism
    check). A pair the checksums cannot speak for (other dtypes, a joined or summed target) is
    judged by its statistics alone."""
    if len(p.targets) != 1 or p.merge:
        return None
    g, t = p.golden, p.targets[0]
    if g is None or g.dtype != t.dtype or g.shape != t.shape:
        return None
    g_crc, t_crc = g.extra.get("crc32"), t.extra.get("crc32")
    if not isinstance(g_crc, int) or not isinstance(t_crc, int) or g_crc == t_crc:
        return None
    return f"CRC-32 differs (golden {g_crc:08x}, target {t_crc:08x}): the bytes are not identical"


def _joined_target(job: Job, p: Pair, g: torch.Tensor, row: dict[str, Any]
                   ) -> tuple[torch.Tensor, str | None]:
    """A sharded target's tensor as the golden holds it (``shards.py``), and what the row's reason
    says of the ranks where it does not pass: the rank whose own shard error stands out, or copies
    that are partial products. ``row["shards"]`` says how the ranks joined and which rank was worst."""
    ranks = [t.rank for t in p.targets]
    shards = [job.load(job.target, t) for t in p.targets]
    if p.merge == REPLICATED and all(torch.equal(shards[0], s) for s in shards[1:]):
        return shards[0], None  # the usual case: one compare of the copy every rank holds
    errors = shard_errors(g, p.merge, shards) if p.merge != SUM else []
    found = standout(errors, ranks) if errors else None
    said = None
    if found is not None:
        row["shards"] += f"; rank {found[0]} stands out (relative distance {found[1]:.3g})"
        said = f"rank {found[0]}'s shard stands out (relative distance {found[1]:.3g}, the other ranks' " \
               f"{found[2]:.3g})"
    if p.merge == REPLICATED:  # the ranks' copies differ: the worst one is the row
        worst = max(range(len(errors)), key=lambda i: (errors[i] != errors[i], errors[i]))
        row["shards"] += worst_copy_note(ranks[worst])
        summed = unreduced(g, shards, errors[worst])
        if summed is not None:
            said = (f"the ranks' copies differ and their sum is the golden's (relative distance "
                    f"{summed:.3g}): partial products not all-reduced (an all-reduce missing, or the "
                    "tensor dumped before its all-reduce: a mapping's shards rule with merge: sum joins "
                    "them)")
        return shards[worst], said
    return join_tensors(p.merge, shards), said


def _routing_indices(p: Pair) -> bool:
    """Is this (integer) pair an MoE block's expert indices: a router's output or the experts'
    input?"""
    g = p.golden
    if g is None:
        return False
    return (g.kind == "output" and is_router(g.name, g.module_type)) or \
        (g.kind == "input" and is_experts(g.name, g.module_type))


def _as_routing(row: dict[str, Any]) -> None:
    """An MoE router's expert indices differ: a routing flip, not the first failing row. Near-tied
    router logits flip in bf16 on healthy models; a real router fault shows in its logits row
    (float, judged by the thresholds), and a flip that matters shows in the MoE block's output."""
    within = row.get("one_thousandth_err_ratio")  # integers: the share of equal elements
    differ = f"{1 - within:.1%} of the elements" if isinstance(within, float) and within == within \
        else "some elements"
    row.update(verdict="warn", code=Code.ROUTING_MISMATCH.value, tripped="",
               reason=f"expert indices differ ({differ}): a routing flip; the router's logits row "
                      "and the MoE block's output say whether it matters")


def run_chunk(job: Job, pairs: list[Pair]) -> list[tuple[tuple[str, ...], dict[str, Any], int]]:
    """(levels, row, bytes read) for each pair of a chunk, in order."""
    return [(p.levels, compute_row(job, p), 0 if p.unmatched else p.nbytes) for p in pairs]
