"""How a resource server says that it waits for a kubelet.

A daemon started before the kubelet, or left behind by one that went away, waits without
end. One line when the wait begins is easy to miss in a log read hours later, and one line
per check would flood it: the wait is said at once, then again at a slowing, bounded pace
(``kubelet.waiting`` with ``waited_s``), and the registration that ends it says how long it
lasted (``kubelet.register.complete`` with ``waited_s``).
"""

from __future__ import annotations

import time
from typing import Any

from devplug._kits.backoff import Backoff


class KubeletWait:
    """One server's wait for a kubelet: said at once, again after ``first_reminder_s``, then
    at doubling intervals up to ``max_reminder_s``; how long it lasted is said when the server
    registers (``waited_s``)."""

    def __init__(self, first_reminder_s: float, max_reminder_s: float) -> None:
        self._reminders = Backoff(first_reminder_s, max_reminder_s, jitter=False)
        self._since: float | None = None
        self._reason: str | None = None
        self._remind_at = 0.0
        # How long the last wait lasted, until a registration says so.
        self.waited_s: float | None = None

    def note(self, logger: Any, reason: str, directory: str) -> float:
        """Still no kubelet, for ``reason``: log what is due; the seconds until the next
        reminder (the caller wakes up for it)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            self._remind_at = now + self._reminders.next()
        if reason != self._reason:
            self._reason = reason
            if reason != "dir missing":  # the dir watcher says that one
                logger.info("kubelet.waiting", dir=directory, reason=reason)
        elif now >= self._remind_at:
            logger.info(
                "kubelet.waiting",
                dir=directory,
                reason=reason,
                waited_s=round(now - self._since, 1),
            )
            self._remind_at = now + self._reminders.next()
        return self._remind_at - now

    def over(self) -> None:
        """The kubelet's socket is there: the wait is over (registration follows)."""
        if self._since is not None:
            self.waited_s = time.monotonic() - self._since
        self._since = self._reason = None
        self._reminders.reset()

    def said(self) -> None:
        """A registration said how long the wait lasted."""
        self.waited_s = None
