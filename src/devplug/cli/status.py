"""``devplug status``: ask every plugin socket in the kubelet dir what it serves.

Each socket is probed the way the kubelet talks to a plugin: GetDevicePluginOptions, then the
first ListAndWatch message; any vendor's v1beta1 plugin answers. A socket does not say which
resource it serves (the plugin told the kubelet in Register), so the resource is known only
for devplug's own sockets, whose names spell it (``devplug-<domain>_<name>.sock``).

:func:`status_command` is ``devplug status``: a table, JSON or YAML on stdout, and exit status
1 when a plugin did not answer (scripts and probes read it).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.kubelet.registration import KUBELET_SOCKET
from devplug.naming import resource_name_problem

PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class PluginStatus:
    socket: str  # file name in the kubelet dir
    resource: str | None  # known for devplug's sockets only
    healthy: int = 0
    unhealthy: int = 0
    numa_nodes: tuple[int, ...] = ()
    preferred_allocation: bool | None = None
    pre_start: bool | None = None
    error: str | None = None  # why the probe failed


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


def status_command(kubelet_dir: Path | None, output: str, timeout: float) -> int:
    """``devplug status``: 0 when every plugin answered, 1 when one did not or the dir cannot
    be read."""
    from devplug.config import DEFAULT_KUBELET_DIR

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    source = "--kubelet-dir"
    if kubelet_dir is None:
        from_env = os.environ.get("DEVPLUG_KUBELET_DIR")
        source = "DEVPLUG_KUBELET_DIR" if from_env else "the kubelet dir"
        kubelet_dir = Path(from_env or DEFAULT_KUBELET_DIR)
    if kubelet_dir.exists() and not kubelet_dir.is_dir():
        print(f"devplug: {source}: {kubelet_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        plugins = asyncio.run(probe_all(kubelet_dir, timeout))
    except OSError as exc:
        print(f"devplug: cannot read {kubelet_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    failed = any(plugin.error is not None for plugin in plugins)
    if output in ("json", "yaml"):
        listed = [{**asdict(p), "numa_nodes": list(p.numa_nodes)} for p in plugins]
        document = {"kubelet_dir": str(kubelet_dir), "plugins": listed}
        if output == "json":
            sys.stdout.write(json.dumps(document, indent=2) + "\n")
        else:
            import yaml

            sys.stdout.write(yaml.safe_dump(document, sort_keys=False))
    elif not plugins:
        print(f"no device plugin sockets in {kubelet_dir}")
    else:
        sys.stdout.write(status_table(plugins))
    return 1 if failed else 0


def status_table(plugins: list[PluginStatus]) -> str:
    rows = [("SOCKET", "RESOURCE", "HEALTHY", "UNHEALTHY", "NUMA", "STATUS")]
    for plugin in plugins:
        answered = plugin.error is None
        rows.append(
            (
                plugin.socket,
                plugin.resource or "-",
                str(plugin.healthy) if answered else "-",
                str(plugin.unhealthy) if answered else "-",
                ",".join(map(str, plugin.numa_nodes)) or "-",
                plugin.error or "serving",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines) + "\n"
