"""The background writer: the forward pass hands over copies, this thread puts them on disk.

The capture side calls ``submit(row, payload, event)`` with an ``IndexRow`` (the entry as its
index line will hold it); ``event`` says when an asynchronous device copy has landed: None on the
CPU, an event of its own on most accelerators, and on CUDA the stream the copy was queued on
(``copies.StreamKey``). For those, the producer records one event per stream (``copies.fence``)
at each step end, at close and after every ``wake_bytes`` of copies, and the writer reads none of
the copies before the next such fence has passed (no data file, no statistics). An event per copy
cost the forward thread ~14 us of a step's ~430 tensors each on an H100; a stream's key, 0.4 us.
``payload`` is:

* tensor mode: a host copy of the tensor, or its bytes (``copies.host_copy``);
* statistics mode: a copy of the tensor on its device (the statistics of a whole batch are
  computed here, see ``stats.batched_stats``);
* either mode, on CUDA: the tensor itself, with its version counter as ``event`` (an int), which
  the writer checks when it reads the tensor, by the step's end; or a copy with a
  ``copies.Checked`` as ``event`` while ``copies.TensorKeeper`` learns whether the model changes
  its tensors after their capture;
* None for a repeat of a tensor captured earlier in the step: ``row.key`` then names the earlier
  tensor's key, whose data the repeat shares.

Rows that are an index row and nothing more (non-tensors, statistics known at capture, repeats
in statistics mode, whose statistics the reader resolves by key) go to ``add_row`` instead, or,
where the capture has checked that the row is a plain tuple whose floats are all finite (it
checks each row it makes), to ``add_finite_row``. Both are list appends; the finite rows are
encoded without a look at each row (``index_line``'s ``finite_rows``), the others are looked at
for NaN and Infinity as their line is written.

To keep the forward thread fast, ``submit`` only appends to a deque (atomic under the GIL) and
``add_row`` to a list handed over at the step's end; the thread is woken at step ends or when
more than ``wake_bytes`` are waiting, and works through the backlog in bulk: tensors are
collected into one safetensors file per ``batch_bytes``, or at the first step end
``data_seconds`` after the last file (a file per step, for one logits row, cost ~5% of a small
model's statistics-mode dump in interleaved A/B runs; a crash loses at most that last second of
data), device statistics are read back with one transfer, and the index lines are appended after
their data file is in place (rows without data: at every step end).
``submit`` blocks while more than ``max_pending_bytes`` are queued, which bounds memory. An
exception in the thread is re-raised by the next ``submit``/``end_step``/``close``, so a full
disk is reported, not swallowed.

With ``inline=True`` no thread is started: the same backlog is worked through by the forward
thread itself at each step end (and whenever ``wake_bytes`` are waiting); a host copy, a held
tensor or a repeat with nothing queued ahead of it (``_take_data``), and a held tensor of a
statistics dump, skip the queue and go straight into their batch. That is faster where the
thread would have no core of its own (``capture.inline_writer`` decides).

The thread is a daemon (a user's script must be able to end without closing anything), so a
writer still open when the interpreter exits must be finished before the interpreter tears
itself down under a thread with torch work in flight (which aborts the process: "terminate
called without an active exception"). The capture closes its open dumps from an exit hook
(``capture.DumpSession``); ``_join_at_exit`` here then waits for any thread still finishing a
close that was requested from inside it (a garbage-collected model's dump).
"""

from __future__ import annotations

import atexit
import threading
import time
import zlib
from collections import deque
from contextlib import nullcontext
from typing import Any

import torch

from llmflow.collector import collections_paused
from llmflow.dump.copies import Checked, StreamKey, TensorKeeper, after_default_streams, fence, to_host
from llmflow.dump.stats import batched_stats
from llmflow.formats.llmflow_dump import ROW_FIELDS, DumpDirWriter, IndexRow

_STEP_END = object()
_CLOSE = object()
_ROWS = object()  # a list of rows that are index rows only
_FENCE = object()  # events: the device copies queued before them have landed once they have passed
_THREADED: set[AsyncWriter] = set()  # writers whose thread runs (removed once it has finished)


class AsyncWriter:
    """Owns a ``DumpDirWriter`` and feeds it from a daemon thread, or inline (see above)."""

    def __init__(self, disk: DumpDirWriter, *, crc32: bool = False, batch_bytes: int = 64 << 20,
                 wake_bytes: int = 16 << 20, max_pending_bytes: int = 512 << 20, data_seconds: float = 1.0,
                 inline: bool = False, keeper: TensorKeeper | None = None):
        self.disk = disk
        # the capture's copies, or held tensors (``copies.TensorKeeper``): told what the writer
        # finds when it reads them
        self.keeper = keeper
        self.crc32 = crc32
        self.batch_bytes = batch_bytes
        self.wake_bytes = wake_bytes
        self.max_pending_bytes = max_pending_bytes
        self.data_seconds = data_seconds
        self._data_due = 0.0  # (monotonic clock) a step end after this writes the data batch
        self._queue: deque[tuple[Any, Any, Any, int]] = deque()
        # producer side: the current step's rows that are index rows only (most of a
        # statistics-mode dump): one list append each, handed over at the step's end in one piece;
        # IndexRows or plain tuples in its field order (what the capture hands over)
        # (one list each for the writer's life: the bound appends stay valid)
        self._rows: list[tuple] = []  # plain tuples whose floats are all finite
        self._unchecked_rows: list[IndexRow | tuple] = []  # any rows (NaN and Infinity among them)
        self.add_finite_row, self.add_row = self._rows.append, self._unchecked_rows.append
        self._cond = threading.Condition()
        self._wake = False
        self._produced = 0  # bytes submitted (written by the producer only)
        self._consumed = 0  # bytes processed (written by the writer thread only)
        self._errors_queued = self._errors_written = 0  # forward failures: handed over, on disk
        self._error: BaseException | None = None
        self._reported = False
        self._batch: dict[str, torch.Tensor | bytes | memoryview] = {}
        # the rows of the tensors in ``_batch`` until their data file is written (``_held``)
        self._batch_rows: list[tuple] = []
        self._batch_size = 0
        self._files: dict[str, str] = {}  # tensor key -> data file, for repeats after a flush
        # statistics-mode rows awaiting stats: (row, tensor on its device, (tensor captured,
        # its version) where that tensor is held or a learning copy's original, else None)
        self._stats: list[tuple[IndexRow, torch.Tensor, tuple[torch.Tensor, int] | None]] = []
        # tensor mode: key -> (tensor captured, its version) of the ``_batch`` entries that are
        # held tensors or learning copies (see ``copies.TensorKeeper``), read by the step's end
        self._batch_held: dict[str, tuple[torch.Tensor, int]] = {}
        self._learned = False  # learning copies were checked this step (see ``TensorKeeper``)
        # index rows that need no data written first (repeats, non-tensors): one write per
        # flush instead of one write and flush() per entry; the reader orders entries itself
        self._lines: list[tuple] = []  # (as add_finite_row's)
        self._unchecked_lines: list[IndexRow | tuple] = []
        self._stats_bytes = 0
        # producer side: the CUDA streams with copies queued since the last fence; consumer side:
        # whether a copy handled since the last fence may not have landed (nothing is read then)
        self._unfenced: set[StreamKey] = set()
        self._unfenced_bytes = 0
        self._awaiting_fence = False
        # inline: the backlog is worked through in the forward thread at step ends (and every
        # ``wake_bytes``) instead of by a thread; see ``inline_writer`` in capture.py for when
        self._thread: threading.Thread | None = None
        self.closing = False  # close() was called: nothing more is queued
        if not inline:
            self._thread = threading.Thread(target=self._loop, name="llmflow-dump-writer", daemon=True)
            _THREADED.add(self)
            self._thread.start()

    # -- producer side (forward thread) --------------------------------------------------------
    def submit(self, row: IndexRow, payload: Any = None, event: Any = None, nbytes: int = 0) -> None:
        """Queue one row with data (see the module docstring for ``payload``)."""
        if self._error is not None:
            self._raise_error()
            return  # reported already: nothing more is queued for a writer that has failed
        if type(event) is int and self._thread is None and row.has_data is False:
            # a held tensor of a statistics dump, written inline: straight into the statistics
            # batch the next flush reads, as ``_handle`` would put it (no queue item: ~2 us of
            # the forward thread's time a tensor); the batch's size bounds it as the queue's would
            self._stats.append((row, payload, (payload, event)))
            self._stats_bytes += nbytes
            if self._stats_bytes >= self.batch_bytes:
                self._fence()
                self._drain_inline()  # (a fence passed here flushes the batch)
                if self._stats and not self._awaiting_fence and self._error is None:
                    self._flush()
            return
        if self._thread is None and not self._queue and (payload is None or row.has_data) \
                and (event is None or type(event) is int):
            # a host copy, a held tensor of a tensor dump, or a repeat, written inline with nothing
            # queued before it (every tensor of a tensor dump once the dump holds or on the CPU):
            # straight into the data batch, as ``_handle`` puts it, without the queue item and the
            # drain's dispatch (~2 us a tensor; a held tensor is read by the step's end either way)
            self._take_data(row, payload, None if event is None else (payload, event), nbytes)
            return
        self._queue.append((row, payload, event, nbytes))
        stream = event.after if type(event) is Checked else event
        if type(stream) is tuple:  # (a fence every ``wake_bytes`` bounds what waits for one)
            self._unfenced.add(stream)
            self._unfenced_bytes += nbytes
            if self._unfenced_bytes > self.wake_bytes:
                self._fence()
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

    def end_step(self, step: int, order: list[str] | None = None,
                 error: dict[str, Any] | None = None) -> None:
        """End of a step: its data goes into its own file(s) before the next step's. ``error``:
        the step's forward raised (recorded in rank.json at once, see ``DumpSession.end_step``)."""
        if self._error is not None:
            self._raise_error()
            return  # reported already: the dump is abandoned, not continued
        self._hand_over_rows()
        self._fence()
        self._queue.append((_STEP_END, step, (order, error), 0))
        if self._thread is None:  # inline
            self._drain_inline()
            return
        self._notify()
        if error is not None and self._thread is not threading.current_thread():
            # the failure reaches rank.json before the exception leaves the forward (a process
            # that dies of it still tells of it); rare, so waiting for the writer costs nothing
            self._errors_queued += 1
            with self._cond:
                while self._errors_written < self._errors_queued and self._error is None \
                        and self._thread.is_alive():
                    self._cond.wait(0.01)

    def close(self, complete: bool = True, **meta: Any) -> None:
        """Drain the queue, write the last batch, close the files, mark the dump complete.

        From any thread, once (later calls only wait for the first to finish). Called from the
        writer thread itself (a garbage collection there finalized the model whose dump this is),
        the close is queued and the thread finishes it after the item in hand.
        """
        thread = self._thread
        if self.closing:
            if thread is not None and thread is not threading.current_thread():
                thread.join()
            return
        self.closing = True
        if self._error is None:  # (after a failure nothing is written, complete stays false)
            self._hand_over_rows()
            self._fence()
            self._queue.append((_CLOSE, complete, meta, 0))
            if thread is None:  # inline
                self._drain_inline()
            else:
                self._notify()
                if thread is threading.current_thread():
                    return  # _loop handles the close next; _join_at_exit waits for it
                thread.join()
        self._raise_error()

    def _hand_over_rows(self) -> None:
        if self._rows or self._unchecked_rows:
            self._queue.append((_ROWS, self._rows.copy(), self._unchecked_rows.copy(), 0))
            self._rows.clear()
            self._unchecked_rows.clear()

    def _fence(self) -> None:
        if self._unfenced:
            self._queue.append((_FENCE, fence(self._unfenced), None, 0))
            self._unfenced.clear()
            self._unfenced_bytes = 0

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
        finally:
            _THREADED.discard(self)

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
            self._unchecked_lines.extend(item[2])
            return False
        if head is _FENCE:
            for event in item[1]:
                event.synchronize()
            self._awaiting_fence = False
            if self._batch_size >= self.batch_bytes or self._stats_bytes >= self.batch_bytes:
                self._flush()  # (held back for this fence)
            return False
        if head is _STEP_END:
            self._flush(data=time.monotonic() >= self._data_due)
            if self._learned:  # (the step's copies checked, at this flush or earlier ones)
                self._learned = False
                self.keeper.step_checked()
            self._files.clear()
            order, error = item[2]
            if order is not None:
                self.disk.append_order(item[1], order)
            if error is not None:  # on disk now: a process killed later still tells of it
                self.disk.update_rank_meta(errors=[*self.disk.rank_meta.get("errors", ()), error])
                self._errors_written += 1
                with self._cond:
                    self._cond.notify_all()
            return False
        if head is _CLOSE:
            self._flush()
            self.disk.close(complete=item[1], **item[2])
            return True
        row, payload, event, _ = item
        held = None
        if type(event) is int:  # the tensor itself and its version (copies.TensorKeeper)
            held, event = (payload, event), None
        elif type(event) is Checked:  # a learning step's copy, and what it copied
            held, event = (event.original, event.version), event.after
        if type(event) is tuple:  # a copy on a CUDA stream: read after the next fence
            self._awaiting_fence = True
        elif event is not None:
            event.synchronize()  # the asynchronous device copy has landed
        if payload is None or row.has_data:
            self._take_data(row, payload, held, item[3])
        else:  # statistics mode: a copy on the tensor's device
            self._stats.append((row, payload, held))
            self._stats_bytes += payload.nbytes
            if self._stats_bytes >= self.batch_bytes and not self._awaiting_fence:
                self._flush()
        return False

    def _take_data(self, row: IndexRow, payload: Any, held: tuple[torch.Tensor, int] | None,
                   nbytes: int) -> None:
        """A tensor's row and data into the data batch (``held``: the tensor captured and its
        version, where ``payload`` is that tensor or a learning copy of it), or a repeat's row
        (``payload`` None) beside the data it shares."""
        if payload is None:  # a repeat of a tensor of this step
            if row.key in self._files:  # already flushed: point at its file
                self._unchecked_lines.append(row.with_key(f"{self._files[row.key]}:{row.key}"))
            else:  # still in the batch: written with it
                self._batch_rows.append(_held(row))
            return
        self._batch[row.key] = payload
        if held is not None:
            self._batch_held[row.key] = held
        self._batch_rows.append(_held(row))
        self._batch_size += nbytes  # (the tensor's bytes: a payload may be ``bytes``)
        if self._batch_size >= self.batch_bytes and not self._awaiting_fence:
            self._flush()

    def _flush(self, data: bool = True) -> None:
        # paused only inline, in the forward thread: from the writer thread a pause would cover the
        # user's code too, and could end a gc.disable() the user made meanwhile
        with collections_paused() if self._thread is None else nullcontext():
            self._flush_batches(data)

    def _flush_batches(self, data: bool) -> None:
        self._write_lines()
        if self._stats:
            self._flush_stats()
        if self._batch_held:  # every held tensor is read by its step's end, whenever its file is due
            self._read_held()
            self._write_lines()  # (the rows of held tensors found changed: no values)
        if not data:
            return
        if self._batch_rows:
            keys = list(self._batch)
            rows = [r if len(r) == _ROW_LENGTH else (*r, {}) for r in self._batch_rows]  # (see _held)
            # (rows of tensors with data and their repeats: no statistics, no value, no float at all)
            files = self.disk.write_rows(self._batch, rows, finite=True)
            for key in keys:
                self._files[key] = files
            self._data_due = time.monotonic() + self.data_seconds
        self._batch, self._batch_rows, self._batch_size = {}, [], 0

    def _entry_of(self, key: str) -> str:
        """The entry whose data is ``key`` in the batch (for messages: a rare lookup)."""
        row = next((r for r in self._batch_rows if r[_KEY_AT] == key), None)
        return _entry(row) if row is not None else f"tensor {key}"

    def _write_lines(self) -> None:
        if self._lines or self._unchecked_lines:
            self.disk.append_rows(self._unchecked_lines, finite_rows=self._lines)
            self._lines, self._unchecked_lines = [], []

    def _flush_stats(self) -> None:
        entries, self._stats, self._stats_bytes = self._stats, [], 0
        rows, tensors, held_now, checked, originals, lost = [], [], [], [], [], []
        for row, t, held in entries:
            if held is not None:
                original, version = held
                if original._version != version:
                    why = f"{_entry(row)} was changed in place after its capture"
                    self.keeper.found_changed(why)
                    if t is original:  # held: what it was at capture is gone
                        lost.append(_not_stored(row, why))
                        continue
                elif t is not original:  # a learning copy: its values are checked against the tensor's
                    checked.append(len(tensors))
                    originals.append(original)
                else:  # held: read now
                    held_now.append(t)
            rows.append(row)
            tensors.append(t)
        after_default_streams(held_now + originals)
        stats = batched_stats(tensors)
        if originals:
            self._learned = True
            for i, st in zip(checked, batched_stats(originals), strict=True):
                if not _same(st, stats[i]):
                    self.keeper.found_changed(f"{_entry(rows[i])} changed after its capture without its "
                                              "version counter changing (a write outside torch's ops)")
        if self.crc32:  # (the capture gives these rows an ``extra`` dict of their own)
            for row, t in zip(rows, tensors, strict=True):
                row.extra["crc32"] = zlib.crc32(_raw_bytes(t))
        self.disk.append_rows([row.with_stats(st) for row, st in zip(rows, stats, strict=True)] + lost)

    def _read_held(self) -> None:
        """Bring the batch's held tensors to the host, and check the learning copies against the
        tensors they copied; a held tensor changed since its capture is recorded as not stored."""
        held, self._batch_held = self._batch_held, {}
        lost: dict[str, str] = {}
        read = []
        for key, (original, version) in held.items():
            if original._version == version:
                read.append(key)
                continue
            why = f"{self._entry_of(key)} was changed in place after its capture"
            self.keeper.found_changed(why)
            if self._batch[key] is original:
                lost[key] = why
        for key, host in zip(read, to_host([held[k][0] for k in read]), strict=True):
            copy = self._batch[key]
            if copy is held[key][0]:
                self._batch[key] = host
                continue
            self._learned = True
            # (as bytes: a memoryview compares item by item, ~100x slower)
            if bytes(host) != (copy if type(copy) is bytes else _raw_bytes(copy)):
                self.keeper.found_changed(f"{self._entry_of(key)} changed after its capture without its "
                                          "version counter changing (a write outside torch's ops)")
        if lost:
            for key in lost:
                del self._batch[key]
            kept = []
            for r in self._batch_rows:
                if r[_KEY_AT] in lost:  # (its repeats too: they share its data)
                    extra = r[_EXTRA_AT] if len(r) == _ROW_LENGTH else {}
                    row = _not_stored(IndexRow(*r[:_EXTRA_AT], extra), lost[r[_KEY_AT]])
                    self._unchecked_lines.append(row)
                else:
                    kept.append(r)
            self._batch_rows = kept


def _entry(row: IndexRow | tuple) -> str:
    """The entry ``row`` (an IndexRow or a plain tuple in its field order) names, for messages."""
    step, name, kind, index = row[:4]
    return f"{name} {kind} {index} of step {step}"


def _not_stored(row: IndexRow, why: str) -> IndexRow:
    """``row`` without data or statistics, saying why; ``lost``: the reader lists it among the
    dump's problems."""
    return IndexRow(*row[:_STATS_AT], None, False, row.value, row.pytype, row.key,
                    {**row.extra, "not_stored": why, "lost": True})


def _same(a: list[float], b: list[float]) -> bool:
    """Two tensors' statistics are the same (NaN the same as NaN)."""
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


# Why the writer minds the garbage collector: a full collection visits every object of the
# process (~390,000 with torch and transformers loaded, ~0.1-0.5 s), and Python runs one once the
# objects that outlived two young collections add up to a quarter of the old ones. A second of a
# tensor dump is tens of thousands of rows waiting for their data file, and writing it out makes
# tens of thousands more at once: held as tracked objects, they set off a full collection every
# ~35 tokens of a tensor-module dump of SmolLM2. So the writer holds its rows in a form the
# collector stops tracking (``_held``), and, writing inline in the forward thread, pauses
# collections while it writes a batch, whose objects are all gone again before the pause ends.
_ROW_LENGTH = len(ROW_FIELDS)
_EXTRA_AT, _KEY_AT, _STATS_AT = (ROW_FIELDS.index(f) for f in ("extra", "key", "stats"))


def _held(row: IndexRow) -> tuple:
    """``row`` as the writer holds it until its data file is written: a plain tuple, which the
    collector untracks once it holds nothing trackable (a tuple subclass never is), without its
    ``extra`` when that is empty (a dict, even an empty one, keeps its tuple tracked)."""
    return row[:_EXTRA_AT] if not row[_EXTRA_AT] else row[:]


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in memory order (bf16 and friends via a uint8 view)."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@atexit.register
def _join_at_exit() -> None:
    """Wait for writer threads still finishing a close (see the module docstring)."""
    for writer in list(_THREADED):
        if writer.closing and writer._thread is not None:
            writer._thread.join(timeout=600)
