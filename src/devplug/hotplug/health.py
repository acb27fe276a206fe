"""Debounced health: bad news at once, good news only once it has lasted.

A device that turns Unhealthy is reported at once (the kubelet must stop placing pods on it).
A device that recovers is reported Healthy only after it has stayed healthy for the hold-down
time; until then it is still advertised Unhealthy, with a reason saying so. A device that
flaps faster than the hold-down therefore costs the kubelet one update, not one per flap.
Added and removed devices are never held: only health is debounced.

The operator's cordons (:mod:`.cordons`) are applied here too, where the advertised tree is
made, so that every front follows them: a cordoned device is Unhealthy at once, its reason
``cordoned: <reason>``, and once the cordon is lifted it is held down like any device that
recovered. While the cordons cannot be read, every device is held, the reason naming the file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

import structlog

from devplug.model import CORDON_REASON_PREFIX, DeviceInfo, DeviceTree, Health

log = structlog.get_logger(__name__)

_Key = tuple[str, str]
# One resource's edit since the tree gated last: the ids gone or re-read, the ids put in.
_Edit = tuple[frozenset[str], frozenset[str]]
CLOCK_SLACK_S = 0.001


class CordonView(Protocol):
    """What the gate reads of the operator's cordons (:class:`.cordons.CordonBook`)."""

    def reason(self, resource: str, device_id: str) -> str | None: ...

    def keys(self) -> Collection[tuple[str, str]]: ...

    @property
    def blanket(self) -> str | None:
        """Every device's reason to be held (the cordons cannot be read), or None."""
        ...


def _pairs(held: Mapping[str, Mapping[str, DeviceInfo]]) -> list[_Key]:
    return [(resource, device_id) for resource, ids in held.items() for device_id in ids]


class HealthGate:
    """Debounces a tree's health; see the module's docstring.

    A tree that is an edit of the one gated last (:meth:`DeviceTree.edit_since`, a new
    resource counting as added whole) is gated by looking at the edited devices and the
    held-down ones only: every other device is the very same object as last time and not
    held, so it is published as it was, as reported. Any other tree gets a full pass.
    """

    def __init__(
        self,
        hold_down_s: float,
        clock: Callable[[], float] = time.monotonic,
        cordons: CordonView | None = None,
    ) -> None:
        self.hold_down_s = hold_down_s
        self._clock = clock
        self.cordons = cordons
        # The devices cordoned when the gate ran last (a lifted cordon is judged once more),
        # whether every device was held then, and the devices held down since a cordon was
        # lifted (their reason says so).
        self._cordoned: frozenset[_Key] = frozenset()
        self._blanket_last = False
        self._uncordoned: set[_Key] = set()
        self._rejudged: frozenset[_Key] = frozenset()
        self._published: dict[_Key, Health] = {}
        # Devices advertised Unhealthy whose scanner says healthy: since when, and why they
        # were unhealthy (kept in the reason while they are held down).
        self._healthy_since: dict[_Key, float] = {}
        self._last_reason: dict[_Key, str] = {}
        # The scanners' tree gated last (the next one may be an edit of it), what the gate
        # published of it, and the ids it held down then.
        self._last_raw: DeviceTree | None = None
        self._last_gated: DeviceTree | None = None
        self._last_held: dict[str, frozenset[str]] = {}

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
        blanket = self._note_cordons()
        # Every device held, or every device released from that: every device changes.
        edits = None if blanket or self._blanket_last else self._edits_since_last(raw)
        self._blanket_last = blanket
        last_raw, self._last_raw = self._last_raw, raw
        last = self._last_gated
        if edits is None or last is None or last_raw is None:
            held = self._full_pass(raw, now)
            # Only the held-down devices differ from what the scanners reported.
            gated = raw.with_changes(_pairs(held), held) if held else raw
        else:
            held = self._edited_pass(raw, edits, now)
            gated = self._edited_tree(raw, last, last_raw, edits, held)
        self._last_gated = gated
        self._last_held = {resource: frozenset(ids) for resource, ids in held.items()}
        return gated

    def _note_cordons(self) -> bool:
        """Take the cordons as they are now; whether every device is held."""
        cordons = self.cordons
        now = frozenset(cordons.keys()) if cordons is not None else frozenset()
        for key in self._cordoned - now:
            if self._published.get(key) is Health.UNHEALTHY:
                self._uncordoned.add(key)
        # Judged this time: those cordoned now, and those whose cordon was just lifted.
        self._rejudged = self._cordoned | now
        self._cordoned = now
        return cordons is not None and cordons.blanket is not None

    def _edited_tree(
        self,
        raw: DeviceTree,
        last: DeviceTree,
        last_raw: DeviceTree,
        edits: Mapping[str, _Edit],
        held: Mapping[str, Mapping[str, DeviceInfo]],
    ) -> DeviceTree:
        """What to publish of ``raw``, an edit of the scanners' tree gated last (``last_raw``),
        given what was published of that (``last``).

        A resource whose last published map was the scanners' very map, with no device held
        down now, is published as the scanners' map: its edit leads from the map published
        last. Any other is rebuilt from the map published last, so that its edit too leads
        from there: built from the scanners' map instead, its edit would lead from a map the
        kubelet never saw, and whoever keeps something per device published (the ListAndWatch
        message, metrics) would redo every device on every event of a hold-down. (Such a
        resource stays rebuilt until a full scan: the scanners' maps no longer lead from it.)
        The ids that may differ from the map published last are the edited ones and those
        held now or last time; every other id is the scanners' very same object in both.
        """
        involved = held.keys() | self._last_held.keys()
        involved |= {name for name, devices in last.items() if devices is not last_raw.get(name)}
        if not involved:
            return raw
        removed: list[tuple[str, str]] = []
        added: dict[str, dict[str, DeviceInfo]] = {}
        for resource in involved:
            before = last.get(resource, {})
            devices = raw.get(resource, {})
            held_here = held.get(resource, {})
            gone, put = edits.get(resource, (frozenset(), frozenset()))
            ids = set(gone | put)
            ids.update(held_here, self._last_held.get(resource, ()))
            removed.extend((resource, i) for i in ids if i in before)
            rewritten = {i: held_here.get(i, devices[i]) for i in ids if i in devices}
            if rewritten:
                added[resource] = rewritten
        return raw.with_maps_of(last.with_changes(removed, added), involved)

    def _edits_since_last(self, raw: DeviceTree) -> dict[str, _Edit] | None:
        """resource -> (ids gone or re-read, ids put in) since the tree gated last, for the
        resources whose map is not the very same; None when ``raw`` is not an edit of it."""
        last = self._last_raw
        if last is None:
            return None
        edits: dict[str, _Edit] = {}
        for resource, devices in raw.items():
            before = last.get(resource)
            if before is devices:
                continue
            if before is None:
                edits[resource] = (frozenset(), frozenset(devices))
                continue
            edit = raw.edit_since(resource, before)
            if edit is None:
                return None
            edits[resource] = (edit.removed, edit.added)
        for resource in last.keys() - raw.keys():
            edits[resource] = (frozenset(last[resource]), frozenset())
        return edits

    def _full_pass(self, raw: DeviceTree, now: float) -> dict[str, dict[str, DeviceInfo]]:
        """Every device judged; what is not in ``raw`` any more is forgotten."""
        published: dict[_Key, Health] = {}
        held: dict[str, dict[str, DeviceInfo]] = {}
        before = self._published
        for resource, devices in raw.items():
            for device_id, info in devices.items():
                key = (resource, device_id)
                out = self._judge(key, info, before.get(key), now)
                published[key] = out.health
                if out is not info:
                    held.setdefault(resource, {})[device_id] = out
        # Removed devices are forgotten: if they come back, they start afresh.
        for key in self._healthy_since.keys() - published.keys():
            del self._healthy_since[key]
        for key in self._last_reason.keys() - published.keys():
            del self._last_reason[key]
        self._uncordoned &= published.keys()
        self._published = published
        return held

    def _edited_pass(
        self, raw: DeviceTree, edits: Mapping[str, _Edit], now: float
    ) -> dict[str, dict[str, DeviceInfo]]:
        """The edited devices and the held-down ones judged; the others are as last time."""
        published = self._published
        for resource, (removed, added) in edits.items():
            for device_id in removed - added:
                key = (resource, device_id)
                # Removed devices are forgotten: if they come back, they start afresh.
                published.pop(key, None)
                self._healthy_since.pop(key, None)
                self._last_reason.pop(key, None)
                self._uncordoned.discard(key)
        judged = {(resource, i) for resource, (_, added) in edits.items() for i in added}
        judged.update(self._healthy_since)
        judged.update(self._rejudged)
        held: dict[str, dict[str, DeviceInfo]] = {}
        for key in judged:
            resource, device_id = key
            info = raw.get(resource, {}).get(device_id)
            if info is None:
                continue  # a cordoned device that is not there
            out = self._judge(key, info, published.get(key), now)
            published[key] = out.health
            if out is not info:
                held.setdefault(resource, {})[device_id] = out
        return held

    def _judge(self, key: _Key, info: DeviceInfo, before: Health | None, now: float) -> DeviceInfo:
        """What to publish of one device the scanner reports as ``info``, given what was
        published of it before: ``info`` itself, or it held down (Unhealthy) for a while."""
        resource, device_id = key
        info = self._cordoned_info(key, info)
        health = info.health
        if health is Health.UNHEALTHY:
            self._uncordoned.discard(key)
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
            return info
        if before is not Health.UNHEALTHY:
            return info
        since = self._healthy_since.setdefault(key, now)
        # (The loop's timers may fire a clock tick early: allow for it.)
        if now - since >= self.hold_down_s - CLOCK_SLACK_S:
            del self._healthy_since[key]
            self._last_reason.pop(key, None)
            self._uncordoned.discard(key)
            log.info(
                "device.health.changed",
                resource=resource,
                device=device_id,
                health=health.value,
                reason=f"healthy for {self.hold_down_s:g}s",
            )
            return info
        if since == now:
            log.info(
                "device.health.held",
                resource=resource,
                device=device_id,
                hold_down_s=self.hold_down_s,
            )
        if key in self._uncordoned:
            reason = f"uncordoned; held down until healthy for {self.hold_down_s:g}s"
        else:
            cause = self._last_reason.get(key) or "unhealthy"
            reason = f"{cause}; recovered, held down until healthy for {self.hold_down_s:g}s"
        return dataclasses.replace(info, health=Health.UNHEALTHY, health_reason=reason)

    def _cordoned_info(self, key: _Key, info: DeviceInfo) -> DeviceInfo:
        """``info`` as the cordons have it: Unhealthy with their reason (the scanner's, if it
        has one, after it) when the device is cordoned or every device is held."""
        cordons = self.cordons
        if cordons is None:
            return info
        reason = cordons.blanket
        if reason is None:
            cordon = cordons.reason(*key)
            if cordon is None:
                return info
            reason = f"{CORDON_REASON_PREFIX}{cordon}"
        if not info.healthy and info.health_reason:
            reason = f"{reason}; {info.health_reason}"
        return dataclasses.replace(info, health=Health.UNHEALTHY, health_reason=reason)
