"""Allocate's default answers, kept encoded: a request seen before is answered from here.

Keyed by the request's bytes and valid for one device snapshot and one state of the answer
extension (which CDI specs are on disk); the cache empties when either changes, and when the
hooks are bound again. Bounded in count and bytes, so any local client can fill it only so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from devplug.model import DeviceMap

# A node has at most a few thousand distinct id lists in use, and their answers a few hundred
# bytes each; one cache fills at 4,096 answers or 4 MiB (keys included).
MAX_CACHED_ANSWERS = 4096
MAX_CACHED_ANSWER_BYTES = 4 * 1024 * 1024
MAX_LOGGED_IDS = 32


def loggable(requests: Sequence[Sequence[str]]) -> object:
    """The requested ids for a log line, summarised when a request is unusually large."""
    total = sum(len(ids) for ids in requests)
    if total <= MAX_LOGGED_IDS:
        return requests
    return f"{total} ids in {len(requests)} containers"


class Answer(NamedTuple):
    """An Allocate answer as sent (an encoded AllocateResponse) and its ids as logged."""

    encoded: bytes
    logged: object


class AnswerCache:
    """request bytes -> Answer, for one (device snapshot, extension generation)."""

    def __init__(self) -> None:
        self.entries: dict[bytes, Answer] = {}
        self.size = 0  # bytes of keys and answers
        # The (snapshot, generation) the entries were made under; None: none yet.
        self._made_under: tuple[DeviceMap, int] | None = None

    @property
    def state(self) -> object:
        """What an answer about to be made is made under: pass it back to :meth:`keep`."""
        return self._made_under

    def lookup(self, raw: bytes, devices: DeviceMap, generation: int) -> Answer | None:
        """The answer to the request encoded as ``raw`` under ``devices`` and ``generation``;
        a lookup under anything else empties the cache first."""
        made_under = self._made_under
        if made_under is None or made_under[0] is not devices or made_under[1] != generation:
            self.entries.clear()
            self.size = 0
            self._made_under = (devices, generation)
            return None
        return self.entries.get(raw)

    def keep(self, raw: bytes, answer: Answer, state: object) -> None:
        """Keep ``answer`` to ``raw`` if the state it was made under (:attr:`state` before it
        was made) still holds, and it fits."""
        if state is not self._made_under:
            return
        size = len(raw) + len(answer.encoded)
        if len(self.entries) < MAX_CACHED_ANSWERS and self.size + size <= MAX_CACHED_ANSWER_BYTES:
            self.entries[raw] = answer
            self.size += size

    def invalidate(self) -> None:
        """The answers no longer hold (the hooks changed): the next lookup starts afresh."""
        self._made_under = None
