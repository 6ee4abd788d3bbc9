"""Waiting in the main thread without sleeping through Ctrl-C.

The kernel hands a process's SIGINT to whichever of its threads it picks; Python runs the handler
(which raises KeyboardInterrupt) in the main thread only, the next time that thread runs Python
code. A main thread blocked in an untimed wait (a queue, a future) therefore sleeps through Ctrl-C
until what it waits for arrives on its own, which for a stage or a compare can be minutes.
``wait`` waits in short timed slices instead, so the handler runs within one slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
SLICE_S = 0.2  # how late Ctrl-C may be seen; a timed-out slice costs a few microseconds


def wait(get: Callable[[float], T], timed_out: type[BaseException] | tuple[type[BaseException], ...]) -> T:
    """``get(timeout)`` again and again until it returns; ``timed_out`` is what it raises when a
    slice passes with nothing (``queue.Empty``, ``concurrent.futures.TimeoutError``)."""
    while True:
        try:
            return get(SLICE_S)
        except timed_out:
            continue
