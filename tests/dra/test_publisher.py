"""devplug.dra.publisher: this node's pool as ResourceSlices, kept published through hotplug,
conflicts, wipes and outages, against the stand-in API server with the real lightkube client.

No test times anything: each waits for a state of the stand-in (``wait_for``) and counts its
requests. Where a test lets time pass (an outage, an idle spell), it only bounds requests
from above, which a slower machine makes easier to meet, not harder.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from dra_schemas import VERSIONS, schema_errors
from structlog.testing import capture_logs

from devplug._kits.values import LatestValue
from devplug.dra.apiclient import (
    ApiStatusError,
    JsonObject,
    KubeApi,
    LightkubeApi,
    load_api_client,
)
from devplug.dra.field_errors import FieldError, invalid, too_many
from devplug.dra.naming import device_name, slice_name
from devplug.dra.publisher import PublishTiming, SlicePublisher
from devplug.dra.validate import validate_resource_slice
from devplug.model import DeviceInfo, DeviceTree, Health
from devplug.testing import eventually
from devplug.testing.apiserver import ApiServer

NODE, DRIVER = "node1", "gpu.devplug.example.com"
GPU, OTHER = "gpu.devplug.example.com/gpu", "gpu.devplug.example.com/other"
FAST = PublishTiming(settle_s=0.05, retry_initial_s=0.05, retry_max_s=0.4)

Trees = LatestValue[DeviceTree | None]


def address(n: int) -> str:
    return f"0000:{n // 256 + 1:02x}:{n % 256 // 8:02x}.{n % 8}"


def gpus(numbers: range | list[int], **unhealthy: Health) -> dict[str, DeviceInfo]:
    return {
        address(n): DeviceInfo(
            numa_nodes=(n % 2,),
            sources=(f"/sys/devices/pci0000:00/0000:00:01.0/{address(n)}",),
            health=unhealthy.get(f"n{n}", Health.HEALTHY),
        )
        for n in numbers
    }


def tree(numbers: range | list[int], **extra: Any) -> DeviceTree:
    return DeviceTree({GPU: gpus(numbers, **extra)})


def names(numbers: range | list[int]) -> set[str]:
    return {device_name(address(n)) for n in numbers}


# ------------------------------------------------------------------ what the stand-in holds


def pool_slices(api: ApiServer) -> dict[str, JsonObject]:
    return api.slices(f"spec.driver={DRIVER},spec.nodeName={NODE}")


def published_devices(api: ApiServer) -> set[str]:
    return {d["name"] for s in pool_slices(api).values() for d in s["spec"].get("devices", [])}


def generations(api: ApiServer) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in pool_slices(api).values()}


def complete_with(expected: set[str]) -> Callable[[ApiServer], bool]:
    """The pool is whole (all slices at one generation, as many as each says) and publishes
    exactly ``expected``."""

    def check(api: ApiServer) -> bool:
        slices = pool_slices(api).values()
        pools = {
            (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
            for s in slices
        }
        if len(pools) != 1:
            return False
        ((_, count),) = pools
        return count == len(slices) and published_devices(api) == expected

    return check


def verbs(api: ApiServer, since: int = 0) -> Counter[tuple[str, int]]:
    """(verb, code) of the requests seen after the first ``since``."""
    return Counter((r.verb, r.code) for r in list(api.request_log)[since:])


# ------------------------------------------------------------------ fixtures


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with ApiServer() as server:
        server.put_node(NODE)
        yield server


@pytest.fixture
async def client(api: ApiServer, tmp_path: Path) -> AsyncIterator[LightkubeApi]:
    client = load_api_client({"KUBECONFIG": str(api.write_kubeconfig(tmp_path / "kubeconfig"))})
    yield client
    await client.aclose()


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, *, with_node: bool = True, **options: Any
) -> AsyncIterator[tuple[ApiServer, LightkubeApi]]:
    """A stand-in of its own (``options`` as ApiServer takes them) and a client of it."""
    async with ApiServer(**options) as api:
        if with_node:
            api.put_node(NODE)
        kube = load_api_client({"KUBECONFIG": str(api.write_kubeconfig(tmp_path / "own"))})
        try:
            yield api, kube
        finally:
            await kube.aclose()


@contextlib.asynccontextmanager
async def publishing(kube: KubeApi, trees: Trees, **options: Any) -> AsyncIterator[SlicePublisher]:
    options.setdefault("timing", FAST)
    publisher = SlicePublisher(
        kube, trees, node_name=NODE, driver=DRIVER, resources={GPU}, **options
    )
    task = asyncio.create_task(publisher.run(), name="publisher-under-test")
    try:
        yield publisher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ------------------------------------------------------------------ first publish


async def test_first_publish_is_a_whole_valid_pool_owned_by_the_node(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(200)))
    async with publishing(client, trees) as publisher:
        await api.wait_for(complete_with(names(range(200))), what="the pool published")
        slices = pool_slices(api)
        assert sorted(slices) == [slice_name(NODE, DRIVER, 0), slice_name(NODE, DRIVER, 1)]
        node_uid = api.put_node(NODE)["metadata"]["uid"]
        for obj in slices.values():
            assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 2}
            assert obj["spec"]["nodeName"] == NODE and obj["spec"]["driver"] == DRIVER
            assert obj["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": NODE,
                    "uid": node_uid,
                    "controller": True,
                }
            ]
            assert validate_resource_slice(obj) == []
            for version in VERSIONS:
                assert schema_errors(obj, version) == []
        pool = await publisher.published.wait_for(lambda p: p is not None, timeout=5)
        assert pool is not None and set(pool.devices) == names(range(200))
        assert pool.generation == 1
        assert publisher.stats.devices == 200 and publisher.stats.slices == 2


async def test_an_empty_tree_is_published_as_an_empty_pool(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(DeviceTree({OTHER: gpus(range(3))}))  # nothing of GPU
    async with publishing(client, trees):
        await api.wait_for(complete_with(set()), what="one empty slice")
        assert len(pool_slices(api)) == 1


async def test_nothing_is_published_before_the_first_tree(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(None)
    async with publishing(client, trees):
        await api.wait_for(lambda a: a.open_watches == 1, what="the publisher watching")
        await asyncio.sleep(0.5)  # ten times the settling, for a publish that must not come
        assert api.writes == 0 and pool_slices(api) == {}
        trees.set(tree(range(2)))
        await api.wait_for(complete_with(names(range(2))), what="the pool published")


async def test_it_follows_an_async_iterator_of_trees(api: ApiServer, client: LightkubeApi) -> None:
    go_on = asyncio.Event()

    async def scans() -> AsyncIterator[DeviceTree]:
        yield tree(range(2))
        await go_on.wait()
        yield tree(range(3))
        await asyncio.get_running_loop().create_future()

    publisher = SlicePublisher(client, scans(), node_name=NODE, driver=DRIVER, timing=FAST)
    task = asyncio.create_task(publisher.run())
    try:
        await api.wait_for(complete_with(names(range(2))), what="the first tree")
        go_on.set()
        await api.wait_for(complete_with(names(range(3))), what="the second tree")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_node_uid_is_waited_for(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, with_node=False) as (api, kube),
        publishing(kube, LatestValue(tree(range(2)))),
    ):
        await api.wait_for(lambda a: a.requests["get"] >= 2, what="node reads retried")
        assert api.writes == 0  # no slice without its owner
        uid = api.put_node(NODE)["metadata"]["uid"]
        await api.wait_for(complete_with(names(range(2))), what="published once known")
        (obj,) = pool_slices(api).values()
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid


# ------------------------------------------------------------------ hotplug


async def test_a_hotplug_burst_bumps_the_generation_once(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(10)))
    # A long settle: the burst below is over well within it, however slow the machine.
    timing = PublishTiming(settle_s=2.0, retry_initial_s=0.05, retry_max_s=0.4)
    async with publishing(client, trees, timing=timing):
        await api.wait_for(complete_with(names(range(10))), what="first publish")
        writes = api.writes
        for numbers in ([*range(10), 10], [*range(10), 10, 11], [*range(1, 10), 10, 11]):
            trees.set(tree(numbers))
            # Apart: a publisher that did not settle would publish each change on its own.
            await asyncio.sleep(0.05)
        expected = names([*range(1, 10), 10, 11])
        await api.wait_for(complete_with(expected), what="the burst published")
        assert generations(api) == {2}
        assert api.writes == writes + 1  # one PUT of the one slice


async def test_the_slice_count_follows_the_device_count(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(128)))
    async with publishing(client, trees):
        await api.wait_for(complete_with(names(range(128))), what="one full slice")
        assert len(pool_slices(api)) == 1

        trees.set(tree(range(129)))
        await api.wait_for(complete_with(names(range(129))), what="a second slice")
        assert len(pool_slices(api)) == 2 and generations(api) == {2}

        since = len(api.request_log)
        trees.set(tree(range(1, 129)))
        await api.wait_for(complete_with(names(range(1, 129))), what="back to one slice")
        assert list(pool_slices(api)) == [slice_name(NODE, DRIVER, 0)] and generations(api) == {3}
        assert verbs(api, since)[("delete", 200)] == 1  # the obsolete slice, with preconditions


async def test_an_unhealthy_device_leaves_the_pool(api: ApiServer, client: LightkubeApi) -> None:
    trees: Trees = LatestValue(tree(range(4)))
    async with publishing(client, trees) as publisher:
        await api.wait_for(complete_with(names(range(4))), what="first publish")
        trees.set(tree(range(4), n2=Health.UNHEALTHY))
        await api.wait_for(complete_with(names([0, 1, 3])), what="the sick device gone")
        assert generations(api) == {2}
        await publisher.published.wait_for(lambda p: p is not None and p.generation == 2, 5)
        pool = publisher.pool()
        assert pool is not None and device_name(address(2)) not in pool.devices
        trees.set(tree(range(4)))
        await api.wait_for(complete_with(names(range(4))), what="back when healthy")
        assert generations(api) == {3}


async def test_a_storm_publishes_during_the_storm_and_with_few_writes(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(10)))
    timing = PublishTiming(settle_s=0.5, retry_initial_s=0.05, retry_max_s=0.4)
    async with publishing(client, trees, timing=timing):
        await api.wait_for(complete_with(names(range(10))), what="first publish")
        writes = api.writes
        changes = 0
        enough = asyncio.Event()

        async def storm() -> None:
            nonlocal changes
            while True:
                changes += 1
                trees.set(tree([*range(10), 100 + changes]))  # each tree a new one
                if changes >= 60:
                    enough.set()
                await asyncio.sleep(0.02)

        storming = asyncio.create_task(storm())
        try:
            # Bounded settling: a storm that never stops still gets published.
            await api.wait_for(lambda a: a.writes > writes, timeout=10, what="a write mid-storm")
            await enough.wait()
        finally:
            storming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await storming
        final = names([*range(10), 100 + changes])
        await api.wait_for(complete_with(final), what="the storm's last tree")
        assert api.writes - writes <= changes // 3, (api.writes - writes, changes)


# ------------------------------------------------------------------ the API server's side


class ChangedBehindItsBack:
    """The real client, but someone else edits the slice just before the publisher's first
    PUT reaches the API server (so its resourceVersion is stale: 409)."""

    def __init__(self, inner: LightkubeApi, other: LightkubeApi) -> None:
        self.inner, self.other, self.done = inner, other, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def replace_slice(self, obj: Mapping[str, Any]) -> JsonObject:
        if not self.done:
            self.done = True
            (stored,) = (await self.other.list_slices(DRIVER, NODE)).items
            spec = stored["spec"]
            edited = {**stored, "spec": {**spec, "devices": spec["devices"][:1]}}
            await self.other.replace_slice(edited)
        return await self.inner.replace_slice(obj)


async def test_a_conflict_is_read_again_and_converges(
    api: ApiServer, client: LightkubeApi, tmp_path: Path
) -> None:
    other = load_api_client({"KUBECONFIG": str(api.write_kubeconfig(tmp_path / "other"))})
    kube = ChangedBehindItsBack(client, other)
    trees: Trees = LatestValue(tree(range(3)))
    try:
        async with publishing(kube, trees) as publisher:
            await api.wait_for(complete_with(names(range(3))), what="first publish")
            since = len(api.request_log)
            trees.set(tree(range(4)))
            await api.wait_for(complete_with(names(range(4))), what="converged after the 409")
            assert kube.done and verbs(api, since)[("update", 409)] == 1
            # One bump over whatever generation 1 holds: the refused PUT published nothing.
            assert generations(api) == {2}
            assert publisher.stats.failures == 1 and publisher.stats.rejected == 0
    finally:
        await other.aclose()


async def test_a_wipe_puts_the_slices_back_at_the_same_generation(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(200)))
    async with publishing(client, trees):
        await api.wait_for(complete_with(names(range(200))), what="first publish")
        trees.set(tree(range(201)))
        await api.wait_for(complete_with(names(range(201))), what="second generation")
        assert api.delete_slices(f"spec.nodeName={NODE}") == 2  # the kubelet's start
        await api.wait_for(complete_with(names(range(201))), what="slices back")
        assert generations(api) == {2}  # the content did not change
        gets = api.requests["get"]
        assert api.delete_slices(f"spec.nodeName={NODE},spec.driver={DRIVER}") == 2
        await api.wait_for(complete_with(names(range(201))), what="slices back again")
        # The Node read again before they were: deleted by the garbage collector, they were
        # owned by a Node that is gone, and one of the same name has another uid.
        assert api.requests["get"] == gets + 1


class SilencingProxy:
    """A TCP proxy in front of the stand-in that can make its open connections go silent
    without closing them: a half-open connection, as an API server or load balancer that fails
    over leaves it. New connections work."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silenced: list[asyncio.Event] = []  # one per connection made so far
        self._pumps: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self.server.close()
        await self.server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.port)
        silent = asyncio.Event()
        self.silenced.append(silent)
        pumps = [
            asyncio.create_task(self._pump(reader, upstream_writer, silent)),
            asyncio.create_task(self._pump(upstream_reader, writer, silent)),
        ]
        self._pumps.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in (writer, upstream_writer):
            stream.close()

    @staticmethod
    async def _pump(
        source: asyncio.StreamReader, sink: asyncio.StreamWriter, silent: asyncio.Event
    ) -> None:
        while data := await source.read(65536):
            if silent.is_set():
                await asyncio.Event().wait()  # never again a byte, and never a close
            sink.write(data)
            await sink.drain()

    def silence_open_connections(self) -> None:
        for silent in self.silenced:
            silent.set()


async def test_a_watch_on_a_silent_connection_is_given_up_and_a_wipe_still_put_back(
    api: ApiServer, tmp_path: Path
) -> None:
    proxy = SilencingProxy(int(api.url.rstrip("/").rsplit(":", 1)[1]))
    async with proxy as port:
        config = api.write_kubeconfig(tmp_path / "proxied")
        config.write_text(
            config.read_text().replace(api.url.rstrip("/"), f"http://127.0.0.1:{port}")
        )
        # Requests other than the watch give up after 2 s; each watch after 1 s plus 1 s.
        kube = load_api_client({"KUBECONFIG": str(config)}, timeout=2.0)
        timing = replace(FAST, watch_s=(1.0, 1.0), watch_margin_s=1.0)
        try:
            async with publishing(kube, LatestValue(tree(range(3))), timing=timing) as publisher:
                await api.wait_for(complete_with(names(range(3))), what="first publish")
                # The pass has its answers (none is left on a connection about to go silent).
                await publisher.published.wait_for(lambda pool: pool is not None, 5)
                await api.wait_for(lambda a: a.open_watches == 1, what="the watch")
                # The watch's connection (and every other open one) goes silent, then the
                # kubelet wipes the slices: no DELETED event can arrive.
                proxy.silence_open_connections()
                api.delete_slices(f"spec.nodeName={NODE}")
                await api.wait_for(
                    complete_with(names(range(3))), timeout=30, what="the slices put back"
                )
        finally:
            await kube.aclose()


async def test_an_outage_is_waited_out_with_back_off_and_logged_twice(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(3)))
    with capture_logs() as logs:
        async with publishing(client, trees) as publisher:
            await api.wait_for(complete_with(names(range(3))), what="first publish")
            before, writes = sum(api.requests.values()), api.writes
            await api.go_down("unavailable")  # every request answered 503, and counted
            trees.set(tree(range(5)))
            await asyncio.sleep(2.0)
            during = sum(api.requests.values()) - before
            # Back-off from 0.05 s doubling to 0.4 s: ~8 lists in 2 s (a hot loop: hundreds).
            assert 1 <= during <= 20, during
            assert not publisher.stats.api_reachable
            assert api.writes == writes  # lists retried; no write tried on an outdated view
            await api.come_back()
            await api.wait_for(complete_with(names(range(5))), timeout=10, what="converged")
    events = [entry["event"] for entry in logs]
    assert events.count("dra.slices.api.unreachable") == 1
    assert events.count("dra.slices.api.reachable") == 1


async def test_an_idle_pool_makes_no_writes(tmp_path: Path) -> None:
    # Watches end every 0.2 s and are re-opened, as a real server ends them every 30-60 min.
    async with serving(tmp_path, max_watch_seconds=0.2) as (api, kube):
        trees: Trees = LatestValue(tree(range(200)))
        async with publishing(kube, trees) as publisher:
            await api.wait_for(complete_with(names(range(200))), what="first publish")
            writes, watches = api.writes, api.requests["watch"]
            trees.set(tree(range(200)))  # an equal tree, a new object
            trees.set(DeviceTree({GPU: gpus(range(200)), OTHER: gpus(range(2))}))
            await api.wait_for(lambda a: a.requests["watch"] >= watches + 3, what="rewatch")
            lists = publisher.mirror.lists
            api.put_node("node2")  # history moves on (not a slice: no watch event) ...
            api.compact()  # ... and goes: a watch from before it gets 410
            await api.wait_for(lambda a: publisher.mirror.lists > lists, what="a new list")
            await api.wait_for(lambda a: a.requests["watch"] >= watches + 6, what="rewatch")
            assert api.writes == writes
            assert publisher.stats.publishes == 1 and publisher.stats.in_sync


async def test_a_restarted_publisher_finds_its_pool_and_writes_nothing(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(200)))
    async with publishing(client, trees):
        await api.wait_for(complete_with(names(range(200))), what="first publish")
        trees.set(tree(range(199)))
        await api.wait_for(complete_with(names(range(199))), what="generation 2")
    writes = api.writes
    async with publishing(client, trees) as again:
        pool = await again.published.wait_for(lambda p: p is not None, timeout=5)
        assert pool is not None and pool.generation == 2
        assert api.writes == writes
        trees.set(tree(range(200)))
        await api.wait_for(complete_with(names(range(200))), what="a change after restart")
        assert generations(api) == {3}


# ------------------------------------------------------------------ odd devices


def refusing(device: str) -> Callable[[Any], list[FieldError]]:
    """The API server's rules, plus one that refuses the device named ``device`` (a rule the
    slice builder does not know)."""

    def validate(obj: Any) -> list[FieldError]:
        errors = validate_resource_slice(obj)
        for index, entry in enumerate(obj.get("spec", {}).get("devices") or []):
            if entry.get("name") == device:
                errors.append(invalid(f"spec.devices[{index}].name", device, "refused here"))
        return errors

    return validate


async def test_a_device_the_validator_refuses_is_left_out_and_the_rest_published(
    tmp_path: Path,
) -> None:
    odd = device_name(address(130))
    rule = refusing(odd)
    async with serving(tmp_path, slice_validator=rule) as (api, kube):
        with capture_logs() as logs:
            trees: Trees = LatestValue(tree(range(130)))
            async with publishing(kube, trees, validator=rule) as p:
                await api.wait_for(complete_with(names(range(130))), what="first publish")
                trees.set(tree(range(200)))  # the odd device comes, in the second slice
                expected = names(range(200)) - {odd}
                await api.wait_for(complete_with(expected), what="the others published")
                pool = await p.published.wait_for(lambda v: v is not None and v.generation == 2, 5)
                assert pool is not None and odd not in pool.devices
                assert p.stats.left_out == 1 and p.stats.rejected == 0
        refused = [e for e in logs if e["event"] == "dra.slices.device.refused"]
        assert [(e["device"], e["id"]) for e in refused] == [(odd, address(130))]
        assert "refused here" in refused[0]["reason"]


async def test_a_device_the_api_server_refuses_leaves_its_slice_and_the_pool_stays_whole(
    tmp_path: Path,
) -> None:
    # The stand-in is stricter than devplug's screen (a newer API server's rule): the slice
    # holding the odd device is refused. Without that slice the pool would be incomplete
    # (resourceSliceCount 2, one slice stored), and an allocator uses no device of it.
    odd = device_name(address(130))  # in the second slice
    second = slice_name(NODE, DRIVER, 1)
    async with serving(tmp_path, slice_validator=refusing(odd)) as (api, kube):
        with capture_logs() as logs:
            async with publishing(kube, LatestValue(tree(range(200)))) as publisher:
                expected = names(range(200)) - {odd}
                await api.wait_for(complete_with(expected), what="both slices, less the odd one")
                pool = await publisher.published.wait_for(
                    lambda v: v is not None and odd not in v.devices and len(v.devices) == 199, 5
                )
                assert pool is not None and len(pool.slices) == 2
                assert publisher.stats.rejected == 1 and publisher.stats.left_out == 1
                since = len(api.request_log)
                api.delete_slices(f"spec.nodeName={NODE}")  # a wipe: the pool is written back
                await api.wait_for(complete_with(expected), what="the pool written back")
        assert verbs(api)[("create", 422)] == 1  # the odd device was never sent again
        assert verbs(api, since)[("create", 201)] == 2
        (rejected,) = [e for e in logs if e["event"] == "dra.slices.rejected"]
        assert rejected["slice"] == second and rejected["devices"] == [odd]
        assert rejected["retry"] == "at once, without the devices named"
        refused = [e for e in logs if e["event"] == "dra.slices.device.refused"]
        said = [e for e in refused if e["log_level"] == "warning"]  # later passes: debug
        assert [(e["device"], e["id"]) for e in said] == [(odd, address(130))]
        assert "refused by the API server" in said[0]["reason"]


def refusing_slices_over(limit: int) -> Callable[[Any], list[FieldError]]:
    """The API server's rules, plus a tighter limit on devices per slice (as a newer API
    server has for some devices), reported on the slice's device list, not on a device."""

    def validate(obj: Any) -> list[FieldError]:
        errors = validate_resource_slice(obj)
        devices = obj.get("spec", {}).get("devices") or []
        if len(devices) > limit:
            errors.append(too_many("spec.devices", len(devices), limit))
        return errors

    return validate


async def test_a_slice_refused_as_a_whole_goes_again_without_devices(tmp_path: Path) -> None:
    first, second = slice_name(NODE, DRIVER, 0), slice_name(NODE, DRIVER, 1)
    async with serving(tmp_path, slice_validator=refusing_slices_over(100)) as (api, kube):
        with capture_logs() as logs:
            async with publishing(kube, LatestValue(tree(range(200)))) as publisher:
                # The first slice (128 devices) is refused; the pool keeps it, empty, and the
                # second (72) is published as it is.
                expected = names(range(128, 200))
                await api.wait_for(complete_with(expected), what="a whole pool")
                assert pool_slices(api)[first]["spec"].get("devices") is None
                assert len(pool_slices(api)[second]["spec"]["devices"]) == 72
                pool = await publisher.published.wait_for(
                    lambda v: v is not None and len(v.devices) == 72, 5
                )
                assert pool is not None and publisher.stats.left_out == 128
        (rejected,) = [e for e in logs if e["event"] == "dra.slices.rejected"]
        assert rejected["slice"] == first and rejected["devices"] == []
        assert rejected["retry"] == "at once, without its devices"
        refused = [
            e
            for e in logs
            if e["event"] == "dra.slices.device.refused" and e["log_level"] == "warning"
        ]
        assert len(refused) == 128
        assert all("the API server refused its slice" in e["reason"] for e in refused)


def said(event: Mapping[str, Any]) -> bool:
    """Logged for an operator to read (a retry's repetition is logged at debug)."""
    return bool(event["log_level"] != "debug")


class DenyingWrites:
    """The client, with the API server's answer to some writes replaced by a refusal, as an
    admission policy gives it (the request never reaches the store)."""

    def __init__(self, inner: KubeApi, verb: str, code: int, reason: str) -> None:
        self.inner = inner
        self.verb, self.code, self.reason = verb, code, reason
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _refuse(self) -> None:
        self.refused += 1
        raise ApiStatusError(
            self.code,
            self.reason,
            "admission webhook denied the request: devplug on node node1 may write only the "
            "ResourceSlices of that node",
        )

    async def delete_slice(self, name: str, **preconditions: Any) -> None:
        if self.verb == "delete":
            self._refuse()
        await self.inner.delete_slice(name, **preconditions)

    async def create_slice(self, obj: Mapping[str, Any]) -> JsonObject:
        if self.verb == "create":
            self._refuse()
        return await self.inner.create_slice(obj)


@pytest.mark.parametrize(
    ("code", "reason"),
    [(422, "Invalid"), (403, "Forbidden")],  # a policy's denial without and with its reason
)
async def test_a_denied_delete_is_retried_with_back_off_and_logged_once(
    api: ApiServer, client: LightkubeApi, code: int, reason: str
) -> None:
    denying = DenyingWrites(client, "delete", code, reason)
    trees: Trees = LatestValue(tree(range(200)))
    with capture_logs() as logs:
        async with publishing(denying, trees) as publisher:
            await api.wait_for(complete_with(names(range(200))), what="first publish")
            trees.set(tree(range(3)))  # the second slice must go
            first, second = slice_name(NODE, DRIVER, 0), slice_name(NODE, DRIVER, 1)

            def new_generation(api: ApiServer) -> bool:
                spec = pool_slices(api)[first]["spec"]
                return bool(
                    spec["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 1}
                )

            await api.wait_for(new_generation, what="the new generation")
            await eventually(lambda: denying.refused >= 3, timeout=10)
            assert "delete" in publisher.stats.last_error
            # The old generation's slice stays while deletes are denied; consumers take only
            # the highest generation's slices, so the pool is whole without it.
            assert pool_slices(api)[second]["spec"]["pool"]["generation"] == 1
    events = [e["event"] for e in logs]
    assert "dra.slices.pass.failed" not in events  # no bug, each pass
    (refused,) = [e for e in logs if e["event"] == "dra.slices.write.refused" and said(e)]
    assert refused["verb"] == "delete" and refused["retry"] == "with back-off"
    assert "dra.slices.rejected" not in events  # a delete is never taken as an invalid body


async def test_a_forbidden_create_is_retried_with_back_off_until_allowed(
    api: ApiServer, client: LightkubeApi
) -> None:
    denying = DenyingWrites(client, "create", 403, "Forbidden")
    with capture_logs() as logs:
        async with publishing(denying, LatestValue(tree(range(3)))):
            await eventually(lambda: denying.refused >= 3, timeout=10)
            assert pool_slices(api) == {}
            denying.verb = ""  # the policy fixed
            await api.wait_for(complete_with(names(range(3))), what="published once allowed")
    refusals = [e for e in logs if e["event"] == "dra.slices.write.refused" and said(e)]
    assert len(refusals) == 1 and refusals[0]["verb"] == "create"


# ------------------------------------------------------------------ stopping


async def test_stopping_leaves_the_slices_and_no_tasks(
    api: ApiServer, client: LightkubeApi
) -> None:
    trees: Trees = LatestValue(tree(range(3)))
    publisher = SlicePublisher(client, trees, node_name=NODE, driver=DRIVER, timing=FAST)
    task = asyncio.create_task(publisher.run(), name="publisher-under-test")
    await api.wait_for(complete_with(names(range(3))), what="published")
    await publisher.published.wait_for(lambda pool: pool is not None, 5)  # its pass is over
    since = len(api.request_log)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("dra-slices")]
    assert left == []
    await api.wait_for(lambda a: a.open_watches == 0, what="the watch closed")
    assert complete_with(names(range(3)))(api)
    assert all(r.verb not in ("delete", "deletecollection") for r in list(api.request_log)[since:])
