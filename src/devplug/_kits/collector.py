"""Keeping what a daemon holds for long out of the garbage collector's automatic passes.

A full collection walks every object the collector tracks except the frozen ones
(:func:`gc.freeze`). A daemon with 10,000 devices holds ~300,000 such objects for as long as
the devices stay (the device tree, the CDI specs rendered from it, the scanners' indexes),
and a full collection over them held the event loop for 50-240 ms inside whatever hotplug
event it met. Frozen, they are left out: the automatic passes walk only what was made since.

A frozen object is still freed when nothing refers to it any more (a removed device, a tree
that the next full scan replaced), but never by the collector: one that ends up in a
reference cycle would stay for good. :func:`settle` therefore thaws everything, collects,
and freezes again: each settle finds all garbage, whenever it was frozen, and pays one full
collection at a time its caller picks (a quiet one).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

__all__ = ["Settled", "settle"]


@dataclass(frozen=True, slots=True)
class Settled:
    """What one :func:`settle` did."""

    collected: int  # unreachable objects the collection found
    frozen: int  # objects frozen after it (what later automatic passes leave out)
    seconds: float  # the collection's time (the thaw and the freeze cost next to nothing)


def settle() -> Settled:
    """Thaw, collect everything, freeze what is left. Blocks for one full collection over
    every tracked object (~50-250 ms with 10,000 devices on these machines, a few ms with
    none): call it when nothing waits on the caller."""
    started = time.perf_counter()
    gc.unfreeze()
    collected = gc.collect()
    gc.freeze()
    return Settled(collected, gc.get_freeze_count(), time.perf_counter() - started)
