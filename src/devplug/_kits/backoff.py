"""Exponential back-off with jitter: the one retry schedule of the daemon."""

from __future__ import annotations

import random


class Backoff:
    """Delays from ``initial`` doubling up to ``maximum``; jittered by +-20 % (``jitter``) so
    that many retrying servers do not retry in lock-step."""

    def __init__(self, initial: float, maximum: float, *, jitter: bool = True) -> None:
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def next(self) -> float:
        """The delay to wait now; the following one doubles (up to ``maximum``)."""
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay * random.uniform(0.8, 1.2) if self.jitter else delay
