"""Logging an event that a client can repeat at its own rate, at a bounded rate.

A local client can send thousands of refused requests a second; one line each would fill a
node's disk. :class:`RepeatLog` keeps one episode per event name and caller-given category (a
small fixed set, such as a refusal's kind: never text a client chooses). In an episode, the
first few distinct occurrences (their fields compared by value) are logged in full at once;
one that repeats is counted, and one summary line per interval gives its count (``repeated``).
Past :data:`DISTINCT_PER_EPISODE` distinct ones, the rest are counted together on one more
line, with the last one's fields and ``other_reasons=True``. So a flood cannot hide a
different occurrence behind it (a kubelet's genuine refusal among a client's bogus ones is
logged when it comes, and counted apart), and a flood of ever-different fields (ids varied on
purpose) still makes at most ``2 * DISTINCT_PER_EPISODE + 1`` lines per interval per episode.
A distinct occurrence quiet for a whole interval frees its place; an interval with no
occurrence at all ends the episode, and the next occurrence is news again. Counting in the
metrics is the caller's and is untouched.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

# Distinct occurrences an episode logs in full and counts apart.
DISTINCT_PER_EPISODE = 3


@dataclass(slots=True)
class _Seen:
    """One distinct occurrence of an episode: its fields, and what came since its last line."""

    fields: dict[str, object]
    repeated: int = 0  # occurrences after the one logged in full or summed up last
    active: bool = True  # it came in the current interval


@dataclass(slots=True)
class _Episode:
    level: str
    timer: asyncio.TimerHandle
    seen: dict[str, _Seen] = field(default_factory=dict)  # keyed by the fields, by value
    others: int = 0  # occurrences past the distinct ones kept, this interval
    other_fields: dict[str, object] = field(default_factory=dict)  # the last of those


class RepeatLog:
    """Per event name and category: a few distinct occurrences in full, the rest counted,
    with at most one summary line per distinct occurrence (and one for the others) per
    ``interval_s``."""

    def __init__(self, logger: Any, interval_s: float) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._episodes: dict[tuple[str, str], _Episode] = {}

    def admit(
        self, event: str, level: str = "warning", category: str = "", **fields: object
    ) -> bool:
        """True: log this occurrence yourself, in full (it is news). False: it was counted,
        and the summary ``event`` line (at ``level``) comes at the end of the interval.
        ``category`` (for example a refusal's kind) keeps its own episode: it must come from
        a small fixed set, never from what a client sent."""
        key = (event, category)
        episode = self._episodes.get(key)
        if episode is None:
            timer = asyncio.get_running_loop().call_later(self.interval_s, self._summarise, key)
            episode = self._episodes[key] = _Episode(level, timer)
        episode.level = level
        shape = repr(sorted(fields.items()))
        seen = episode.seen.get(shape)
        if seen is not None:
            seen.repeated += 1
            seen.active = True
            return False
        if len(episode.seen) < DISTINCT_PER_EPISODE:
            episode.seen[shape] = _Seen(dict(fields))
            return True
        episode.others += 1
        episode.other_fields = dict(fields)
        return False

    def flush(self) -> None:
        """Write the summaries owed now (at stop: none is lost); every episode ends."""
        episodes, self._episodes = self._episodes, {}
        for (event, _), episode in episodes.items():
            episode.timer.cancel()
            self._write(event, episode)

    def _summarise(self, key: tuple[str, str]) -> None:
        episode = self._episodes[key]
        if not episode.others and not any(seen.active for seen in episode.seen.values()):
            del self._episodes[key]  # a quiet interval: the next one is news again
            return
        self._write(key[0], episode)
        # A distinct occurrence quiet for the interval frees its place for the next news.
        episode.seen = {shape: seen for shape, seen in episode.seen.items() if seen.active}
        for seen in episode.seen.values():
            seen.repeated = 0
            seen.active = False
        episode.others = 0
        episode.timer = asyncio.get_running_loop().call_later(self.interval_s, self._summarise, key)

    def _write(self, event: str, episode: _Episode) -> None:
        write = getattr(self._log, episode.level)
        for seen in episode.seen.values():
            if seen.repeated:
                write(event, **seen.fields, repeated=seen.repeated, interval_s=self.interval_s)
        if episode.others:
            write(
                event,
                **episode.other_fields,
                repeated=episode.others,
                other_reasons=True,
                interval_s=self.interval_s,
            )
