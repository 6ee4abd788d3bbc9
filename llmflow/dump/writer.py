"""The background writer: the forward pass hands over copies, this thread puts them on disk.

The capture side calls ``submit(entry, payload, event)``; ``event`` (if any) says when an
asynchronous device copy has landed. ``payload`` is:

* tensor mode: a host copy of the tensor;
* statistics mode: a copy of the tensor on its device (the statistics of a whole batch are
  computed here, see ``stats.batched_stats``);
* None for entries without data (non-tensor values, parameters) and for a repeat of a tensor
  captured earlier in the step: ``entry.key`` then names the earlier tensor's key, whose data
  (tensor mode) or statistics (statistics mode, resolved by the reader) the repeat shares.

To keep the forward thread fast, ``submit`` only appends to a deque (atomic under the GIL), or
for an entry that is an index row and nothing more to a list handed over at the step's end, and
wakes the thread at step ends or when more than ``wake_bytes`` are waiting; the thread then
works through the backlog in bulk: tensors are collected into one safetensors file per
``batch_bytes``, or at the first step end ``data_seconds`` after the last file (a file per step,
for one logits row, cost ~5% of a small model's statistics-mode dump in interleaved A/B runs; a
crash loses at most that last second of data), device statistics are read back with one
transfer, and the index lines are appended after their data file is in place (rows without
data: at every step end).
``submit`` blocks while more than ``max_pending_bytes`` are queued, which bounds memory. An
exception in the thread is re-raised by the next ``submit``/``end_step``/``close``, so a full
disk is reported, not swallowed.

With ``inline=True`` no thread is started: the same backlog is worked through by the forward
thread itself at each step end (and whenever ``wake_bytes`` are waiting). That is faster where
the thread would have no core of its own (``capture.inline_writer`` decides).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import deque
from typing import Any

import torch

from llmflow.dump.stats import batched_stats
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import DumpDirWriter

_STEP_END = object()
_CLOSE = object()
_ROWS = object()  # a list of entries that are index rows only


class AsyncWriter:
    """Owns a ``DumpDirWriter`` and feeds it from a daemon thread, or inline (see above)."""

    def __init__(self, disk: DumpDirWriter, *, crc32: bool = False, batch_bytes: int = 64 << 20,
                 wake_bytes: int = 16 << 20, max_pending_bytes: int = 512 << 20, data_seconds: float = 1.0,
                 inline: bool = False):
        self.disk = disk
        self.crc32 = crc32
        self.batch_bytes = batch_bytes
        self.wake_bytes = wake_bytes
        self.max_pending_bytes = max_pending_bytes
        self.data_seconds = data_seconds
        self._data_due = 0.0  # (monotonic clock) a step end after this writes the data batch
        self._queue: deque[tuple[Any, Any, Any, int]] = deque()
        # producer side: index-only entries of the current step, as ``Entry`` objects or as rows
        # in ``ROW_FIELDS`` order (``add_row``: what the capture builds for most of them)
        self._rows: list[Entry | tuple] = []
        self.add_row = self._rows.append  # (one list for the writer's life: the bound append stays valid)
        self._cond = threading.Condition()
        self._wake = False
        self._produced = 0  # bytes submitted (written by the producer only)
        self._consumed = 0  # bytes processed (written by the writer thread only)
        self._error: BaseException | None = None
        self._reported = False
        self._batch: dict[str, torch.Tensor] = {}
        self._batch_entries: list[Entry] = []
        self._batch_size = 0
        self._files: dict[str, str] = {}  # tensor key -> data file, for repeats after a flush
        self._stats: list[tuple[Entry, torch.Tensor]] = []  # statistics-mode entries awaiting stats
        # index lines that need no data written first (repeats, non-tensors): one write per
        # flush instead of one write and flush() per entry; the reader orders entries itself
        self._lines: list[Entry | tuple] = []
        self._stats_bytes = 0
        # inline: the backlog is worked through in the forward thread at step ends (and every
        # ``wake_bytes``) instead of by a thread; see ``inline_writer`` in capture.py for when
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._loop, name="llmflow-dump-writer", daemon=True)
            self._thread.start()

    # -- producer side (forward thread) --------------------------------------------------------
    def submit(self, entry: Entry, payload: Any = None, event: Any = None, nbytes: int = 0) -> None:
        """Queue one entry (see the module docstring for ``payload``)."""
        if self._error is not None:
            self._raise_error()
            return  # reported already: nothing more is queued for a writer that has failed
        if payload is None and not entry.has_data:
            # an index row and nothing else (a non-tensor, statistics known at capture, a
            # statistics-mode repeat): kept here, handed over with the step's end in one piece
            # (most of a statistics-mode dump's entries: one list append instead of a queue item)
            self._rows.append(entry)
            return
        self._queue.append((entry, payload, event, nbytes))
        if nbytes:
            self._produced += nbytes
            pending = self._produced - self._consumed
            if pending > self.wake_bytes:
                if self._thread is None:  # inline
                    self._drain_inline()
                    return
                self._notify()
                while self._produced - self._consumed > self.max_pending_bytes and self._error is None:
                    with self._cond:
                        self._cond.wait(0.01)

    def end_step(self, step: int, order: list[str] | None = None) -> None:
        """End of a step: its data goes into its own file(s) before the next step's."""
        if self._error is not None:
            self._raise_error()
            return  # reported already: the dump is abandoned, not continued
        self._hand_over_rows()
        self._queue.append((_STEP_END, step, order, 0))
        if self._thread is None:  # inline
            self._drain_inline()
        else:
            self._notify()

    def close(self, complete: bool = True, **meta: Any) -> None:
        """Drain the queue, write the last batch, close the files, mark the dump complete."""
        if self._error is None:  # (after a failure nothing is written, complete stays false)
            self._hand_over_rows()
            self._queue.append((_CLOSE, complete, meta, 0))
            if self._thread is None:  # inline
                self._drain_inline()
            else:
                self._notify()
                self._thread.join()
        self._raise_error()

    def _hand_over_rows(self) -> None:
        if self._rows:
            self._queue.append((_ROWS, self._rows.copy(), None, 0))
            self._rows.clear()

    def _notify(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    def _raise_error(self) -> None:
        # once: the model's own hooks (an always_call root hook, a finally) come back here while
        # the first report propagates, and a second raise would only turn into torch's warning
        # that it silenced one
        if self._error is not None and not self._reported:
            self._reported = True
            raise RuntimeError(f"dump writer failed: {self._error}") from self._error

    # -- consumer side (writer thread) ----------------------------------------------------------
    def _loop(self) -> None:
        # One CPU thread for this thread's own torch ops (batched statistics, copies). The setting
        # is per thread (OpenMP's and MKL's thread-local counts), so the model keeps its threads;
        # without it every op here starts a second OpenMP team that spins on the cores the model
        # computes on (API-mode dumps measured ~1.4x slower on 2 cores).
        torch.set_num_threads(1)
        try:
            while True:
                with self._cond:
                    while not self._wake:
                        self._cond.wait()
                    self._wake = False
                if self._drain():
                    return
                with self._cond:
                    self._cond.notify_all()  # a producer may wait for room
        except BaseException as exc:  # kept and re-raised in the forward thread
            self._error = exc
            self._queue.clear()
            with self._cond:
                self._cond.notify_all()

    def _drain(self) -> bool:
        """Work through the queue; True once the dump is closed."""
        while self._queue:
            item = self._queue.popleft()
            if self._handle(item):
                return True
            if item[3]:
                self._consumed += item[3]
        return False

    def _drain_inline(self) -> None:
        # (callers return early once a failure is known: this only runs on a healthy writer)
        try:
            self._drain()
        except BaseException as exc:  # reported like the thread's errors: "dump writer failed"
            self._error = exc
            self._queue.clear()
            self._raise_error()

    def _handle(self, item: tuple[Any, Any, Any, int]) -> bool:
        head = item[0]
        if head is _ROWS:
            self._lines.extend(item[1])
            return False
        if head is _STEP_END:
            self._flush(data=time.monotonic() >= self._data_due)
            self._files.clear()
            if item[2] is not None:
                self.disk.append_order(item[1], item[2])
            return False
        if head is _CLOSE:
            self._flush()
            self.disk.close(complete=item[1], **item[2])
            return True
        entry, payload, event, _ = item
        if event is not None:
            event.synchronize()  # the asynchronous device copy has landed
        if payload is None:
            if entry.has_data and entry.key in self._files:  # a repeat of a flushed tensor
                entry.key = f"{self._files[entry.key]}:{entry.key}"
                self._lines.append(entry)
            elif entry.has_data:  # a repeat of a tensor still in the batch
                self._batch_entries.append(entry)
            else:
                self._lines.append(entry)
        elif entry.has_data:
            self._batch[entry.key] = payload
            self._batch_entries.append(entry)
            self._batch_size += payload.nbytes
            if self._batch_size >= self.batch_bytes:
                self._flush()
        else:  # statistics mode: a copy on the tensor's device
            self._stats.append((entry, payload))
            self._stats_bytes += payload.nbytes
            if self._stats_bytes >= self.batch_bytes:
                self._flush()
        return False

    def _flush(self, data: bool = True) -> None:
        if self._lines:
            self.disk.append_entries(self._lines)
            self._lines = []
        if self._stats:
            stats = batched_stats([t for _, t in self._stats])
            for (e, t), st in zip(self._stats, stats, strict=True):
                e.stats = st  # a list in STAT_KEYS order: what the index row holds
                if self.crc32:
                    e.extra["crc32"] = zlib.crc32(_raw_bytes(t))
            self.disk.append_entries([e for e, _ in self._stats])
            self._stats, self._stats_bytes = [], 0
        if not data:
            return
        if self._batch_entries:
            keys = list(self._batch)
            files = self.disk.write_batch(self._batch, self._batch_entries)
            for key in keys:
                self._files[key] = files
            self._data_due = time.monotonic() + self.data_seconds
        self._batch, self._batch_entries, self._batch_size = {}, [], 0


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in memory order (bf16 and friends via a uint8 view)."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
