"""50 concurrent Allocate callers while the hardware changes underneath.

The daemon runs in this process on kernel uevents from a umockdev testbed. Each round, 50
Allocate calls (spread over the two resources' sessions) race with hotplug (GPUs and USB serial
adapters added and removed, with their uevents) and health flips (a device node deleted or
restored, then a change event). Every call is recorded with the ids asked, the answer or the
gRPC error, and when it was sent and answered; the simulator records every ListAndWatch list
with its arrival time. CI runs a few rounds; DEVPLUG_RELIABILITY_LONG=1 runs many more.

What "advertised at that moment" means is decided from causality, never from a timing guess:

* a list received before a call was sent was produced by the daemon before the call reached
  it, so the daemon's view at the call is that list or a newer one;
* ids are never reused (removed devices stay removed), and a device's node is flipped again
  only once a list has shown the daemon noticed the previous flip (lockstep), so a list shows
  which flip it reflects.

From that, an answer is wrong when it names an id never listed Healthy before the answer came,
an id whose removal a list had shown before the call was sent, or an id a list had shown
Unhealthy (after its node went) before the call was sent while the node stayed away until the
answer. A refusal is wrong unless its code is NOT_FOUND or INVALID_ARGUMENT, it names
requested ids, and each id it names is bogus, removed, unhealthy or duplicated by then.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from devplug.config import HotplugSettings
from devplug.model import ContainerAllocation
from devplug.scanners.generic import GenericScanner
from devplug.scanners.udev import UdevSource
from devplug.testing import KubeletSimulator, daemon_settings, running_daemon
from devplug.testing.simulator import ListedDevice, PluginSession, SimulatorRpcError
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_usb_serial

SERIAL = "example.com/serial"
RENDER = "example.com/render"
ENTRIES: list[dict[str, Any]] = [
    {"resource": SERIAL, "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB*"}},
    {"resource": RENDER, "match": {"subsystem": "drm", "devnode": "/dev/dri/renderD*"}},
]
CALLERS = 50
MUTATIONS_PER_ROUND = 3
RENDER_BASE = 3000  # render minors far above the card minors
USB_HUB = "/sys/devices/pci0000:00/0000:00:14.0/usb1"
MAX_USB_INDEX = 125  # add_usb_serial's limit: ids are never reused, so adds stop there
# Ids that are never advertised: refused (NOT_FOUND) whenever asked.
BOGUS = {
    SERIAL: ("ttyUSB999", "ttyS0", "no-such-device"),
    RENDER: ("dri_renderD99999", "dri_card0", "no-such-device"),
}
ALLOWED_CODES = frozenset({"NOT_FOUND", "INVALID_ARGUMENT"})
WAIT_S = 30.0  # generous: a loaded 2-core CI machine


@dataclass
class Device:
    """One device the test put on the host, and what the test did to it (perf_counter times)."""

    resource: str
    device_id: str
    top: str  # what remove_device() takes (the PCI function, the USB device)
    node_sys_path: str  # the device owning the /dev node (render minor, tty)
    host_node: str  # the node Allocate must answer with
    added_at: float
    removed_at: float | None = None
    node_present: bool = True
    # Every node flip: (time, present), in order.
    flips: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def last_change(self) -> float:
        return self.flips[-1][0] if self.flips else self.added_at


@dataclass
class Call:
    """One Allocate: what was asked, when, and what came back."""

    resource: str
    ids: tuple[str, ...]
    sent_at: float
    answered_at: float = 0.0
    answer: ContainerAllocation | None = None
    code: str | None = None
    details: str = ""


def received_by(session: PluginSession, moment: float) -> int:
    """How many lists the simulator had received by ``moment``."""
    return bisect.bisect_right(session.update_times, moment)


def listed_with(listed: dict[str, ListedDevice], device_id: str, health: str) -> bool:
    device = listed.get(device_id)
    return device is not None and device.health == health


def acknowledged(session: PluginSession, device: Device) -> bool:
    """A list received after the device's last change shows the daemon noticed it."""
    want = "Healthy" if device.node_present else "Unhealthy"
    start = received_by(session, device.last_change)
    return any(listed_with(listed, device.device_id, want) for listed in session.updates[start:])


class World:
    """The testbed's devices and the mutations the test makes to them."""

    def __init__(self, host: UmockdevHost, rng: random.Random) -> None:
        self.host = host
        self.rng = rng
        self.devices: dict[str, Device] = {}  # every device ever added, by id
        self.next_gpu = 0
        self.next_serial = 0
        self.sessions: dict[str, PluginSession] = {}
        self.mutations: list[str] = []

    def present(self, resource: str) -> list[Device]:
        return [d for d in self.devices.values() if d.resource == resource and d.removed_at is None]

    def removed_ids(self, resource: str) -> list[str]:
        return [
            d.device_id
            for d in self.devices.values()
            if d.resource == resource and d.removed_at is not None
        ]

    # ------------------------------------------------------------------ building

    def add_gpu(self) -> tuple[Device, list[str]]:
        index = self.next_gpu
        self.next_gpu += 1
        bus, slot = divmod(index, 32)
        render = RENDER_BASE + index
        added_at = time.perf_counter()
        pci = add_intel_gpu(
            self.host, f"0000:{bus + 1:02x}:{slot:02x}.0", card=index, render=render
        )
        device = Device(
            RENDER,
            f"dri_renderD{render}",
            pci,
            f"{pci}/drm/renderD{render}",
            f"/dev/dri/renderD{render}",
            added_at,
        )
        self.devices[device.device_id] = device
        return device, [pci, f"{pci}/drm/card{index}", device.node_sys_path]

    def add_serial(self) -> tuple[Device, list[str]]:
        index = self.next_serial
        self.next_serial += 1
        before = set(self.host.devices)
        added_at = time.perf_counter()
        tty = add_usb_serial(self.host, index=index)
        new = [path for path in self.host.devices if path not in before]  # parents first
        device = Device(
            SERIAL,
            f"ttyUSB{index}",
            f"{USB_HUB}/1-{index + 1}",
            tty,
            f"/dev/ttyUSB{index}",
            added_at,
        )
        self.devices[device.device_id] = device
        return device, new

    # ------------------------------------------------------------------ mutations

    async def mutate(self) -> None:
        """One random change of the host, with its uevents."""
        options: list[Callable[[], Awaitable[None]]] = []
        gpus, serials = self.present(RENDER), self.present(SERIAL)
        if len(gpus) < 12:
            options.append(self._plug_gpu)
        if len(gpus) > 3:
            options.append(functools.partial(self._unplug, gpus))
        if len(serials) < 8 and self.next_serial <= MAX_USB_INDEX:
            options.append(self._plug_serial)
        if len(serials) > 2:
            options.append(functools.partial(self._unplug, serials))
        for resource, present in ((RENDER, gpus), (SERIAL, serials)):
            ready = [d for d in present if acknowledged(self.sessions[resource], d)]
            if ready:
                # Health flips twice as often as any other change.
                options += [functools.partial(self._flip, ready)] * 2
        await self.rng.choice(options)()

    async def _plug_gpu(self) -> None:
        device, paths = self.add_gpu()
        self.mutations.append(f"add {device.device_id}")
        for path in paths:
            await self.host.emit_async("add", path)

    async def _plug_serial(self) -> None:
        device, paths = self.add_serial()
        self.mutations.append(f"add {device.device_id}")
        for path in paths:
            await self.host.emit_async("add", path)

    async def _unplug(self, present: list[Device]) -> None:
        device = self.rng.choice(present)
        device.removed_at = time.perf_counter()
        self.mutations.append(f"remove {device.device_id}")
        for path in self.host.remove_device(device.top):
            await self.host.emit_async("remove", path)

    async def _flip(self, ready: list[Device]) -> None:
        device = self.rng.choice(ready)
        await self.flip(device, not device.node_present)

    async def flip(self, device: Device, present: bool) -> None:
        device.node_present = present
        device.flips.append((time.perf_counter(), present))
        self.mutations.append(f"{'restore' if present else 'delete'} node of {device.device_id}")
        self.host.set_node_present(device.node_sys_path, present)
        await self.host.emit_async("change", device.node_sys_path)

    # ------------------------------------------------------------------ callers

    def pick(self, resource: str) -> tuple[str, ...]:
        """Ids for one request: mostly listed ones, sometimes bogus, removed or repeated."""
        listed = sorted(self.sessions[resource].latest)
        rng = self.rng
        ids = rng.sample(listed, min(rng.choice((1, 1, 1, 2, 3)), len(listed)))
        roll = rng.random()
        removed = self.removed_ids(resource)
        if roll < 0.1 or not ids:
            ids.append(rng.choice(BOGUS[resource]))
        elif roll < 0.2 and removed:
            ids.append(rng.choice(removed))
        elif roll < 0.25:
            ids.append(ids[0])  # the same id twice in one container
        rng.shuffle(ids)
        return tuple(ids)

    async def call(self, calls: list[Call]) -> None:
        await asyncio.sleep(self.rng.uniform(0, 0.02))  # spread the callers over the mutations
        resource = self.rng.choice((SERIAL, RENDER))
        ids = self.pick(resource)
        record = Call(resource, ids, time.perf_counter())
        calls.append(record)
        try:
            (record.answer,) = await self.sessions[resource].allocate(ids)
        except SimulatorRpcError as exc:
            record.code, record.details = exc.code, exc.details
        record.answered_at = time.perf_counter()

    # ------------------------------------------------------------------ the verdicts

    def check(self, call: Call) -> list[str]:
        """What is wrong with this call's outcome, given the lists and the host's history."""
        session = self.sessions[call.resource]
        problems: list[str] = []
        if call.answer is None:
            return self._check_refusal(call)
        by_answer = session.updates[: received_by(session, call.answered_at)]
        last_before = received_by(session, call.sent_at) - 1
        for device_id in call.ids:
            device = self.devices.get(device_id)
            if device is None or device.resource != call.resource:
                problems.append(f"{device_id} was never on the host")
                continue
            if not any(listed_with(listed, device_id, "Healthy") for listed in by_answer):
                problems.append(f"{device_id} was never listed Healthy before the answer")
            if device.removed_at is not None:
                gone = self._first_list_without(session, device)
                if gone is not None and session.update_times[gone] < call.sent_at:
                    problems.append(f"{device_id}: its removal was listed before the call")
            if last_before >= 0 and listed_with(
                session.updates[last_before], device_id, "Unhealthy"
            ):
                received = session.update_times[last_before]
                deleted = [t for t, present in device.flips if not present and t < received]
                if deleted and not any(
                    present and deleted[-1] < t < call.answered_at for t, present in device.flips
                ):
                    problems.append(
                        f"{device_id}: listed Unhealthy before the call, node away until the answer"
                    )
        wanted = list(
            dict.fromkeys(self.devices[i].host_node for i in call.ids if i in self.devices)
        )
        got = [node.host_path for node in call.answer.nodes]
        if got != wanted:
            problems.append(f"answer nodes {got} != {wanted}")
        return problems

    def _first_list_without(self, session: PluginSession, device: Device) -> int | None:
        """The first list received after the removal that no longer has the device."""
        assert device.removed_at is not None
        start = received_by(session, device.removed_at)
        for index in range(start, len(session.updates)):
            if device.device_id not in session.updates[index]:
                return index
        return None

    def _check_refusal(self, call: Call) -> list[str]:
        problems: list[str] = []
        if call.code not in ALLOWED_CODES:
            return [f"refused with {call.code}: {call.details}"]
        named = set(re.findall(r"'([^']*)'", call.details))
        if not named or not named <= set(call.ids) or call.resource not in call.details:
            problems.append(f"the refusal does not name the requested ids: {call.details!r}")
        duplicated = {i for i in call.ids if call.ids.count(i) > 1}

        def removed(device_id: str) -> bool:
            device = self.devices.get(device_id)
            return (
                device is not None
                and device.removed_at is not None
                and device.removed_at < call.answered_at
            )

        def node_went(device_id: str) -> bool:
            device = self.devices.get(device_id)
            return device is not None and any(
                not present and t < call.answered_at for t, present in device.flips
            )

        for device_id in named:
            if call.code == "NOT_FOUND":
                legitimate = device_id in BOGUS[call.resource] or removed(device_id)
            elif "requested twice" in call.details:
                legitimate = device_id in duplicated
            else:  # unhealthy
                legitimate = node_went(device_id) or removed(device_id)
            if not legitimate:
                problems.append(f"{device_id} refused ({call.code}) without a reason")
        return problems


def exactly(
    devices: list[Device], *, healthy: bool = False
) -> Callable[[dict[str, ListedDevice]], bool]:
    """A list with exactly these devices (and all of them Healthy, with ``healthy``)."""
    ids = {d.device_id for d in devices}

    def matches(listed: dict[str, ListedDevice]) -> bool:
        return set(listed) == ids and (
            not healthy or all(d.health == "Healthy" for d in listed.values())
        )

    return matches


async def settled_allocation(
    world: World, session: PluginSession, resource: str, ids: list[str]
) -> ContainerAllocation:
    """Once the host stops changing, the daemon comes to list exactly its devices, all
    Healthy, and allocates them all together.

    The latest list may lag the daemon by one scan: a node deleted just before the settle's
    restore can still show Healthy in the last list while the daemon is about to see it gone.
    So a refusal is not a verdict: it waits for a newer list and asks again, until the
    daemon converges or WAIT_S runs out (a daemon that never converges fails the test).
    """
    want = exactly(world.present(resource), healthy=True)
    refusals: list[str] = []
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                seen = len(session.updates)
                if want(session.latest):
                    try:
                        (answer,) = await session.allocate(ids)
                    except SimulatorRpcError as exc:
                        refusals.append(exc.details)
                    else:
                        return answer
                await session.wait_for_update(after=seen, timeout=WAIT_S)
    except TimeoutError:
        raise AssertionError(
            f"{resource}: never settled on {ids}; latest list {sorted(session.latest)}, "
            f"refusals {refusals[-3:]}"
        ) from None


def describe(call: Call, session: PluginSession) -> str:
    """A failing call with the lists around it, for the assertion message."""
    start = max(received_by(session, call.sent_at) - 2, 0)
    end = received_by(session, call.answered_at) + 1
    lists = [
        f"  t={session.update_times[i]:.4f} "
        + " ".join(f"{k}:{v.health[0]}" for k, v in sorted(session.updates[i].items()))
        for i in range(start, min(end, len(session.updates)))
    ]
    outcome = call.answer if call.answer is not None else f"{call.code}: {call.details}"
    return (
        f"{call.resource} {list(call.ids)} sent={call.sent_at:.4f} "
        f"answered={call.answered_at:.4f} -> {outcome}\n" + "\n".join(lists)
    )


async def test_50_concurrent_allocates_during_hotplug_and_health_flips(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    scaled: Callable[[int, int], int],
) -> None:
    rounds = scaled(40, 300)
    world = World(host, random.Random(20240611))
    for _ in range(6):
        world.add_gpu()
    for _ in range(4):
        world.add_serial()
    hotplug = HotplugSettings(
        source="kernel",
        coalesce_ms=2,
        resync_s=1.0,  # full rescans now and then, racing the event-driven ones
        poll_s=3600,
        health_hold_down_s=0,
    )
    calls: list[Call] = []
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(
            daemon_settings(kubelet_dir, hotplug=hotplug), [GenericScanner.from_config(ENTRIES)]
        ) as daemon:
            (daemon_task,) = [t for t in asyncio.all_tasks() if t.get_name() == "devplug-daemon"]
            for resource in (SERIAL, RENDER):
                session = await kubelet.wait_for_plugin(resource, timeout=WAIT_S)
                world.sessions[resource] = session
                await session.wait_for_update(exactly(world.present(resource)))

            for _ in range(rounds):

                async def mutations() -> None:
                    for _ in range(MUTATIONS_PER_ROUND):
                        await asyncio.sleep(world.rng.uniform(0, 0.01))
                        await world.mutate()

                await asyncio.gather(mutations(), *(world.call(calls) for _ in range(CALLERS)))
            assert len(world.mutations) == rounds * MUTATIONS_PER_ROUND

            # Settle: every node back, then the daemon lists exactly the host's devices.
            for device in list(world.devices.values()):
                if device.removed_at is None and not device.node_present:
                    await world.flip(device, True)
            for resource, session in world.sessions.items():
                # A final Allocate of everything present works.
                ids = sorted(d.device_id for d in world.present(resource))
                answer = await settled_allocation(world, session, resource, ids)
                assert [n.host_path for n in answer.nodes] == [
                    world.devices[i].host_node for i in ids
                ]
            assert not daemon_task.done(), "the daemon task ended during the test"
            fresh = GenericScanner.from_config(ENTRIES).scan(UdevSource())
            assert daemon.stats.value.advertised == fresh

    assert len(calls) == rounds * CALLERS
    assert all(call.answered_at > 0 for call in calls)
    problems = [
        f"{problem}\n{describe(call, world.sessions[call.resource])}"
        for call in calls
        for problem in world.check(call)
    ]
    assert problems == [], "\n\n".join(problems[:10])
    refused = [call for call in calls if call.answer is None]
    assert refused and len(refused) < len(calls)  # both outcomes were exercised
    # Nothing went wrong inside the daemon either.
    trouble = [
        entry
        for entry in logs
        if entry["log_level"] in ("error", "critical") or "exc_info" in entry
    ]
    assert trouble == []
    assert not any(e["event"].endswith(".failed") for e in logs), sorted(
        {e["event"] for e in logs if e["event"].endswith(".failed")}
    )
