"""No garbage collection while a save captures its states (``collections_paused``).

Why: a capture makes thousands of short-lived containers at once (a metrics state's nested dicts,
their converted copy, the flattened structure) that stay alive until ``save()`` returns. Each
young collection that runs meanwhile moves the survivors a generation up, and CPython starts a
full collection -- which walks every object of the process: a 0.4 s pause for an RLlib driver
holding a 30k-row replay buffer -- once enough objects have arrived in the oldest generation.
With collections paused for the ~15 ms of a save, these containers are freed by their reference
counts before any collection sees them; what the save keeps (a capture's caches) is collected as
usual afterwards. Measured with ``benchmarks/rllib_gc.py``: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Pause the collector for the block (reference counting frees as always); a collector that
    was already off stays off. Nested and concurrent blocks are safe: only a block that found
    it on turns it back on."""
    was_on = gc.isenabled()
    if was_on:
        gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
