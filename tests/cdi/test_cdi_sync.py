"""CDI spec files kept by the running daemon, and the CDI names in its Allocate answers.

The daemon runs in this process against the kubelet simulator with a StaticScanner. Full and
read-only CDI dirs are real tmpfs mounts when the tests run as root; without root, an
unwritable dir is a chmod 0555 dir and the full-disk case is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import structlog

from devplug.cdi import files as files_module
from devplug.cdi import ownership as ownership_module
from devplug.cdi import store as store_module
from devplug.cdi.allocate import CdiResource
from devplug.cdi.ownership import STATE_DIR, OwnerLock, read_record
from devplug.cdi.stamps import FileStamp
from devplug.cdi.store import SpecStore
from devplug.config import CdiSettings, Settings
from devplug.model import ContainerAllocation, DeviceInfo, DeviceNode, DeviceTree, Health, Mount
from devplug.naming import TEMP_PREFIX
from devplug.scanners.udev import UdevSource
from devplug.testing import eventually
from devplug.testing.harness import StaticScanner, daemon_settings, in_process_daemon
from devplug.testing.simulator import KubeletSimulator, PluginSession

SERIAL = "example.com/serial"
SERIAL_SPEC = "example.com-serial.json"
OTHER = "example.com/other"
OTHER_SPEC = "example.com-other.json"
ROOT = os.geteuid() == 0
NO_SPEC = CdiResource("", "", frozenset(), {})  # stands in for "the catalog has no spec"


def devices(
    count: int, start: int = 0, pad: int = 0, health: Health = Health.HEALTHY
) -> dict[str, DeviceInfo]:
    return {
        f"dev{i}": DeviceInfo(
            health=health,
            nodes=(DeviceNode(f"/dev/ttyX{i}"),),
            mounts=(Mount(f"/run/serial/{i}"),),
            env={"SERIAL": str(i), **({"PAD": "x" * pad} if pad else {})},
        )
        for i in range(start, start + count)
    }


def name(device_id: str, kind: str = SERIAL) -> str:
    return f"{kind}={device_id}"


def spec_on_disk(path: Path) -> dict[str, Any]:
    document = json.loads(path.read_bytes())
    assert isinstance(document, dict)
    return document


def defined_names(cdi_dir: Path) -> set[str]:
    """Every qualified CDI name the spec files in ``cdi_dir`` define (what a runtime resolves)."""
    names: set[str] = set()
    for path in cdi_dir.glob("*.json"):
        document = spec_on_disk(path)
        names.update(f"{document['kind']}={d['name']}" for d in document["devices"])
    return names


def stamp(path: Path) -> FileStamp:
    info = os.lstat(path)
    return FileStamp(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def visible(cdi_dir: Path) -> list[str]:
    """What a runtime sees in the CDI dir: everything but devplug's state dir."""
    return sorted(n for n in os.listdir(cdi_dir) if n != STATE_DIR)


def has_device_specs(answer: ContainerAllocation, *ids: str) -> bool:
    """The answer gives the devices' nodes, mounts and env (a runtime without CDI works)."""
    numbers = [i.removeprefix("dev") for i in ids]
    return (
        [n.host_path for n in answer.nodes] == [f"/dev/ttyX{n}" for n in numbers]
        and [m.host_path for m in answer.mounts] == [f"/run/serial/{n}" for n in numbers]
        and answer.env.get("SERIAL") == ",".join(numbers)  # values joined in id order
    )


def stripped(answer: ContainerAllocation) -> bool:
    """Only the CDI names remain for nodes and mounts; env always stays in Allocate."""
    return not answer.nodes and not answer.mounts and bool(answer.env)


def settings(kubelet_dir: Path, cdi_dir: Path, **cdi: Any) -> Settings:
    return daemon_settings(kubelet_dir, cdi=CdiSettings(dir=cdi_dir, **cdi))


@pytest.fixture
def cdi_dir(short_dir: Path) -> Path:
    return short_dir / "cdi"


async def started(
    kubelet: KubeletSimulator, resource: str = SERIAL, count: int | None = None
) -> PluginSession:
    session = await kubelet.wait_for_plugin(resource)
    await session.wait_for_update(lambda listed: count is None or len(listed) == count)
    return session


# ------------------------------------------------------------------------- faulty dirs


async def _run(*command: str) -> None:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    assert process.returncode == 0, f"{command}: {out!r} {err!r}"


class FaultyDir:
    """The CDI dir, which a test can make full or unwritable and repair.

    As root it is a tmpfs of its own (16 KiB when ``full``), remounted read-only or bigger;
    otherwise an ordinary dir, chmod 0555 to make it unwritable (and ``full`` is skipped).
    """

    def __init__(self, path: Path, *, full: bool = False) -> None:
        self.path = path
        self.mounted = False
        self.full = full
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
        if ROOT:
            size = "16k" if full else "1m"
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                capture_output=True,
                text=True,
                check=False,
            )
            if mounted.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
            self.mounted = True
        elif full:
            pytest.skip("a full filesystem needs a tmpfs mount, which needs root")

    @property
    def unwritable_errno(self) -> str:
        return "EROFS" if self.mounted else "EACCES"

    async def make_unwritable(self) -> None:
        if self.mounted:
            await _run("mount", "-o", "remount,ro", str(self.path))
        else:
            self.path.chmod(0o555)

    async def repair(self) -> None:
        if self.mounted:
            await _run("mount", "-o", "remount,rw,size=1m", str(self.path))
        else:
            self.path.chmod(0o755)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        elif self.path.exists():
            self.path.chmod(0o755)


@pytest.fixture
def faulty_dir(cdi_dir: Path) -> Iterator[Callable[..., FaultyDir]]:
    made: list[FaultyDir] = []

    def make(*, full: bool = False) -> FaultyDir:
        made.append(FaultyDir(cdi_dir, full=full))
        return made[-1]

    try:
        yield make
    finally:
        for faulty in made:
            faulty.close()


# ------------------------------------------------------------------------- writing


async def test_a_spec_is_written_when_a_resource_appears(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        await started(kubelet)
        path = cdi_dir / SERIAL_SPEC
        await eventually(path.exists, timeout=2)
        info = os.lstat(path)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o644
        document = spec_on_disk(path)
        # Nothing but the devices: no annotations, the lowest version their content needs.
        assert list(document) == ["cdiVersion", "kind", "devices"]
        assert document["kind"] == SERIAL and document["cdiVersion"] == "0.3.0"
        assert [d["name"] for d in document["devices"]] == ["dev0", "dev1"]
        # Ownership is kept where runtimes do not look.
        record = await read_record(cdi_dir, SERIAL_SPEC)
        assert record is not None and record.resource == SERIAL
        assert record.instance == "static"  # the daemon's instance: its scanners' names
        edits = document["devices"][1]["containerEdits"]
        assert "env" not in edits  # env goes in Allocate, merged across devices
        assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/ttyX1"]
        assert [m["hostPath"] for m in edits["mounts"]] == ["/run/serial/1"]
        assert sorted(os.listdir(cdi_dir)) == [STATE_DIR, SERIAL_SPEC]

        # A resource that appears later gets its own file; the first is left as it is.
        before = stamp(path)
        scanner.set({SERIAL: devices(2), OTHER: devices(1)})
        await daemon.rescan()
        await started(kubelet, OTHER)
        await eventually((cdi_dir / OTHER_SPEC).exists, timeout=2)
        assert spec_on_disk(cdi_dir / OTHER_SPEC)["kind"] == OTHER
        assert stamp(path) == before


async def test_the_daemon_hands_its_cdi_task_the_scan_loops_quiet(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    """CDI work yields to the hotplug path: the daemon gives the task the scan loop's quiet
    (the task's own waiting is tested in test_cdi_yielding)."""
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [StaticScanner({})]) as daemon:
        sync = daemon.cdi_sync
        assert sync is not None and sync._quiet == daemon.scan_loop.quiet


class GatedScanner(StaticScanner):
    """A StaticScanner whose scans wait (in their worker thread) while ``gate`` is clear."""

    def __init__(self, resources: dict[str, dict[str, DeviceInfo]]) -> None:
        super().__init__(resources)
        self.gate = threading.Event()
        self.gate.set()

    def scan(self, source: UdevSource) -> DeviceTree:
        self.gate.wait(timeout=30)
        return super().scan(source)


async def test_the_daemons_cdi_work_waits_while_a_scan_is_under_way(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    """A spec changed by one scan is not written while the next scan runs (the hotplug path
    goes first; the wait is bounded by QUIET_WAIT_MAX_S, 0.5 s), and is once it ends."""
    scanner = GatedScanner({SERIAL: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        await started(kubelet)
        path = cdi_dir / SERIAL_SPEC
        await eventually(path.exists, timeout=5)
        scanner.set({SERIAL: devices(2)})
        await daemon.rescan()  # published: a CDI pass is due (after its 20 ms settle)
        scanner.gate.clear()
        blocked = asyncio.create_task(daemon.rescan())
        try:
            # Without the wait, the pass would write within its settle and a slice (~25 ms).
            await asyncio.sleep(0.2)
            assert [d["name"] for d in spec_on_disk(path)["devices"]] == ["dev0"]
        finally:
            scanner.gate.set()
        await blocked
        await eventually(lambda: len(spec_on_disk(path)["devices"]) == 2, timeout=5)


async def test_stopping_abandons_a_pass_under_way_instead_of_writing_a_spec_to_delete(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    """A stop requested while the CDI task renders its first spec (5,000 devices: ~0.1 s of
    slices) ends the pass: no spec is written after the stop (shutdown would delete it)."""
    scanner = StaticScanner({SERIAL: devices(5000)})
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
            await started(kubelet, count=5000)
            # The task starts after the first lists; its pass settles 20 ms, then renders.
            await eventually(lambda: daemon._cdi_sync is not None, timeout=5)
            await asyncio.sleep(0.05)
            daemon.stop_requested.set()
            await asyncio.sleep(0.5)  # the servers' shutdown, the pass's slices and its write
    events = [entry["event"] for entry in logs]
    stopping = events.index("daemon.stopping")
    assert "cdi.spec.written" not in events[stopping:], events[stopping:]


async def test_a_stop_while_a_spec_is_renamed_in_still_removes_it(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop that lands while a write is under way (the spec renamed into place, the dir's
    fsync still running) lets the write finish and records it, so the orderly shutdown
    removes the spec (keep_on_exit off). (Cancelling the task twice once cut such a write
    between the rename and its record: the spec stayed behind.)"""
    inside = asyncio.Event()
    real_fsync_dir = files_module.fsync_dir

    async def slow_fsync_dir(directory: Path) -> None:
        if (directory / SERIAL_SPEC).exists():
            inside.set()
            await asyncio.to_thread(time.sleep, 0.4)  # a busy disk
        await real_fsync_dir(directory)

    monkeypatch.setattr(files_module, "fsync_dir", slow_fsync_dir)
    scanner = StaticScanner({SERIAL: devices(50)})
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
            await started(kubelet, count=50)
            async with asyncio.timeout(5):
                await inside.wait()
            daemon.stop_requested.set()
    assert visible(cdi_dir) == [], [e["event"] for e in logs]


async def test_allocate_names_exactly_the_requested_devices(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(3)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        session = await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        assert (cdi_dir / SERIAL_SPEC).exists()
        first, second = await session.allocate(["dev2", "dev0"], ["dev1"])
        assert first.cdi_devices == (name("dev2"), name("dev0"))
        assert second.cdi_devices == (name("dev1"),)
        assert set(first.cdi_devices + second.cdi_devices) <= defined_names(cdi_dir)
        # device_specs is on by default: the nodes, mounts and env are there too.
        assert has_device_specs(first, "dev2", "dev0")
        assert has_device_specs(second, "dev1")
        assert first.annotations == {}  # annotations are off by default


async def test_annotations_name_the_devices_for_older_runtimes(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(3)})
    cdi = settings(kubelet_dir, cdi_dir, annotations=True)
    async with in_process_daemon(cdi, [scanner]) as daemon:
        session = await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        (answer,) = await session.allocate(["dev0", "dev2"])
        assert answer.annotations == {
            "cdi.k8s.io/devplug_example.com_serial": f"{name('dev0')},{name('dev2')}"
        }
        assert answer.cdi_devices == (name("dev0"), name("dev2"))


async def test_without_device_specs_only_the_cdi_names_are_sent(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2)})
    cdi = settings(kubelet_dir, cdi_dir, device_specs=False)
    async with in_process_daemon(cdi, [scanner]) as daemon:
        session = await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        (answer,) = await session.allocate(["dev0", "dev1"])
        assert answer.cdi_devices == (name("dev0"), name("dev1"))
        assert stripped(answer)


async def test_a_device_the_spec_does_not_define_yet_keeps_its_device_specs(
    kubelet: KubeletSimulator, kubelet_dir: Path, faulty_dir: Callable[..., FaultyDir]
) -> None:
    """Between a device's discovery and its spec's rewrite (forever, if the rewrite fails),
    Allocate gives it nodes, mounts and env, even without device_specs."""
    faulty = faulty_dir()
    scanner = StaticScanner({SERIAL: devices(2)})
    cdi = settings(kubelet_dir, faulty.path, device_specs=False)
    async with in_process_daemon(cdi, [scanner]) as daemon:
        session = await started(kubelet)
        sync = daemon.cdi_sync
        assert sync is not None
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        await faulty.make_unwritable()
        scanner.set({SERIAL: devices(3)})
        await daemon.rescan()
        await session.wait_for_update(lambda listed: "dev2" in listed)
        await daemon.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
        assert [d["name"] for d in spec_on_disk(faulty.path / SERIAL_SPEC)["devices"]] == [
            "dev0",
            "dev1",
        ]

        # One call each: the containers of one request may not share a device.
        (new,) = await session.allocate(["dev2"])
        (mixed,) = await session.allocate(["dev0", "dev2"])
        (old,) = await session.allocate(["dev0"])
        assert new.cdi_devices == () and has_device_specs(new, "dev2")
        assert mixed.cdi_devices == (name("dev0"),) and has_device_specs(mixed, "dev0", "dev2")
        assert old.cdi_devices == (name("dev0"),) and stripped(old)

        await faulty.repair()
        await eventually(lambda: "dev2" in (daemon.cdi_catalog.get(SERIAL) or NO_SPEC).names)
        (new,) = await session.allocate(["dev2"])
        assert new.cdi_devices == (name("dev2"),) and stripped(new)


async def test_a_changed_device_is_not_named_while_its_spec_on_disk_is_stale(
    kubelet: KubeletSimulator, kubelet_dir: Path, faulty_dir: Callable[..., FaultyDir]
) -> None:
    faulty = faulty_dir()
    scanner = StaticScanner({SERIAL: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, faulty.path), [scanner]) as daemon:
        session = await started(kubelet)
        sync = daemon.cdi_sync
        assert sync is not None
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        await faulty.make_unwritable()
        # dev0's node changes (say, a re-bound GPU got another minor): same id, new node.
        scanner.set({SERIAL: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/ttyZ0"),))}})
        await daemon.rescan()
        await daemon.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
        (answer,) = await session.allocate(["dev0"])
        assert [n.host_path for n in answer.nodes] == ["/dev/ttyZ0"]
        on_disk = spec_on_disk(faulty.path / SERIAL_SPEC)["devices"][0]["containerEdits"]
        assert [n["path"] for n in on_disk["deviceNodes"]] == ["/dev/ttyX0"]  # stale
        # The runtime would add /dev/ttyX0 from the spec on disk: dev0 must not be named.
        assert answer.cdi_devices == ()


# ------------------------------------------------------------------------- no needless writes


async def test_nothing_is_rewritten_when_nothing_in_the_spec_changed(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(3)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        session = await started(kubelet)
        sync = daemon.cdi_sync
        assert sync is not None
        path = cdi_dir / SERIAL_SPEC
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        content, before, writes = path.read_bytes(), stamp(path), sync.writes
        assert writes == 1

        # A rescan that finds the same devices (the same tree, then an equal new one).
        await daemon.rescan()
        scanner.set({SERIAL: devices(3)})
        await daemon.rescan()
        # Only health changes: the spec does not carry health.
        sick = devices(3)
        sick["dev1"] = devices(1, start=1, health=Health.UNHEALTHY)["dev1"]
        scanner.set({SERIAL: sick})
        await daemon.rescan()
        await session.wait_for_update(lambda listed: listed["dev1"].health == "Unhealthy")
        # A change elsewhere, waited for: the CDI task has seen the trees above by then.
        scanner.set({SERIAL: sick, OTHER: devices(1)})
        await daemon.rescan()
        await daemon.stats.wait_for(lambda s: OTHER in s.cdi_specs, timeout=5)

        assert sync.writes == writes + 1  # OTHER's spec only
        assert stamp(path) == before  # same inode and mtime: not rewritten
        assert path.read_bytes() == content


async def test_a_changed_device_rewrites_the_spec(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        session = await started(kubelet)
        sync = daemon.cdi_sync
        assert sync is not None
        await eventually(lambda: sync.writes == 1)
        scanner.set({SERIAL: devices(3)})
        await daemon.rescan()
        await eventually(lambda: sync.writes == 2)
        path = cdi_dir / SERIAL_SPEC
        assert [d["name"] for d in spec_on_disk(path)["devices"]] == ["dev0", "dev1", "dev2"]
        (answer,) = await session.allocate(["dev2"])
        assert answer.cdi_devices == (name("dev2"),)
        assert visible(cdi_dir) == [SERIAL_SPEC]  # no temp file left


# ------------------------------------------------------------------------- removal


async def test_a_resource_that_goes_away_takes_its_spec_with_it(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(1), OTHER: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        await started(kubelet)
        await eventually(
            lambda: (cdi_dir / SERIAL_SPEC).exists() and (cdi_dir / OTHER_SPEC).exists()
        )
        kept = stamp(cdi_dir / SERIAL_SPEC)
        scanner.set({SERIAL: devices(1)})
        await daemon.rescan()
        await eventually(lambda: not (cdi_dir / OTHER_SPEC).exists())
        await daemon.stats.wait_for(lambda s: OTHER not in s.cdi_specs, timeout=5)
        assert stamp(cdi_dir / SERIAL_SPEC) == kept
        assert daemon.cdi_catalog.resources() == [SERIAL]


async def test_a_resource_whose_devices_have_nothing_to_inject_has_no_spec(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        session = await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        scanner.set({SERIAL: {"dev0": DeviceInfo()}})
        await daemon.rescan()
        await daemon.stats.wait_for(lambda s: SERIAL not in s.cdi_specs, timeout=5)
        assert not (cdi_dir / SERIAL_SPEC).exists()
        (answer,) = await session.allocate(["dev0"])
        assert answer.cdi_devices == ()


async def test_an_orderly_shutdown_removes_the_specs(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    foreign = cdi_dir / "vendor-foreign.json"
    cdi_dir.mkdir()
    foreign.write_text('{"kind":"vendor.example/x","devices":[]}')
    scanner = StaticScanner({SERIAL: devices(1), OTHER: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        await started(kubelet)
        await eventually(lambda: daemon.cdi_catalog.resources() == [OTHER, SERIAL])
    assert visible(cdi_dir) == [foreign.name]
    assert daemon.cdi_catalog.resources() == []


async def test_keep_on_exit_leaves_the_specs(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(1)})
    async with in_process_daemon(
        settings(kubelet_dir, cdi_dir, keep_on_exit=True), [scanner]
    ) as daemon:
        await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        content = (cdi_dir / SERIAL_SPEC).read_bytes()
    assert (cdi_dir / SERIAL_SPEC).read_bytes() == content
    assert visible(cdi_dir) == [SERIAL_SPEC]


async def test_a_write_in_progress_at_shutdown_leaves_no_spec_behind(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    cdi_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writing = threading.Event()

    real_write = files_module.write_atomically

    async def slow_write(directory: Path, file_name: str, data: bytes, *args: Any) -> Any:
        if file_name.endswith(".json"):
            writing.set()
            await asyncio.sleep(0.3)  # a big spec on a slow disk
        return await real_write(directory, file_name, data, *args)

    monkeypatch.setattr(store_module, "write_atomically", slow_write)
    scanner = StaticScanner({SERIAL: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]):
        await started(kubelet)
        await eventually(writing.is_set)
    await asyncio.sleep(0.5)  # the worker thread has finished by now
    assert not (cdi_dir / SERIAL_SPEC).exists()


# ------------------------------------------------------------------------- start-up


def claiming_spec(kind: str, instance: str) -> bytes:
    """A spec whose annotations say a devplug of ``instance`` wrote it: anyone can write that,
    so without a record it is someone else's file."""
    annotations = {"devplug.io/managed-by": "devplug", "devplug.io/instance": instance}
    body = {"name": "old", "containerEdits": {"deviceNodes": [{"path": "/dev/old"}]}}
    document = {"cdiVersion": "0.6.0", "kind": kind, "annotations": annotations, "devices": [body]}
    return json.dumps(document, separators=(",", ":")).encode() + b"\n"


async def earlier_run(cdi_dir: Path, instance: str, specs: dict[str, bytes]) -> None:
    """Specs left by a devplug daemon of ``instance`` that is gone (crashed, or kept them)."""
    store = SpecStore(cdi_dir, instance, OwnerLock(cdi_dir))
    await store.prepare()
    for file_name, data in specs.items():
        await store.write(file_name, json.loads(data)["kind"], data)
    await store.close()


async def test_start_up_removes_stale_specs_and_leaves_other_writers_files(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    cdi_dir.mkdir()
    gone = b'{"cdiVersion":"0.3.0","kind":"example.com/gone","devices":[]}'
    await earlier_run(cdi_dir, "static", {"example.com-gone.json": gone})
    # Another devplug instance's spec (other scanners, same dir): not this one's to clean up.
    theirs = b'{"cdiVersion":"0.3.0","kind":"example.com/theirs2","devices":[]}'
    await earlier_run(cdi_dir, "generic", {"example.com-theirs2.json": theirs})
    foreign = {
        # Says it is this instance's spec of a resource the host no longer has: no record.
        "example.com-claimed.json": claiming_spec("example.com/claimed", "static"),
        "example.com-theirs2.json": theirs,
        "vendor-foreign.json": b'{"kind":"vendor.example/x","devices":[]}',
        "vendor-foreign.yaml": b"kind: vendor.example/y\n",
        # Another writer's file under the name OTHER's spec would have.
        OTHER_SPEC: b'{"cdiVersion":"0.6.0","kind":"example.com/other","devices":[]}',
    }
    for file_name, content in foreign.items():
        (cdi_dir / file_name).write_bytes(content)
    (cdi_dir / f"{TEMP_PREFIX}leftover").write_bytes(b"half a spec")
    hour_ago = time.time() - 3600  # a crash's leftover, not a write in progress
    os.utime(cdi_dir / f"{TEMP_PREFIX}leftover", (hour_ago, hour_ago))
    (cdi_dir / f"{TEMP_PREFIX}in-progress").write_bytes(b"another instance writing")

    scanner = StaticScanner({SERIAL: devices(2), OTHER: devices(1)})
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
            other = await started(kubelet, OTHER)
            sync = daemon.cdi_sync
            assert sync is not None
            await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
            await daemon.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
            # The clean-up comes after the pass that wrote the specs; this is its last line.
            await eventually(lambda: any(e["event"] == "cdi.temp_files.removed" for e in logs))

            assert not (cdi_dir / "example.com-gone.json").exists()
            assert not (cdi_dir / f"{TEMP_PREFIX}leftover").exists()
            assert (cdi_dir / f"{TEMP_PREFIX}in-progress").exists()  # too young to be stale
            for file_name, content in foreign.items():
                assert (cdi_dir / file_name).read_bytes() == content
            assert daemon.cdi_catalog.get(OTHER) is None

            # OTHER is served with device specs, and named nowhere.
            (answer,) = await other.allocate(["dev0"])
            assert answer.cdi_devices == () and has_device_specs(answer, "dev0")

    removed = [e for e in logs if e["event"] == "cdi.spec.removed" and e.get("reason") == "stale"]
    assert [(e["file"], e["resource"]) for e in removed] == [
        ("example.com-gone.json", "example.com/gone"),
    ]
    assert [e["count"] for e in logs if e["event"] == "cdi.temp_files.removed"] == [1]
    refused = [e for e in logs if e["event"] == "cdi.spec.write_failed"]
    assert [(e["resource"], e["log_level"]) for e in refused] == [(OTHER, "warning")]
    assert refused[0]["reason"].startswith("EEXIST")
    assert "not written by devplug" in refused[0]["reason"]
    # After the shutdown: devplug's spec is gone, everyone else's files are still there.
    assert visible(cdi_dir) == sorted([*foreign, f"{TEMP_PREFIX}in-progress"])
    for file_name, content in foreign.items():
        assert (cdi_dir / file_name).read_bytes() == content
    assert await read_record(cdi_dir, SERIAL_SPEC) is None
    assert await read_record(cdi_dir, "example.com-theirs2.json") is not None


async def test_the_daemons_own_specs_are_written_before_the_start_up_clean_up(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    cdi_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """However much the clean-up of earlier runs has to look through (a neighbour's 20,000
    specs and junk files took it 55 s), it never holds back this daemon's own specs, and
    other writers' files cost it a look at their names and first 4 KiB, never a turn at the
    state dir's mutex each."""
    cdi_dir.mkdir()
    # Named to sort after the foreign files: once it is gone, the clean-up has been past them.
    gone = b'{"cdiVersion":"0.3.0","kind":"zz.example/gone","devices":[]}'
    await earlier_run(cdi_dir, "static", {"zz.example-gone.json": gone})
    foreign = 200
    for index in range(foreign):
        (cdi_dir / f"vendor.example-f{index}.json").write_bytes(b'{"kind":"vendor.example/f"}')
    mutex_turns: list[Path] = []
    real_exclusive = ownership_module.exclusive

    def counted(directory: Path, *args: Any) -> Any:
        mutex_turns.append(directory)
        return real_exclusive(directory, *args)

    monkeypatch.setattr(store_module, "exclusive", counted)
    scanner = StaticScanner({SERIAL: devices(1)})
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]):
            await started(kubelet)
            await eventually(
                lambda: (
                    {("cdi.spec.written", None), ("cdi.spec.removed", "stale")}
                    <= {(e["event"], e.get("reason")) for e in logs}
                ),
                timeout=10,
            )
    assert not (cdi_dir / "zz.example-gone.json").exists()
    events = [(e["event"], e.get("reason")) for e in logs]
    written = events.index(("cdi.spec.written", None))
    removed = events.index(("cdi.spec.removed", "stale"))
    assert written < removed, events
    # Writing SERIAL's spec, removing the stale one, removing SERIAL's at shutdown: a few
    # turns, whatever the number of foreign files.
    assert len(mutex_turns) < 10, len(mutex_turns)
    assert len(list(cdi_dir.glob("vendor.example-f*.json"))) == foreign


async def test_another_kind_avoids_a_foreign_file_of_the_same_name(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    cdi_dir.mkdir()
    (cdi_dir / SERIAL_SPEC).write_text('{"kind":"example.com/serial","devices":[]}')
    scanner = StaticScanner({SERIAL: devices(1)})
    cdi = settings(kubelet_dir, cdi_dir, kinds={SERIAL: "vendor.example/tty"})
    async with in_process_daemon(cdi, [scanner]) as daemon:
        session = await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        assert spec_on_disk(cdi_dir / "vendor.example-tty.json")["kind"] == "vendor.example/tty"
        (answer,) = await session.allocate(["dev0"])
        assert answer.cdi_devices == (name("dev0", "vendor.example/tty"),)
    assert (cdi_dir / SERIAL_SPEC).read_text() == '{"kind":"example.com/serial","devices":[]}'


@pytest.mark.parametrize(
    ("first", "second", "kinds"),
    [
        ("example.com/ab-cd", "example.com-ab/cd", {}),
        ("example.com/serial-usb", SERIAL, {"example.com/serial-usb": SERIAL}),
    ],
    ids=["default-kinds", "configured-kind"],
)
async def test_two_resources_never_share_a_spec_file(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    cdi_dir: Path,
    first: str,
    second: str,
    kinds: dict[str, str],
) -> None:
    try:
        config = settings(kubelet_dir, cdi_dir, kinds=kinds)
    except pydantic.ValidationError:
        return  # refused in the config: fixed that way
    scanner = StaticScanner({first: devices(1), second: devices(1, start=1)})
    async with in_process_daemon(config, [scanner]) as daemon:
        sessions = [await started(kubelet, first), await started(kubelet, second)]
        sync = daemon.cdi_sync
        assert sync is not None
        # One resource keeps the file; the other gets no spec (and an error saying why).
        await eventually(lambda: sync.writes >= 1)
        catalog = daemon.cdi_catalog
        assert [r for r in (first, second) if catalog.get(r) is not None] == [min(first, second)]
        answers = [
            (await sessions[0].allocate(["dev0"]))[0],
            (await sessions[1].allocate(["dev1"]))[0],
        ]
        named = {n for answer in answers for n in answer.cdi_devices}
        # Every name sent must resolve: a runtime fails the container on one that does not.
        assert named <= defined_names(cdi_dir)


# ------------------------------------------------------------------------- faults


@pytest.mark.parametrize("fault", ["full", "unwritable"])
async def test_a_failed_write_is_logged_served_around_and_retried(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    faulty_dir: Callable[..., FaultyDir],
    fault: str,
) -> None:
    faulty = faulty_dir(full=fault == "full")
    if fault == "unwritable":
        await faulty.make_unwritable()
        expected = faulty.unwritable_errno
    else:
        expected = "ENOSPC"
    # ~40 KiB of spec: more than the full tmpfs holds.
    scanner = StaticScanner({SERIAL: devices(100, pad=300)})
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, faulty.path), [scanner]) as daemon:
            session = await started(kubelet, count=100)
            sync = daemon.cdi_sync
            assert sync is not None
            await daemon.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
            failed = [e for e in logs if e["event"] == "cdi.spec.write_failed"]
            assert [(e["resource"], e["log_level"]) for e in failed] == [(SERIAL, "warning")]
            assert failed[0]["reason"].startswith(f"{expected}: ")
            assert failed[0]["dir"] == str(faulty.path)
            assert visible(faulty.path) == []  # no part of a spec, no temp file

            # Still serving: device specs, no CDI names.
            (answer,) = await session.allocate(["dev7"])
            assert answer.cdi_devices == () and has_device_specs(answer, "dev7")

            # Cleared: the retry (after ~1 s, no rescan needed) writes the spec.
            await faulty.repair()
            await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=6)
            assert len(spec_on_disk(faulty.path / SERIAL_SPEC)["devices"]) == 100
            (answer,) = await session.allocate(["dev7"])
            assert answer.cdi_devices == (name("dev7"),) and has_device_specs(answer, "dev7")
    events = [e["event"] for e in logs]
    assert events.count("cdi.spec.write_failed") == 1  # retries with the same reason: quiet
    assert "cdi.spec.recovered" in events


async def test_a_removal_that_fails_is_retried(
    kubelet: KubeletSimulator, kubelet_dir: Path, faulty_dir: Callable[..., FaultyDir]
) -> None:
    faulty = faulty_dir()
    scanner = StaticScanner({SERIAL: devices(1), OTHER: devices(1)})
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, faulty.path), [scanner]) as daemon:
            await started(kubelet)
            sync = daemon.cdi_sync
            assert sync is not None
            await eventually(lambda: daemon.cdi_catalog.resources() == [OTHER, SERIAL])
            await faulty.make_unwritable()
            scanner.set({SERIAL: devices(1)})
            await daemon.rescan()
            await daemon.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
            assert (faulty.path / OTHER_SPEC).exists()  # could not be removed yet
            failed = [e for e in logs if e["event"] == "cdi.spec.write_failed"]
            assert [e["resource"] for e in failed] == [OTHER]
            assert failed[0]["reason"].startswith(f"{faulty.unwritable_errno}: ")

            await faulty.repair()
            await eventually(lambda: not (faulty.path / OTHER_SPEC).exists(), timeout=6)
            await eventually(lambda: daemon.cdi_catalog.resources() == [SERIAL])
            assert visible(faulty.path) == [SERIAL_SPEC]


async def test_a_resource_that_goes_before_its_spec_could_be_written_is_forgotten(
    kubelet: KubeletSimulator, kubelet_dir: Path, faulty_dir: Callable[..., FaultyDir]
) -> None:
    faulty = faulty_dir()
    await faulty.make_unwritable()
    scanner = StaticScanner({SERIAL: devices(1), OTHER: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, faulty.path), [scanner]) as daemon:
        await started(kubelet, OTHER)
        sync = daemon.cdi_sync
        assert sync is not None
        await daemon.stats.wait_for(lambda s: s.cdi_failures >= 2, timeout=5)  # both resources
        scanner.set({SERIAL: devices(1)})
        await daemon.rescan()
        await faulty.repair()
        await daemon.rescan()  # a new tree: the CDI task retries at once
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        assert visible(faulty.path) == [SERIAL_SPEC]
        assert daemon.cdi_catalog.resources() == [SERIAL]


async def test_a_cdi_dir_that_is_not_a_directory_is_logged_and_served_around(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    cdi_dir.write_text("a file where the dir should be")
    scanner = StaticScanner({SERIAL: devices(1)})
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
            session = await started(kubelet)
            sync = daemon.cdi_sync
            assert sync is not None
            await daemon.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
            (answer,) = await session.allocate(["dev0"])
            assert answer.cdi_devices == () and has_device_specs(answer, "dev0")
    failed = [e for e in logs if e["event"] == "cdi.spec.write_failed"]
    assert [(e["resource"], e["dir"], e["log_level"]) for e in failed] == [
        (SERIAL, str(cdi_dir), "warning")
    ]
    assert failed[0]["reason"].startswith("ENOTDIR: ")
    # The start-up clean-up fails the same way: said once, by the spec's line.
    assert [e for e in logs if e["event"] == "cdi.reconcile.failed"] == []
    assert cdi_dir.read_text() == "a file where the dir should be"


async def test_a_cdi_dir_that_cannot_be_used_without_resources_is_logged_by_the_clean_up(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    cdi_dir.write_text("a file where the dir should be")
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings(kubelet_dir, cdi_dir), [StaticScanner({})]):
            await eventually(lambda: any(e["event"] == "cdi.reconcile.failed" for e in logs))
    reconcile = [e for e in logs if e["event"] == "cdi.reconcile.failed"]
    assert [(e["dir"], e["log_level"]) for e in reconcile] == [(str(cdi_dir), "warning")]
    assert reconcile[0]["reason"].startswith("ENOTDIR: ")


async def test_a_resource_name_that_is_not_a_kind_gets_one(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    resource = "3d.example.com/cam"  # a kind's vendor must start with a letter
    scanner = StaticScanner({resource: devices(1)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        session = await started(kubelet, resource)
        await daemon.stats.wait_for(lambda s: resource in s.cdi_specs, timeout=5)
        document = spec_on_disk(cdi_dir / "x3d.example.com-cam.json")
        assert document["kind"] == "x3d.example.com/cam"
        record = await read_record(cdi_dir, "x3d.example.com-cam.json")
        assert record is not None and record.resource == resource
        (answer,) = await session.allocate(["dev0"])
        assert answer.cdi_devices == ("x3d.example.com/cam=dev0",)


# ------------------------------------------------------------------------- disabled


async def test_with_cdi_disabled_nothing_is_written_or_named(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2)})
    cdi = settings(kubelet_dir, cdi_dir, enabled=False, annotations=True)
    async with in_process_daemon(cdi, [scanner]) as daemon:
        session = await started(kubelet)
        assert daemon.cdi_sync is None
        scanner.set({SERIAL: devices(3)})
        await daemon.rescan()
        await session.wait_for_update(lambda listed: "dev2" in listed)
        (answer,) = await session.allocate(["dev0", "dev2"])
        assert answer.cdi_devices == () and answer.annotations == {}
        assert has_device_specs(answer, "dev0", "dev2")
        assert not cdi_dir.exists()
    assert not cdi_dir.exists()


# ------------------------------------------------------------------------- review cases


async def test_while_a_spec_is_replaced_only_unchanged_devices_are_named(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    cdi_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the rename and the catalog update on the loop, the file
    on disk may be the old one or the new one: only devices both define alike are named."""
    import devplug.cdi.sync as cdi_sync

    seen: list[frozenset[str] | None] = []
    from devplug.cdi.passes import carry_out as real

    scanner = StaticScanner({SERIAL: devices(3)})
    async with in_process_daemon(settings(kubelet_dir, cdi_dir), [scanner]) as daemon:
        await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)

        async def observing(*args: Any) -> Any:
            entry = daemon.cdi_catalog.get(SERIAL)  # what Allocate sees during the write
            seen.append(None if entry is None else entry.names)
            return await real(*args)

        monkeypatch.setattr(cdi_sync, "carry_out", observing)
        current = daemon.servers.servers[SERIAL].devices.value
        # dev0 keeps its very DeviceInfo, dev1 changes, dev2 goes.
        changed = {"dev0": current["dev0"], "dev1": DeviceInfo(nodes=(DeviceNode("/dev/ttyY1"),))}
        scanner.set({SERIAL: changed})
        await daemon.rescan()
        await eventually(lambda: bool(seen))
        await eventually(
            lambda: (
                (entry := daemon.cdi_catalog.get(SERIAL)) is not None
                and entry.names == {"dev0", "dev1"}
            )
        )
    assert seen[0] == frozenset({"dev0"})


async def test_a_second_daemon_on_the_same_dirs_leaves_the_first_ones_specs(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    """A second `devplug run` on the same dirs (refused its sockets, waiting) must not take
    or delete the specs the first one serves; it takes them over once the first is gone."""
    config = settings(kubelet_dir, cdi_dir)
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})]) as first:
            session = await started(kubelet)
            await first.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
            before = stamp(cdi_dir / SERIAL_SPEC)
            async with in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})]) as second:
                sync = second.cdi_sync
                assert sync is not None
                await second.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
                assert second.cdi_catalog.get(SERIAL) is None  # not its spec: named nowhere
            # The second one stopped: the first one's spec is as it was, and still named.
            assert stamp(cdi_dir / SERIAL_SPEC) == before
            (answer,) = await session.allocate(["dev0"])
            assert answer.cdi_devices == (name("dev0"),)
            first_sync = first.cdi_sync
            assert first_sync is not None and first_sync.writes == 1
    held = [e for e in logs if e["event"] == "cdi.spec.held_elsewhere"]
    assert [(e["resource"], e["held_by"], e["log_level"]) for e in held] == [
        (SERIAL, "static", "warning")
    ]
    assert not [e for e in logs if e["event"] == "cdi.spec.rewritten"]
    assert not (cdi_dir / SERIAL_SPEC).exists()  # the first one's orderly shutdown


async def test_a_daemon_takes_over_a_spec_the_other_one_lets_go(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    config = settings(kubelet_dir, cdi_dir)
    async with in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})]) as first:
        await started(kubelet)
        await first.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        async with in_process_daemon(config, [StaticScanner({SERIAL: devices(3)})]) as second:
            sync = second.cdi_sync
            assert sync is not None
            await second.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
            first.request_stop()  # the first one stops: its spec goes with it...
            # ...and the second one notices at once (a dir watch, no periodic resync) and
            # writes its own.
            await second.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=1)
            names = [d["name"] for d in spec_on_disk(cdi_dir / SERIAL_SPEC)["devices"]]
            assert names == ["dev0", "dev1", "dev2"]
            record = await read_record(cdi_dir, SERIAL_SPEC)
            assert record is not None and record.owner == sync.store.owner


async def test_a_spec_deleted_behind_the_daemons_back_is_written_again_at_once(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(
            settings(kubelet_dir, cdi_dir), [StaticScanner({SERIAL: devices(2)})]
        ) as daemon:
            await started(kubelet)
            sync = daemon.cdi_sync
            assert sync is not None
            await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
            first = (cdi_dir / SERIAL_SPEC).read_bytes()
            writes = sync.writes
            (cdi_dir / SERIAL_SPEC).unlink()
            # No rescan, no resync: the dir watch sees it.
            await eventually(lambda: sync.writes > writes, timeout=1)
            assert (cdi_dir / SERIAL_SPEC).read_bytes() == first
            # Replaced by hand (an editor's rename): written again as well.
            replacement = cdi_dir / "edited"
            replacement.write_bytes(b'{"kind":"example.com/serial","devices":[]}')
            os.replace(replacement, cdi_dir / SERIAL_SPEC)
            await eventually(lambda: sync.writes > writes + 1, timeout=1)
            assert (cdi_dir / SERIAL_SPEC).read_bytes() == first
            # Rewritten in place (no rename): the same.
            (cdi_dir / SERIAL_SPEC).write_bytes(b"{}")
            await eventually(lambda: sync.writes > writes + 2, timeout=1)
            assert (cdi_dir / SERIAL_SPEC).read_bytes() == first
            # Its mode changed (a runtime that cannot read it fails the container): the same.
            # (After the rewrite's own events have passed, so that only the chmod's can wake it.)
            await asyncio.sleep(0.3)
            os.chmod(cdi_dir / SERIAL_SPEC, 0o600)
            await eventually(lambda: sync.writes > writes + 3, timeout=1)
            assert (cdi_dir / SERIAL_SPEC).stat().st_mode & 0o777 != 0o600
    rewritten = [e for e in logs if e["event"] == "cdi.spec.rewritten"]
    assert [(e["resource"], e["log_level"]) for e in rewritten] == [(SERIAL, "warning")] * 4


async def test_odd_files_in_the_cdi_dir_do_not_stop_the_daemon(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    cdi_dir.mkdir()
    marked = claiming_spec(SERIAL, "static")
    (cdi_dir / "copy.yaml").write_bytes(marked)  # a spec that says it is ours, as .yaml
    (cdi_dir / "deep.json").write_text("[" * 200_000)  # the JSON parser's recursion limit
    async with in_process_daemon(
        settings(kubelet_dir, cdi_dir), [StaticScanner({SERIAL: devices(1)})]
    ) as daemon:
        session = await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        (answer,) = await session.allocate(["dev0"])
        assert answer.cdi_devices == (name("dev0"),)
    assert (cdi_dir / "copy.yaml").exists() and (cdi_dir / "deep.json").exists()


async def test_a_restart_with_the_same_devices_does_not_rewrite_the_spec(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    config = settings(kubelet_dir, cdi_dir, keep_on_exit=True)
    async with in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})]) as daemon:
        await started(kubelet)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
    before = stamp(cdi_dir / SERIAL_SPEC)
    async with in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})]) as daemon:
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        assert daemon.cdi_sync is not None and daemon.cdi_sync.writes == 0
    assert stamp(cdi_dir / SERIAL_SPEC) == before


# A CdiSync in a process of its own, for its peak RSS: the tree has one resource whose spec
# name is taken by a foreign file and one whose name is free.
RSS_PROBE = """
import asyncio, resource, sys
from pathlib import Path
from devplug.config import CdiSettings
from devplug.cdi.allocate import CdiCatalog
from devplug.cdi.sync import CdiSync
from devplug.model import DeviceInfo, DeviceNode, DeviceTree

async def main():
    catalog = CdiCatalog()
    sync = CdiSync(CdiSettings(dir=Path(sys.argv[1])), catalog, "probe")
    node = DeviceInfo(nodes=(DeviceNode("/dev/null"),))
    sync.submit(DeviceTree({"vendor.example/big": {"a": node}, "example.com/mine": {"a": node}}))
    task = asyncio.create_task(sync.run())
    # Until both are settled: "big" written (an empty dir) or refused (its name is taken).
    while catalog.get("example.com/mine") is None or (
        catalog.get("vendor.example/big") is None and sync.failures < 1
    ):
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await sync.close()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, sync.failures)

asyncio.run(main())
"""


async def peak_rss_kib(cdi_dir: Path) -> tuple[int, int]:
    """The probe's peak RSS in KiB, and how many writes it saw fail."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RSS_PROBE, str(cdi_dir), stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(60):
        out, _ = await process.communicate()
    assert process.returncode == 0
    rss, failures = out.splitlines()[-1].split()  # after the log lines
    return int(rss), int(failures)


async def test_a_huge_foreign_spec_is_never_read_whole(short_dir: Path) -> None:
    """A foreign 57 MB spec in the CDI dir (once 1.5 GB of RSS at start-up, parsed whole):
    the daemon's peak RSS stays what it is without the file, measured in the same run."""
    empty, crowded = short_dir / "empty", short_dir / "crowded"
    empty.mkdir()
    crowded.mkdir()
    device = b'{"name":"d%d","containerEdits":{"deviceNodes":[{"path":"/dev/null"}]}},'
    body = b"".join(device % i for i in range(800_000))
    big = b'{"cdiVersion":"0.5.0","kind":"vendor.example/big","devices":[' + body[:-1] + b"]}"
    assert len(big) > 57_000_000
    (crowded / "vendor.example-big.json").write_bytes(big)  # the name the resource wants
    (crowded / "vendor.example-other.json").write_bytes(big)  # and one it does not
    floor, refused = await peak_rss_kib(empty)
    assert refused == 0
    measured, refused = await peak_rss_kib(crowded)
    assert refused >= 1  # the taken name was seen, and left alone
    assert measured - floor < 16 * 1024, f"{floor} KiB without the files, {measured} KiB with"
    assert (crowded / "vendor.example-big.json").read_bytes() == big  # never touched


def test_narrowing_a_catalog_entry_through_an_edit_names_what_a_full_pass_names() -> None:
    from devplug.cdi.allocate import CdiResource
    from devplug.model import DeviceInfo, DeviceNode

    def node(i: int) -> DeviceInfo:
        return DeviceInfo(nodes=(DeviceNode(f"/dev/n{i}"),))

    resource = "example.com/dev"
    tree = DeviceTree({resource: {f"d{i}": node(i) for i in range(6)}})
    entry = CdiResource(
        "example.com/dev", "example.com-dev.json", frozenset(tree[resource]), tree[resource]
    )
    new = tree.with_changes(
        [(resource, "d1"), (resource, "d2")], {resource: {"d2": node(2), "d9": node(9)}}
    )
    edit = new.edit_since(resource, tree[resource])
    assert edit is not None
    fast, full = entry.narrowed_to(new[resource], edit), entry.narrowed_to(new[resource])
    assert fast.names == full.names == {"d0", "d3", "d4", "d5"}
