"""Logging an event that a client can repeat at its own rate, at a bounded rate.

A local client can send thousands of refused requests a second; one line each would fill a
node's disk. :class:`RepeatLog` lets the first occurrence of an event be logged in full at
once; the ones after it are counted, and one summary line per interval gives their number
(``repeated``) and the last one's fields. An interval without any ends the episode: the next
occurrence is logged in full again. Counting in the metrics is the caller's and is untouched.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class _Episode:
    level: str
    timer: asyncio.TimerHandle
    repeated: int = 0
    fields: dict[str, object] = field(default_factory=dict)


class RepeatLog:
    """Per event name: the first in full, then at most one summary line per ``interval_s``."""

    def __init__(self, logger: Any, interval_s: float) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._episodes: dict[str, _Episode] = {}

    def admit(self, event: str, level: str = "warning", **fields: object) -> bool:
        """True: log this occurrence yourself, in full. False: it was counted, and the summary
        ``event`` line (at ``level``, with ``fields``) comes at the end of the interval."""
        episode = self._episodes.get(event)
        if episode is None:
            timer = asyncio.get_running_loop().call_later(self.interval_s, self._summarise, event)
            self._episodes[event] = _Episode(level, timer)
            return True
        episode.repeated += 1
        episode.level = level
        episode.fields = fields
        return False

    def flush(self) -> None:
        """Write the summaries owed now (at stop: none is lost); every episode ends."""
        episodes, self._episodes = self._episodes, {}
        for event, episode in episodes.items():
            episode.timer.cancel()
            self._write(event, episode)

    def _summarise(self, event: str) -> None:
        episode = self._episodes[event]
        if not episode.repeated:
            del self._episodes[event]  # a quiet interval: the next one is news again
            return
        self._write(event, episode)
        episode.repeated = 0
        episode.timer = asyncio.get_running_loop().call_later(
            self.interval_s, self._summarise, event
        )

    def _write(self, event: str, episode: _Episode) -> None:
        if episode.repeated:
            getattr(self._log, episode.level)(
                event,
                **episode.fields,
                repeated=episode.repeated,
                interval_s=self.interval_s,
            )
