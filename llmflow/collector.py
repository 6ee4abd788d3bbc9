"""Pauses of Python's garbage collector around work that makes many objects at once, none of
them in a reference cycle.

A full collection visits every object of the process: ~200,000-390,000 with torch and
transformers loaded, 0.1-0.5 s. Python runs one once the objects that outlived two young
collections add up to a quarter of the old ones, so work that makes tens of thousands of
long-lived objects in a burst (a dump writer putting a batch on disk, a reader parsing an
index of ~24,000 entries) sets off full collections that find nothing to free: two per SmolLM2
index read, half of its time. Paused, the burst's objects are looked at once, by the next
collection after the pause.

A dump's step is the other case: each recorded entry's row (and, for a copy, its tensor and
queue item) lives until the step ends, so the thousands of entries of an API-mode step count
towards a young collection every ~700 of them. Those collections find nothing to free and, by
moving the step's objects to older generations, bring on middle collections that do the same:
SmolLM2's statistics API dump ran ~4 young and 0.4 middle collections a step (~1 ms of it), its
tensor API dump ~2 ms. ``defer_young_collections`` raises the young threshold for the step
instead of switching collection off, so it stays a setting the user's code may change meanwhile.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# the young generation's threshold while a step records (net new objects before a collection): a
# step of a 70B model's API dump makes ~10,000 entries; beyond this one, collections run again
DEFERRED_YOUNG_THRESHOLD = 1_000_000


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


def defer_young_collections() -> tuple[int, ...] | None:
    """Raise the young generation's threshold (``DEFERRED_YOUNG_THRESHOLD``) until
    ``resume_young_collections`` with what this returns: the thresholds before, or None where
    nothing was changed (collection switched off by a threshold of 0, or deferred already).

    Collection stays on: cyclic garbage made meanwhile waits for the first collection after the
    resume, and a process that switched collection off keeps it off."""
    before = gc.get_threshold()
    if before[0] == 0 or before[0] >= DEFERRED_YOUNG_THRESHOLD:
        return None
    gc.set_threshold(DEFERRED_YOUNG_THRESHOLD, *before[1:])
    return before


def resume_young_collections(before: tuple[int, ...] | None) -> None:
    """Put back the thresholds ``defer_young_collections`` changed, unless someone has set others
    since (theirs stay)."""
    if before is not None and gc.get_threshold() == (DEFERRED_YOUNG_THRESHOLD, *before[1:]):
        gc.set_threshold(*before)
