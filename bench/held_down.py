"""A hotplug event's publish work while a device is held down, next to the same with none held.

One resource of ``--devices`` devices (one NUMA node each). Each sample is what the daemon does
with a scanner's tree after a hotplug event: the tree is the last one with one device removed
or put back (``DeviceTree.with_changes``, as an incremental rescan makes it), gated by the
``HealthGate`` (hold-down 3,600 s, so a device held stays held for the whole run) and turned
into the ListAndWatch message by a ``ListMessageBuilder`` told the gated tree's edit, as the
kubelet front does. Two runs of ``--events`` samples, interleaved:

- floor: no device held down;
- held: one other device recovered just before the run, so it is held down (advertised
  Unhealthy with a reason) for every sample.

Before the gate stated its edits from what it published last, a held-down device made every
sample encode every device afresh. Nothing is asserted.

    .venv/bin/python -m bench.held_down [--devices 10000] [--events 200]
"""

from __future__ import annotations

import argparse
import time

import structlog

from bench.common import summary_ms
from devplug.hotplug.health import HealthGate
from devplug.kubelet.wire import ListMessageBuilder
from devplug.model import DeviceInfo, DeviceTree, Health

RESOURCE = "example.com/many"


class _Publisher:
    """A gate and a message builder, fed one scanner tree after another."""

    def __init__(self, first: DeviceTree) -> None:
        self.gate = HealthGate(hold_down_s=3600.0)
        self.builder = ListMessageBuilder()
        self.published = self.gate.gate(first)
        self.builder.build(self.published[RESOURCE])

    def publish(self, raw: DeviceTree) -> float:
        """Seconds to gate ``raw`` and build its message."""
        started = time.perf_counter()
        gated = self.gate.gate(raw)
        devices = gated[RESOURCE]
        edit = gated.edit_since(RESOURCE, self.published[RESOURCE])
        if edit is not None:
            self.builder.edited(devices, edit)
        self.builder.build(devices)
        elapsed = time.perf_counter() - started
        self.published = gated
        return elapsed


def _healthy(numa: int) -> DeviceInfo:
    return DeviceInfo(numa_nodes=(numa,))


def run(devices: int, events: int) -> None:
    start = DeviceTree({RESOURCE: {f"dev{i}": _healthy(i % 2) for i in range(devices)}})
    floor = _Publisher(start)
    held = _Publisher(start)
    # One device turns unhealthy, then recovers: held down from now on.
    sick = start.with_changes(
        [(RESOURCE, "dev1")], {RESOURCE: {"dev1": DeviceInfo(health=Health.UNHEALTHY)}}
    )
    held.publish(sick)
    recovered = sick.with_changes([(RESOURCE, "dev1")], {RESOURCE: {"dev1": _healthy(1)}})
    held.publish(recovered)
    assert held.published[RESOURCE]["dev1"].health is Health.UNHEALTHY, "not held down"
    trees = {"floor": start, "held": recovered}
    samples: dict[str, list[float]] = {"floor": [], "held": []}
    for event in range(events):
        # Remove the last device, then put it back: a hotplug remove and add in turn.
        for name, publisher in (("floor", floor), ("held", held)):
            tree = trees[name]
            if event % 2 == 0:
                tree = tree.with_changes([(RESOURCE, "dev0")], {})
            else:
                tree = tree.with_changes([], {RESOURCE: {"dev0": _healthy(0)}})
            trees[name] = tree
            samples[name].append(publisher.publish(tree))
    print(f"devices: {devices}, events: {events} (gate + ListAndWatch message build)")
    print(f"floor, no device held down: {summary_ms(samples['floor'])}")
    print(f"one device held down:       {summary_ms(samples['held'])}")
    ratio = sorted(samples["held"])[events // 2] / sorted(samples["floor"])[events // 2]
    print(f"p50 ratio held / floor: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--events", type=int, default=200)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    run(args.devices, args.events)


if __name__ == "__main__":
    main()
