"""Problem codes: what is wrong with one compare row, as data rather than as message text.

Every row carries one ``code`` (its worst finding) and a ``reason`` for people. The verdict of a
row and every count in the summary come from the code; nothing parses the reason. A row's code is
the first of its findings in ``SEVERITY`` order, so a target with NaN that also trips a threshold
reads ``nan_inf`` (the cause) rather than ``threshold_fail`` (the symptom).

========================  ==========  ======================================================
code                      verdict     meaning
========================  ==========  ======================================================
load_error                fail        a tensor could not be read (corrupt file, bad key)
shape_mismatch            fail        different element counts: nothing could be compared
stats_missing             fail        statistics-only row without statistics on one side
no_finite                 fail        no element is finite on both sides
nan_inf                   fail        the target has NaN/Inf the golden does not have (a
                                      statistics-only row: NaN/Inf statistics on one side)
threshold_fail            fail        a metric is beyond its fail limit
error_jump                fail        beyond a warn limit, and the error is ``jump_ratio`` times
                                      the same module's in the previous layer or more
                                      (``llmflow.compare.jumps``)
checksum_differs          fail        both sides recorded a CRC-32 of the tensor's bytes
                                      (msprobe ``summary_mode: md5``, llmflow ``crc32``) and
                                      they differ: asked for bitwise identity, whatever the
                                      statistics say
dtype_mismatch            warn        integer data on one side, floating on the other
nan_inf_shared            warn        NaN/Inf on the golden side too (not the target's doing)
empty_tensor              warn        both sides hold zero elements: nothing to compare
routing_mismatch          warn        an MoE router's expert indices differ: a routing flip,
                                      judged by the router's logits row, not by its indices
threshold_warn            warn        a metric is beyond its warn limit
ok                        pass        compared, within every limit
unmatched_golden          unmatched   a golden tensor with no target partner
unmatched_target          unmatched   a target tensor with no golden partner
========================  ==========  ======================================================
"""

from __future__ import annotations

from enum import Enum


class Code(str, Enum):
    """One row's worst finding (the values are what the CSV's ``code`` column holds)."""

    LOAD_ERROR = "load_error"
    SHAPE_MISMATCH = "shape_mismatch"
    STATS_MISSING = "stats_missing"
    NO_FINITE = "no_finite"
    NAN_INF = "nan_inf"
    THRESHOLD_FAIL = "threshold_fail"
    ERROR_JUMP = "error_jump"
    CHECKSUM_DIFFERS = "checksum_differs"
    DTYPE_MISMATCH = "dtype_mismatch"
    NAN_INF_SHARED = "nan_inf_shared"
    EMPTY_TENSOR = "empty_tensor"
    ROUTING_MISMATCH = "routing_mismatch"
    THRESHOLD_WARN = "threshold_warn"
    OK = "ok"
    UNMATCHED_GOLDEN = "unmatched_golden"
    UNMATCHED_TARGET = "unmatched_target"

    def __str__(self) -> str:
        return self.value


SEVERITY: tuple[Code, ...] = tuple(Code)  # declaration order: worst first
VERDICT: dict[Code, str] = {
    Code.LOAD_ERROR: "fail", Code.SHAPE_MISMATCH: "fail", Code.STATS_MISSING: "fail",
    Code.NO_FINITE: "fail", Code.NAN_INF: "fail", Code.THRESHOLD_FAIL: "fail",
    Code.ERROR_JUMP: "fail", Code.CHECKSUM_DIFFERS: "fail",
    Code.DTYPE_MISMATCH: "warn", Code.NAN_INF_SHARED: "warn", Code.EMPTY_TENSOR: "warn",
    Code.ROUTING_MISMATCH: "warn", Code.THRESHOLD_WARN: "warn", Code.OK: "pass",
    Code.UNMATCHED_GOLDEN: "unmatched", Code.UNMATCHED_TARGET: "unmatched",
}
VERDICTS = ("pass", "warn", "fail", "unmatched")
_RANK = {c: i for i, c in enumerate(SEVERITY)}
# by value: an enum member hashes by its name, and rows hold the values (per-row lookups)
BY_VALUE: dict[str, Code] = {c.value: c for c in Code}
VERDICT_OF_VALUE: dict[str, str] = {c.value: v for c, v in VERDICT.items()}
RANK_OF_VALUE: dict[str, int] = {c.value: i for c, i in _RANK.items()}


def worst(codes: list[Code]) -> Code:
    """The most severe of ``codes`` (``ok`` for none)."""
    return min(codes, key=_RANK.__getitem__) if codes else Code.OK
