"""A DRA kubelet plugin under test, with real parts around it: the stand-in API server read
through the lightkube client, a pool built by the slice builder, CDI specs rendered by the
CDI renderer and known to a real CdiCatalog, the checkpoint on disk, and the kubelet DRA
stand-in on real unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devplug.cdi.allocate import CdiCatalog, CdiResource
from devplug.cdi.render import SpecRenderer, cdi_device_name, default_kind
from devplug.cdi.spec import qualified_name
from devplug.cdi.stamps import file_stamp
from devplug.dra.apiclient import LightkubeApi, load_api_client
from devplug.dra.checkpoint import CHECKPOINT_FILE, Checkpoint
from devplug.dra.claims import ClaimPreparer
from devplug.dra.registration import KubeletPlugin, PluginPaths, PluginTiming
from devplug.dra.slices import Pool, build_pool
from devplug.model import DeviceInfo, DeviceNode
from devplug.naming import spec_file_name
from devplug.testing.apiserver import ApiServer, allocated_claim
from devplug.testing.kubelet_dra import ClaimName, KubeletDra

DRIVER = "gpu.devplug.example.com"
NODE = "node1"
RESOURCE = "devplug.example.com/gpu"
KIND = default_kind(RESOURCE)
IDS = ("0000:03:00.0", "0000:04:00.0", "0000:05:00.0")
NAMES = ("0000-03-00-0", "0000-04-00-0", "0000-05-00-0")  # dra.naming's names of IDS
FAST = PluginTiming(backoff_initial_s=0.02, backoff_max_s=0.2, stat_backstop_s=1.0)


def gpu(device_id: str) -> DeviceInfo:
    return DeviceInfo(nodes=(DeviceNode("/dev/null", f"/dev/dri/card-{device_id[5:7]}"),))


class CatalogCdiIds:
    """The CDI ids of a device as the catalog knows its spec on disk (what the composition
    gives the DRA front: the device-plugin front names the same ids in Allocate)."""

    def __init__(self, catalog: CdiCatalog, tree: Mapping[str, Mapping[str, DeviceInfo]]) -> None:
        self.catalog = catalog
        self.tree = tree

    def cdi_device_ids(self, resource: str, device_id: str) -> tuple[str, ...]:
        self.catalog.confirm(resource)  # a spec deleted behind our back is noticed here
        entry = self.catalog.get(resource)
        info = self.tree.get(resource, {}).get(device_id)
        if entry is None or info is None or not entry.defines(device_id, info):
            return ()
        return (qualified_name(entry.kind, cdi_device_name(device_id)),)


@dataclass
class PluginEnv:
    root: Path  # the kubelet's root dir
    api: ApiServer
    client: LightkubeApi
    kubelet: KubeletDra
    catalog: CdiCatalog
    cdi_dir: Path
    tree: dict[str, dict[str, DeviceInfo]]
    pool: Pool | None
    paths: PluginPaths = field(init=False)
    plugin: KubeletPlugin | None = None
    # Claim name -> an event its reads wait for (a slow API server, for that claim alone).
    held: dict[str, asyncio.Event] = field(default_factory=dict)
    reads: list[str] = field(default_factory=list)  # the claims read, by name, in order
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.paths = PluginPaths.under(self.root, DRIVER)

    @property
    def checkpoint_path(self) -> Path:
        return self.paths.plugin_dir / CHECKPOINT_FILE

    def new_preparer(self) -> ClaimPreparer:
        return ClaimPreparer(
            driver=DRIVER,
            pool_name=NODE,
            read_claim=self.read_claim,
            pool=lambda: self.pool,
            advertised=lambda resource, device_id: self.tree.get(resource, {}).get(device_id),
            cdi=CatalogCdiIds(self.catalog, self.tree),
            checkpoint=Checkpoint(self.checkpoint_path, DRIVER),
        )

    async def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The API client's get_claim, held back while ``held[name]`` is not set."""
        self.reads.append(name)
        gate = self.held.get(name)
        if gate is not None:
            await gate.wait()
        return await self.client.get_claim(namespace, name)

    async def start_plugin(self) -> KubeletPlugin:
        """Start the plugin (as the daemon does) and wait until both sockets are in place."""
        assert self._task is None, "the plugin runs already"
        plugin = KubeletPlugin(self.paths, self.new_preparer(), timing=FAST)
        self.plugin = plugin
        self._task = asyncio.create_task(plugin.run(), name="dra-plugin-under-test")
        waiting = asyncio.create_task(plugin.serving.wait_for(bool, timeout=10))
        done, _ = await asyncio.wait({waiting, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            waiting.cancel()
            await asyncio.wait({waiting})
            self._task.result()  # raises what stopped it
            raise AssertionError("the plugin stopped by itself")
        waiting.result()
        return plugin

    async def stop_plugin(self) -> None:
        """What SIGTERM does to the daemon's plugin task: cancel it, let it clean up."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                raise AssertionError("the plugin failed") from task.exception()

    def put_claim(
        self,
        name: str,
        devices: Sequence[str],
        *,
        uid: str | None = None,
        namespace: str = "team-a",
        driver: str = DRIVER,
        extra_results: Sequence[Mapping[str, Any]] = (),
        admin_access: bool = False,
    ) -> ClaimName:
        """A claim as the scheduler leaves it, allocated ``devices`` (names in the pool) of
        ``driver`` (request ``gpus``), plus ``extra_results``; stored at the API server."""
        results: list[dict[str, Any]] = [
            {"request": "gpus", "driver": driver, "pool": NODE, "device": device}
            for device in devices
        ]
        if admin_access:
            for result in results:
                result["adminAccess"] = True
        results.extend(dict(r) for r in extra_results)
        stored = self.api.put_claim(
            allocated_claim(name, namespace, results, uid=uid, device_class=DRIVER)
        )
        return ClaimName.of(stored)


def write_spec(catalog: CdiCatalog, cdi_dir: Path, devices: Mapping[str, DeviceInfo]) -> Path:
    """Render the resource's spec with the CDI renderer, write it, and tell the catalog."""
    rendered = SpecRenderer(KIND).render(devices)
    assert rendered is not None
    path = cdi_dir / spec_file_name(KIND)
    path.write_bytes(rendered.data)
    entry = CdiResource(
        kind=KIND,
        file_name=path.name,
        names=rendered.names,
        devices=dict(devices),
        path=path,
        stamp=file_stamp(path),
    )
    catalog.set(RESOURCE, entry)
    return path


@contextlib.asynccontextmanager
async def plugin_env(
    short_dir: Path, *, health_interval_s: float = 0.2, start: bool = True
) -> AsyncIterator[PluginEnv]:
    """The plugin (started unless ``start`` is False) and everything around it."""
    root = short_dir / "kubelet"
    cdi_dir = short_dir / "cdi"
    cdi_dir.mkdir()
    tree = {RESOURCE: {device_id: gpu(device_id) for device_id in IDS}}
    catalog = CdiCatalog()
    write_spec(catalog, cdi_dir, tree[RESOURCE])
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1)
    assert sorted(pool.devices) == sorted(NAMES)
    async with contextlib.AsyncExitStack() as stack:
        api = await stack.enter_async_context(ApiServer())
        client = load_api_client({"KUBECONFIG": str(api.write_kubeconfig(short_dir / "kc"))})
        stack.push_async_callback(client.aclose)
        kubelet = await stack.enter_async_context(
            KubeletDra(root / "plugins_registry", health_interval_s=health_interval_s)
        )
        env = PluginEnv(root, api, client, kubelet, catalog, cdi_dir, tree, pool)
        stack.push_async_callback(env.stop_plugin)
        if start:
            await env.start_plugin()
        yield env
