"""Real consumers: devplug's CDI specs and Allocate names, used by podman on this machine.

No umockdev here: devplug scans the machine's real sysfs with the generic scanner (the mem
class devices and /dev/ttyS0), and podman 4.3.1 starts real containers that get the devices
through CDI alone. Each device is checked by its major:minor, mode and group inside the
container against the host node. The same specs go through the CDI checker (the library
podman links), whose errors name the cause when podman only says "unresolvable CDI devices".
The node-mode tests at the end add nodes made with mknod, of the modes and group they need.

They need root, podman, runc and busybox-static (see podman_harness); without them they skip,
and with ``CI=true`` they fail instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from cdi_library import CheckResult, check_spec_dir, real_machine_env, require_checker, unavailable
from podman_harness import (
    HostCdiDir,
    Podman,
    device_id,
    is_char_device,
    node_access,
    why_podman_cannot_run,
)

from devplug.cdi.render import SpecRenderer
from devplug.cdi.spec import qualified_name
from devplug.model import ContainerAllocation, DeviceInfo, DeviceNode
from devplug.naming import spec_file_name
from devplug.testing import KubeletSimulator, PluginSession, daemon_process

DEVPLUG = Path(sys.executable).parent / "devplug"  # the installed console script

# Devices of the generic scanner's two resources below: (CDI class, device name = node name).
MEM, SERIAL = "mem", "serial"
GENERATE, DAEMON = "gen", "run"  # which test a kind belongs to
DEVICES = ((MEM, "null"), (MEM, "zero"), (MEM, "kmsg"), (SERIAL, "ttyS0"))
RESOURCES = {MEM: "example.com/mem", SERIAL: "example.com/serial"}
# Nodes every podman container has anyway: for them only the CDI name's resolution and the
# numbers are evidence, where for the others the node's presence is too.
PODMAN_DEFAULT_NODES = {"null", "zero", "full", "random", "urandom", "tty"}


def kind(cdi: HostCdiDir, use: str, device_class: str) -> str:
    """One kind per test (``use``): devplug leaves alone a spec file it did not write, so two
    tests must never share a spec file name."""
    return cdi.kind(f"{use}-{device_class}")


def config(cdi: HostCdiDir, use: str) -> str:
    kinds = {RESOURCES[c]: kind(cdi, use, c) for c in (MEM, SERIAL)}
    return (
        "scanners:\n"
        "  generic:\n"
        f"    - resource: {RESOURCES[MEM]}\n"
        "      match: {subsystem: mem}\n"
        f"    - resource: {RESOURCES[SERIAL]}\n"
        "      match: {subsystem: tty, devnode: /dev/ttyS0}\n"
        "cdi:\n"
        f"  instance: {cdi.token}-{use}\n"  # start-up clean-up then touches only this run's specs
        f"  kinds: {json.dumps(kinds)}\n"
        "hotplug: {source: none}\n"
    )


def host_has(name: str) -> bool:
    return is_char_device(f"/dev/{name}")


@pytest.fixture(scope="session")
def cdi_names() -> HostCdiDir:
    """This session's CDI vendor and kinds (the dir itself is entered by ``host_cdi``)."""
    return HostCdiDir()


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    """An isolated podman with the busybox image, once per session."""
    reason = why_podman_cannot_run()
    if reason is not None:
        unavailable(reason)
    podman = Podman(tmp_path_factory.mktemp("podman"))
    try:
        podman.prepare()
    except RuntimeError as exc:
        podman.remove_everything()
        unavailable(str(exc))
    try:
        yield podman
    finally:
        podman.remove_everything()


@pytest.fixture(scope="session")
def host_cdi(cdi_names: HostCdiDir, podman: Podman) -> Iterator[HostCdiDir]:
    """/var/run/cdi, where podman 4.3 reads specs; this session's files removed at the end."""
    with cdi_names:
        yield cdi_names


@dataclass(frozen=True)
class Generated:
    directory: Path
    files: tuple[Path, ...]


@pytest.fixture(scope="module")
def generated(cdi_names: HostCdiDir, tmp_path_factory: pytest.TempPathFactory) -> Generated:
    """``devplug cdi generate`` over the real sysfs into a temp dir."""
    base = tmp_path_factory.mktemp("generate")
    config_file, out = base / "config.yaml", base / "specs"
    config_file.write_text(config(cdi_names, GENERATE))
    result = subprocess.run(
        [str(DEVPLUG), "cdi", "generate", "--config", str(config_file), "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=real_machine_env(),
    )
    assert result.returncode == 0, result.stderr
    files = tuple(sorted(p for p in out.iterdir() if p.suffix in (".json", ".yaml")))
    assert files, f"no spec written: {result.stdout}{result.stderr}"
    return Generated(out, files)


@pytest.fixture(scope="module")
def installed(generated: Generated, host_cdi: HostCdiDir) -> Iterator[HostCdiDir]:
    """The generated specs copied into /var/run/cdi for the module's podman runs."""
    for spec_file in generated.files:
        host_cdi.install(spec_file)
    yield host_cdi
    host_cdi.remove_ours()


def test_generated_specs_load_in_the_cdi_library(
    generated: Generated, cdi_names: HostCdiDir
) -> None:
    require_checker()
    expected = [f"{kind(cdi_names, GENERATE, c)}={name}" for c, name in DEVICES if host_has(name)]
    result = check_spec_dir(generated.directory, expected)
    assert result.errors == {}, result
    assert set(result.specs) == {str(f) for f in generated.files}, result
    assert set(expected) <= set(result.devices), result
    assert result.ok, result
    for node in result.injected:
        assert f"{node.major:x}:{node.minor:x}" == device_id(node.path), result


def test_podman_refuses_a_name_no_spec_defines(installed: HostCdiDir, podman: Podman) -> None:
    # The control for the tests below: podman does read /var/run/cdi for our kinds, and an
    # unknown name is an error, not an ignored flag.
    result = podman.run([f"{kind(installed, GENERATE, MEM)}=no-such-device"], "ls", "/dev")
    assert result.returncode != 0
    assert "unresolvable CDI devices" in result.stderr, result.stderr


@pytest.mark.parametrize(("device_class", "name"), DEVICES, ids=[n for _, n in DEVICES])
def test_podman_gives_a_generated_device(
    installed: HostCdiDir,
    podman: Podman,
    generated: Generated,
    device_class: str,
    name: str,
) -> None:
    node = f"/dev/{name}"
    if not host_has(name):
        pytest.skip(f"this machine has no {node}")
    if name not in PODMAN_DEFAULT_NODES:
        without = podman.run([], "stat", "-c", "%t:%T", node)
        assert without.returncode != 0 and "No such file" in without.stderr, without
    cdi_name = f"{kind(installed, GENERATE, device_class)}={name}"
    result = podman.run([cdi_name], "stat", "-c", "%t:%T %a %g", node)
    assert result.returncode == 0, why(result, generated.directory, [cdi_name])
    # The host's numbers, and its mode and group (the spec's fileMode and gid: without them
    # runc makes the node 0666 and root's; this machine's /dev/kmsg is 0644, /dev/ttyS0 0600).
    assert result.stdout.strip() == f"{device_id(node)} {node_access(node)}"


def why(result: subprocess.CompletedProcess[str], spec_dir: Path, names: Sequence[str]) -> str:
    """podman's failure, with the CDI library's own account of the spec files."""
    checked: CheckResult | str
    try:
        checked = check_spec_dir(spec_dir, names)
    except Exception as exc:  # only decorates a failure: never hide podman's error
        checked = f"(checker unavailable: {exc})"
    return f"podman: {result.stderr.strip()}\nCDI library on {spec_dir}: {checked}"


async def allocate_with_cdi_names(
    session: PluginSession, ids: Sequence[str], timeout: float = 10
) -> ContainerAllocation:
    """Allocate ``ids``; again until the answer names them all in CDI (the daemon names only
    devices its spec on disk already defines, and writes the spec just after registering)."""
    deadline = time.monotonic() + timeout
    while True:
        (answer,) = await session.allocate(ids)
        if len(answer.cdi_devices) == len(ids) or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.05)


async def test_allocate_answers_work_in_podman(
    podman: Podman,
    host_cdi: HostCdiDir,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    tmp_path: Path,
) -> None:
    require_checker()
    wanted = {
        MEM: [n for c, n in DEVICES if c == MEM and host_has(n)],
        SERIAL: [n for c, n in DEVICES if c == SERIAL and host_has(n)],
    }
    config_file = tmp_path / "config.yaml"
    config_file.write_text(config(host_cdi, DAEMON))
    log = tmp_path / "devplug.log"
    with log.open("wb") as output:
        async with daemon_process(
            config_file,
            kubelet_dir,
            "--cdi-dir",
            str(host_cdi.path),
            # No umockdev preload: the real sysfs (UMOCKDEV_DIR is set only inside the
            # ``host`` fixture, which this test does not use).
            env={"LD_PRELOAD": ""},
            output=output.fileno(),
        ):
            try:
                for device_class, ids in wanted.items():
                    if ids:
                        await check_allocate(podman, host_cdi, kubelet, device_class, ids)
            except BaseException:
                # The daemon's last words, shown with the failure (without the retries).
                lines = [x for x in log.read_text().splitlines() if "allocate.complete" not in x]
                print("\n".join(lines[-40:]))
                raise


async def check_allocate(
    podman: Podman,
    host_cdi: HostCdiDir,
    kubelet: KubeletSimulator,
    device_class: str,
    ids: Sequence[str],
) -> None:
    session = await kubelet.wait_for_plugin(RESOURCES[device_class], timeout=30)
    await session.wait_for_update(lambda listed: set(ids) <= set(listed), timeout=30)
    answer = await allocate_with_cdi_names(session, ids)
    expected = kind(host_cdi, DAEMON, device_class)
    assert set(answer.cdi_devices) == {f"{expected}={i}" for i in ids}, answer
    nodes = {n.container_path: n.host_path for n in answer.nodes}
    assert len(nodes) == len(ids), answer

    # Only the CDI names go to podman: the nodes must come from the spec devplug wrote.
    command = ["stat", "-c", "%n %t:%T %a %g", *nodes]
    result = await asyncio.to_thread(podman.run, answer.cdi_devices, *command)
    assert result.returncode == 0, why(result, host_cdi.path, answer.cdi_devices)
    seen = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert seen == {path: f"{device_id(host)} {node_access(host)}" for path, host in nodes.items()}

    # The library's view of the same names, restricted to this daemon's files: other specs
    # in the machine's dir are not this test's to judge.
    checked = check_spec_dir(host_cdi.path, answer.cdi_devices)
    assert checked.errors_in([f"{host_cdi.vendor}-{DAEMON}-"]) == {}, checked
    assert checked.unresolved == () and checked.inject_error == "", checked
    assert {
        n.path: f"{n.major:x}:{n.minor:x} {n.file_mode:o} {n.gid}" for n in checked.injected
    } == seen


# ------------------------------------------------------------------------- node modes
#
# A CDI device node is no more open in a container than on the host. runc makes a node the OCI
# spec gives no mode 0666, owned by 0:0; the CDI library fills in only a node's type and
# numbers from the host. So the spec must carry the host node's mode (fileMode) and group
# (gid), or a 0600 node becomes writable by every user of the container. The host nodes here
# are made with mknod in a temp dir (char 1:3, the null device's numbers, so a container that
# opens one touches nothing), with the modes and group the tests need whatever this machine's
# /dev holds; devplug's renderer makes their spec, as the daemon does.

# A group no account of this machine is likely to have: a render node's group (root:render
# 0660) stands for any group that grants access on the host.
GROUP = 4242
USER = 1000  # a container user that is neither the node's owner nor in its group
NODES = {  # device id -> (mode, group) of its host node
    "private": (0o600, 0),
    "readable": (0o644, 0),
    "grouped": (0o660, GROUP),
}


def container_path(node_id: str) -> str:
    return f"/dev/devplug-mode-{node_id}"


@pytest.fixture(scope="module")
def host_nodes(tmp_path_factory: pytest.TempPathFactory, podman: Podman) -> dict[str, Path]:
    """The host nodes (after ``podman``, which skips or fails these tests without root)."""
    directory = tmp_path_factory.mktemp("nodes")
    nodes = {}
    for node_id, (mode, group) in NODES.items():
        path = directory / node_id
        os.mknod(path, stat.S_IFCHR | mode, os.makedev(1, 3))
        os.chmod(path, mode)  # mknod's mode went through the umask
        os.chown(path, 0, group)
        nodes[node_id] = path
    return nodes


@pytest.fixture(scope="module")
def spec_kind(
    host_cdi: HostCdiDir, host_nodes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """devplug's spec for the nodes, installed in /var/run/cdi; its kind."""
    kind = host_cdi.kind("modes")
    devices = {
        node_id: DeviceInfo(nodes=(DeviceNode(str(path), container_path(node_id)),))
        for node_id, path in host_nodes.items()
    }
    rendered = SpecRenderer(kind).render(devices)
    assert rendered is not None
    spec_file = tmp_path_factory.mktemp("modes-spec") / spec_file_name(kind)
    spec_file.write_bytes(rendered.data)
    installed = host_cdi.install(spec_file)
    yield kind
    installed.unlink(missing_ok=True)


def container_stat(podman: Podman, kind: str, node_id: str, *options: str) -> str:
    """``mode gid`` of the device's node inside a container (``uid`` too, after them)."""
    name = qualified_name(kind, node_id)
    result = podman.run([name], "stat", "-c", "%a %g %u", container_path(node_id), options=options)
    assert result.returncode == 0, f"podman: {result.stderr.strip()}"
    return result.stdout.strip()


@pytest.mark.parametrize("node_id", list(NODES))
def test_a_container_sees_the_host_nodes_mode_and_group(
    podman: Podman, spec_kind: str, host_nodes: dict[str, Path], node_id: str
) -> None:
    # Root's container: the node is root's (no uid in the spec, and the process is root).
    expected = f"{node_access(host_nodes[node_id])} 0"
    assert expected.startswith(f"{NODES[node_id][0]:o} ")  # the node is as made
    assert container_stat(podman, spec_kind, node_id) == expected


def test_a_non_root_container_owns_its_node_and_the_group_stays_the_hosts(
    podman: Podman, spec_kind: str, host_nodes: dict[str, Path]
) -> None:
    # No uid in the spec: the CDI library gives the node to the container's user, the one the
    # device was allocated to (containerd's device_ownership_from_security_context does the
    # same for device specs). The gid in the spec keeps the host's group: without it the
    # library would give the node the process's group instead, and the group's access would
    # move to whoever shares that group.
    seen = container_stat(podman, spec_kind, "grouped", "--user", f"{USER}:{USER}")
    assert seen == f"{node_access(host_nodes['grouped'])} {USER}"


def test_the_cdi_library_hands_the_runtime_the_hosts_mode_and_group(
    spec_kind: str, host_cdi: HostCdiDir, host_nodes: dict[str, Path]
) -> None:
    require_checker()
    names = [qualified_name(spec_kind, node_id) for node_id in NODES]
    checked = check_spec_dir(host_cdi.path, names)
    assert checked.errors_in([spec_file_name(spec_kind)]) == {}, checked
    assert checked.unresolved == () and checked.inject_error == "", checked
    given = {n.path: (n.file_mode, n.gid, n.uid) for n in checked.injected}
    assert given == {
        container_path(node_id): (mode, group, None) for node_id, (mode, group) in NODES.items()
    }, checked
