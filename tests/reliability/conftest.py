"""The reliability suite: CI runs the short versions; ``DEVPLUG_RELIABILITY_LONG=1`` runs the
long ones the issue names (100 kubelet restarts, 10,000 fuzzed RPC cases, ...)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

LONG = os.environ.get("DEVPLUG_RELIABILITY_LONG", "") not in ("", "0")


@pytest.fixture
def scaled() -> Callable[[int, int], int]:
    """``scaled(short, long)``: ``long`` under DEVPLUG_RELIABILITY_LONG=1, else ``short``."""

    def pick(short: int, long: int) -> int:
        return long if LONG else short

    return pick
