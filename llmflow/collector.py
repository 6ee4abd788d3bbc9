"""Pauses of Python's garbage collector around work that makes many objects at once, none of
them in a reference cycle.

A full collection visits every object of the process: ~200,000-390,000 with torch and
transformers loaded, 0.1-0.5 s. Python runs one once the objects that outlived two young
collections add up to a quarter of the old ones, so work that makes tens of thousands of
long-lived objects in a burst (a dump writer putting a batch on disk, a reader parsing an
index of ~24,000 entries) sets off full collections that find nothing to free: two per SmolLM2
index read, half of its time. Paused, the burst's objects are looked at once, by the next
collection after the pause.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collections_paused() -> Iterator[None]:
    """No garbage collection within. A process that has switched collection off keeps it off.

    Only for work in the thread that owns the moment: from a background thread a pause would
    cover the user's code too, and could end a ``gc.disable()`` the user made meanwhile."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
