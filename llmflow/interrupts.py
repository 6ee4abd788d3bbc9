"""Stopping cleanly: Ctrl-C and SIGTERM reach the main thread, and child processes stop with llmflow.

The kernel hands a process's SIGINT to whichever of its threads it picks; Python runs the handler
(which raises KeyboardInterrupt) in the main thread only, the next time that thread runs Python
code. A main thread blocked in an untimed wait (a queue, a future) therefore sleeps through Ctrl-C
until what it waits for arrives on its own, which for a stage or a compare can be minutes.
``wait`` waits in short timed slices instead, so the handler runs within one slice.

SIGTERM (what ``timeout``, Slurm and Kubernetes send) is handled like Ctrl-C:
``sigterm_as_interrupt`` makes it raise ``Terminated``, a ``KeyboardInterrupt``, so every path
that cleans up after Ctrl-C cleans up after it too; the CLI then exits 143 (128 + SIGTERM).

Child processes (the dump worker, the compare's pool workers) must not outlive llmflow: one may
hold an accelerator's memory. ``started``/``finished`` keep the live ones so ``stop_children``
can end them when llmflow is interrupted, and each child calls ``die_with_parent`` first thing so
that even a ``kill -9`` of llmflow takes it down (Linux's parent-death signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
SLICE_S = 0.2  # how late Ctrl-C may be seen; a timed-out slice costs a few microseconds
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, what shells report for a process ended by SIGTERM
PARENT_PID_ENV = "LLMFLOW_PARENT_PID"  # the pid a child process must die with (die_with_parent)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop as for Ctrl-C (a KeyboardInterrupt, so the same cleanup runs)."""


def wait(get: Callable[[float], T], timed_out: type[BaseException] | tuple[type[BaseException], ...]) -> T:
    """``get(timeout)`` again and again until it returns; ``timed_out`` is what it raises when a
    slice passes with nothing (``queue.Empty``, ``concurrent.futures.TimeoutError``)."""
    while True:
        try:
            return get(SLICE_S)
        except timed_out:
            continue


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block SIGTERM raises ``Terminated`` in the main thread, once: a second SIGTERM
    while llmflow cleans up after the first is ignored (SIGKILL still ends it). The handler that
    was there before is put back at the end. Outside the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def signals_held():
    """Inside the block, SIGINT and SIGTERM wait until it ends (a few renames that must all happen
    or none); the main thread's handler runs right after."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()


def started(proc: subprocess.Popen) -> None:
    """Remember a child process until ``finished``: ``stop_children`` ends it on an interrupt."""
    with _children_lock:
        _children.add(proc)


def finished(proc: subprocess.Popen) -> None:
    with _children_lock:
        _children.discard(proc)


def stop_children(grace_s: float = 5.0) -> None:
    """End every live child process: SIGTERM, then SIGKILL after ``grace_s``; waits for each."""
    with _children_lock:
        procs = list(_children)
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        finished(proc)


def child_env() -> dict[str, str]:
    """The environment entry a child process passes to ``die_with_parent``: this process's pid."""
    return {PARENT_PID_ENV: str(os.getpid())}


def die_with_parent(parent_pid: int | None = None) -> None:
    """In a child process: be killed when the parent process dies, even by SIGKILL. Linux only
    (PR_SET_PDEATHSIG); elsewhere nothing. ``parent_pid`` (default: $LLMFLOW_PARENT_PID) closes the
    race where the parent died before this call: then this process exits now."""
    if parent_pid is None:
        text = os.environ.pop(PARENT_PID_ENV, "")  # not inherited by this process's own children
        parent_pid = int(text) if text.isdigit() else None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(EXIT_TERMINATED)  # the parent is gone already; nothing may run on
