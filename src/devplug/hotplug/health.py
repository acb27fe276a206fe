"""Debounced health: bad news at once, good news only once it has lasted.

A device that turns Unhealthy is reported at once (the kubelet must stop placing pods on it).
A device that recovers is reported Healthy only after it has stayed healthy for the hold-down
time; until then it is still advertised Unhealthy, with a reason saying so. A device that
flaps faster than the hold-down therefore costs the kubelet one update, not one per flap.
Added and removed devices are never held: only health is debounced.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog

from devplug.model import DeviceInfo, DeviceTree, Health

log = structlog.get_logger("devplug.health")

_Key = tuple[str, str]
CLOCK_SLACK_S = 0.001


class HealthGate:
    def __init__(self, hold_down_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_down_s = hold_down_s
        self._clock = clock
        self._published: dict[_Key, Health] = {}
        # Devices advertised Unhealthy whose scanner says healthy: since when, and why they
        # were unhealthy (kept in the reason while they are held down).
        self._healthy_since: dict[_Key, float] = {}
        self._last_reason: dict[_Key, str] = {}

    def now(self) -> float:
        """The gate's clock (``next_deadline`` is in its time)."""
        return self._clock()

    def next_deadline(self) -> float | None:
        """When the earliest held-down device may be published Healthy (clock time), if any."""
        if not self._healthy_since:
            return None
        return min(self._healthy_since.values()) + self.hold_down_s

    def gate(self, raw: DeviceTree) -> DeviceTree:
        """The tree to advertise for the scanners' ``raw`` tree, at the current time."""
        now = self._clock()
        published: dict[_Key, Health] = {}
        out: dict[str, dict[str, DeviceInfo]] = {}
        changed = False
        for resource, devices in raw.items():
            gated = dict(devices)
            for device_id, info in devices.items():
                key = (resource, device_id)
                before = self._published.get(key)
                health = info.health
                if health is Health.UNHEALTHY:
                    self._healthy_since.pop(key, None)
                    self._last_reason[key] = info.health_reason
                    if before is not Health.UNHEALTHY:
                        # New devices too: an operator wants to know why one is not usable.
                        log.warning(
                            "device.health.changed",
                            resource=resource,
                            device=device_id,
                            health=health.value,
                            reason=info.health_reason or "reported by the scanner",
                        )
                elif before is Health.UNHEALTHY:
                    since = self._healthy_since.setdefault(key, now)
                    # (The loop's timers may fire a clock tick early: allow for it.)
                    if now - since >= self.hold_down_s - CLOCK_SLACK_S:
                        del self._healthy_since[key]
                        self._last_reason.pop(key, None)
                        log.info(
                            "device.health.changed",
                            resource=resource,
                            device=device_id,
                            health=health.value,
                            reason=f"healthy for {self.hold_down_s:g}s",
                        )
                    else:
                        health = Health.UNHEALTHY
                        cause = self._last_reason.get(key) or "unhealthy"
                        gated[device_id] = dataclasses.replace(
                            info,
                            health=health,
                            health_reason=(
                                f"{cause}; recovered, held down until healthy for "
                                f"{self.hold_down_s:g}s"
                            ),
                        )
                        if since == now:
                            log.info(
                                "device.health.held",
                                resource=resource,
                                device=device_id,
                                hold_down_s=self.hold_down_s,
                            )
                published[key] = health
                changed = changed or health is not info.health
            out[resource] = gated
        # Removed devices are forgotten: if they come back, they start afresh.
        for key in self._healthy_since.keys() - published.keys():
            del self._healthy_since[key]
        for key in self._last_reason.keys() - published.keys():
            del self._last_reason[key]
        self._published = published
        return DeviceTree(out) if changed else raw
