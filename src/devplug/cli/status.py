"""``devplug status``: ask every plugin socket in the kubelet dir what it serves.

Each socket is probed the way the kubelet talks to a plugin: GetDevicePluginOptions, then the
first ListAndWatch message; any vendor's v1beta1 plugin answers. A socket does not say which
resource it serves (the plugin told the kubelet in Register), so the resource is known only
for devplug's own sockets, whose names spell it (``devplug-<domain>_<name>.sock``). What a
plugin that did not answer holds is unknown: its counts are None (null), never 0.

With ``--pods`` (:mod:`devplug.cli.holders`) it also reads the kubelet's pod resources API
and lists each device of devplug's resources with the containers that hold it.

The DRA drivers in the kubelet's plugin registry, and the claims devplug's driver has prepared,
are listed after the plugins (:mod:`devplug.cli.dra_status`); so are the devices an operator
cordoned, with why and since when, asked of each devplug daemon's control socket: with
``--pods``, a cordoned device no pod holds any more is ``drained`` (:mod:`devplug.cli.cordon`).

Nor does a socket say whether its plugin is registered. What status can see is the kubelet's
own socket: without a kubelet listening on ``kubelet.sock`` no plugin can be registered, so a
plugin that answers is then "serving, waiting for the kubelet". (devplug's ``/readyz`` tells
whether each of its resources is registered.)

:func:`status_command` is ``devplug status``: a table, JSON or YAML on stdout, and exit status
1 when a plugin did not answer, or with ``--pods`` when the pod resources API did not (scripts
and probes read it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from devplug._kits.printable import escaped
from devplug.cli.cordon import (
    beside_cordons,
    cordon_rows,
    cordons_document,
    cordons_table,
    holders_by_device,
    kubelet_dir_of,
)
from devplug.cli.dra_status import beside_dra, dra_document, dra_table
from devplug.cli.holders import (
    Listed,
    PodsStatus,
    allocatable_document,
    device_document,
    devices_table,
    join,
    read_holders,
)
from devplug.kubelet.podresources import NOT_A_SOCKET
from devplug.logconfig import quiet_grpc_core
from devplug.naming import resource_name_problem

# grpc, and the modules that import it, are imported where they are used: status_command
# quietens grpc-core first, which works only before grpc loads.

PROBE_TIMEOUT_S = 3.0

SERVING = "serving"
WAITING = "serving, waiting for the kubelet"
NOT_ANSWERING = "not answering"


@dataclass(frozen=True, slots=True)
class KubeletStatus:
    socket: str  # the kubelet's socket, as a path
    state: str  # "listening", "absent" or "not answering"
    error: str | None = None

    @property
    def listening(self) -> bool:
        return self.state == "listening"

    def describe(self) -> str:
        if self.listening:
            return f"kubelet: listening on {self.socket}"
        if self.state == "absent":
            path = Path(self.socket)
            return (
                f"kubelet: no {path.name} in {path.parent}: plugins "
                "register once it starts (devplug creates its sockets then)"
            )
        if self.error == NOT_A_SOCKET:  # a file in its place: nothing a restart would fix
            return f"kubelet: {self.socket} is not a socket"
        return f"kubelet: {self.socket} does not answer ({self.error}): down or restarting"


@dataclass(frozen=True, slots=True)
class PluginStatus:
    socket: str  # file name in the kubelet dir
    resource: str | None  # known for devplug's sockets only
    # None: unknown (the plugin did not answer), which a 0 would hide.
    healthy: int | None = None
    unhealthy: int | None = None
    numa_nodes: tuple[int, ...] | None = None
    preferred_allocation: bool | None = None
    pre_start: bool | None = None
    error: str | None = None  # why the probe failed
    devices: tuple[Listed, ...] | None = None  # its first list (None: it did not answer)

    def state(self, kubelet: KubeletStatus) -> str:
        if self.error is not None:
            return NOT_ANSWERING
        return SERVING if kubelet.listening else WAITING


def resource_of_socket(name: str) -> str | None:
    """``devplug-gpu.intel.com_i915.sock`` -> ``gpu.intel.com/i915``; None for other names
    (and for devplug's hashed names of very long resources)."""
    if not (name.startswith("devplug-") and name.endswith(".sock")):
        return None
    body = name.removeprefix("devplug-").removesuffix(".sock")
    domain, sep, short = body.partition("_")
    if not sep:
        return None
    resource = f"{domain}/{short}"
    return resource if resource_name_problem(resource) is None else None


def plugin_sockets(kubelet_dir: Path) -> list[Path]:
    """Unix sockets in the kubelet dir, except the kubelet's own and temp names."""
    from devplug.kubelet.registration import KUBELET_SOCKET

    found = []
    with os.scandir(kubelet_dir) as entries:
        for entry in entries:
            if entry.name == KUBELET_SOCKET or entry.name.startswith("."):
                continue
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    found.append(Path(entry.path))
            except OSError:
                continue
    return sorted(found)


async def probe(path: Path, timeout: float = PROBE_TIMEOUT_S) -> PluginStatus:
    import grpc

    from devplug._proto import deviceplugin_v1beta1_pb2 as pb
    from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

    name = path.name
    resource = resource_of_socket(name)
    # gRPC's unix: target wants an absolute path ("unix://rel/x" names an authority).
    channel = grpc.aio.insecure_channel(f"unix://{path.absolute()}")
    try:
        stub = pb_grpc.DevicePluginStub(channel)
        options = await stub.GetDevicePluginOptions(pb.Empty(), timeout=timeout)
        stream = stub.ListAndWatch(pb.Empty())
        try:
            async with asyncio.timeout(timeout):
                first = await stream.read()
        finally:
            stream.cancel()
        if not isinstance(first, pb.ListAndWatchResponse):
            return PluginStatus(name, resource, error="ListAndWatch ended without a list")
        health = Counter(device.health for device in first.devices)
        numa = sorted({node.ID for device in first.devices for node in device.topology.nodes})
        return PluginStatus(
            name,
            resource,
            healthy=health.get("Healthy", 0),
            unhealthy=sum(n for h, n in health.items() if h != "Healthy"),
            numa_nodes=tuple(numa),
            preferred_allocation=options.get_preferred_allocation_available,
            pre_start=options.pre_start_required,
            devices=tuple(
                Listed(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in first.devices
            ),
        )
    except grpc.aio.AioRpcError as exc:
        return PluginStatus(name, resource, error=f"{exc.code().name}: {exc.details()}")
    except TimeoutError:
        return PluginStatus(name, resource, error=f"no ListAndWatch message within {timeout} s")
    finally:
        await channel.close(None)


async def probe_all(kubelet_dir: Path, timeout: float = PROBE_TIMEOUT_S) -> list[PluginStatus]:
    sockets = plugin_sockets(kubelet_dir)
    return list(await asyncio.gather(*(probe(path, timeout) for path in sockets)))


async def probe_kubelet(kubelet_dir: Path, timeout: float = PROBE_TIMEOUT_S) -> KubeletStatus:
    """Whether the kubelet listens on its socket: a connection is opened and closed, nothing
    is sent (a Register call would be an action, not a question)."""
    from devplug.kubelet.registration import KUBELET_SOCKET

    path = kubelet_dir.absolute() / KUBELET_SOCKET
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return KubeletStatus(str(path), "not answering", NOT_A_SOCKET)
    except FileNotFoundError:
        return KubeletStatus(str(path), "absent")
    except OSError as exc:
        return KubeletStatus(str(path), "not answering", exc.strerror or str(exc))
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_unix_connection(path)
    except TimeoutError:
        return KubeletStatus(str(path), "not answering", f"no connection within {timeout} s")
    except OSError as exc:
        return KubeletStatus(str(path), "not answering", exc.strerror or str(exc))
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return KubeletStatus(str(path), "listening")


async def survey(
    kubelet_dir: Path, timeout: float = PROBE_TIMEOUT_S
) -> tuple[KubeletStatus, list[PluginStatus]]:
    kubelet, plugins = await asyncio.gather(
        probe_kubelet(kubelet_dir, timeout), probe_all(kubelet_dir, timeout)
    )
    return kubelet, plugins


def status_command(
    kubelet_dir: Path | None,
    output: str,
    timeout: float,
    *,
    pods: bool = False,
    pod_resources_socket: Path | None = None,
) -> int:
    """``devplug status``: 0 when every plugin answered, 1 when one did not or the dir cannot
    be read, or (``pods``) the pod resources API did not answer."""
    from devplug.kubelet.podresources import default_socket

    quiet_grpc_core()  # before grpc loads (in probe)
    kubelet_dir, source = kubelet_dir_of(kubelet_dir)
    if kubelet_dir.exists() and not kubelet_dir.is_dir():
        print(f"devplug: {source}: {kubelet_dir} is not a directory", file=sys.stderr)
        return 2
    socket = pod_resources_socket or default_socket(kubelet_dir.absolute())
    try:
        ((kubelet, plugins, holders), dra), daemons = asyncio.run(
            beside_cordons(
                beside_dra(survey_all(kubelet_dir, timeout, socket, pods), kubelet_dir, timeout),
                kubelet_dir,
                timeout,
            )
        )
    except OSError as exc:
        print(f"devplug: cannot read {kubelet_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    failed = any(plugin.error is not None for plugin in plugins)
    failed |= any(driver.error is not None for driver in dra)
    failed |= holders is not None and not holders.available
    cordons = cordon_rows(daemons, holders_by_device(holders))
    if output in ("json", "yaml"):
        listed = [plugin_document(p, kubelet, holders) for p in plugins]
        document: dict[str, object] = {
            "kubelet_dir": str(kubelet_dir),
            "kubelet": asdict(kubelet),
            "plugins": listed,
        }
        if holders is not None:
            document["pod_resources"] = holders.document()
        document["dra"] = [dra_document(driver) for driver in dra]
        document["cordons"] = cordons_document(cordons, daemons)
        if output == "json":
            sys.stdout.write(json.dumps(document, indent=2) + "\n")
        else:
            import yaml

            sys.stdout.write(yaml.safe_dump(document, sort_keys=False))
    elif not plugins:
        print(escaped(f"no device plugin sockets in {kubelet_dir}"))
        print(escaped(kubelet.describe()))
        if holders is not None:
            print(escaped(holders.describe()))
    else:
        sys.stdout.write(status_table(plugins, kubelet, holders))
        if holders is not None:
            sys.stdout.write("\n" + devices_table(holders))
    if dra and output not in ("json", "yaml"):
        sys.stdout.write("\n" + dra_table(dra))
    said = cordons_table(cordons, daemons, pods=holders is not None)
    if said and output not in ("json", "yaml"):
        sys.stdout.write("\n" + said)
    return 1 if failed else 0


async def survey_all(
    kubelet_dir: Path, timeout: float, socket: Path, pods: bool
) -> tuple[KubeletStatus, list[PluginStatus], PodsStatus | None]:
    """The survey, and with ``pods`` the pod resources API read beside it."""
    if not pods:
        kubelet, plugins = await survey(kubelet_dir, timeout)
        return kubelet, plugins, None
    (kubelet, plugins), reading = await asyncio.gather(
        survey(kubelet_dir, timeout), read_holders(socket, timeout)
    )
    served = {p.resource: p.devices for p in plugins if p.resource and p.devices is not None}
    return kubelet, plugins, join(socket, reading, served)


def plugin_document(
    plugin: PluginStatus, kubelet: KubeletStatus, holders: PodsStatus | None
) -> dict[str, object]:
    """A plugin in JSON/YAML; with ``--pods``, devplug's also with its devices and holders."""
    document = asdict(plugin)
    del document["devices"]
    document["numa_nodes"] = None if plugin.numa_nodes is None else list(plugin.numa_nodes)
    document["state"] = plugin.state(kubelet)
    if holders is not None:
        mine = [device_document(r) for r in holders.devices if r.resource == plugin.resource]
        check = holders.allocatable.get(plugin.resource or "")
        document["devices"] = mine if plugin.resource and plugin.devices is not None else None
        document["allocatable"] = None if check is None else allocatable_document(check)
    return document


UNKNOWN = "unknown"


def status_table(
    plugins: list[PluginStatus], kubelet: KubeletStatus, holders: PodsStatus | None = None
) -> str:
    """One row per plugin, then a line about the kubelet. A count nobody answered for is
    ``unknown``; ``-`` is an answer (no NUMA node, no resource name in the socket's). With
    ``holders`` (``--pods``), an ALLOCATABLE column: the kubelet's allocatable set of the
    resource against the devices the plugin lists Healthy. What a plugin or the dir supplies
    is printed escaped (:mod:`devplug._kits.printable`)."""
    header = ["SOCKET", "RESOURCE", "HEALTHY", "UNHEALTHY", "NUMA"]
    rows = [[*header, "ALLOCATABLE", "STATUS"] if holders else [*header, "STATUS"]]
    for plugin in plugins:
        numa = plugin.numa_nodes
        row = [
            plugin.socket,
            plugin.resource or "-",
            UNKNOWN if plugin.healthy is None else str(plugin.healthy),
            UNKNOWN if plugin.unhealthy is None else str(plugin.unhealthy),
            UNKNOWN if numa is None else ",".join(map(str, numa)) or "-",
        ]
        if holders is not None:
            check = holders.allocatable.get(plugin.resource or "")
            row.append("-" if check is None else check.describe())
        # Escaped: a socket's name and a plugin's error are any vendor's text.
        rows.append([escaped(cell) for cell in (*row, plugin.error or plugin.state(kubelet))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    lines.append(escaped(kubelet.describe()))
    return "\n".join(lines) + "\n"
