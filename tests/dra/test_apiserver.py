"""The stand-in API server, driven by lightkube's AsyncClient exactly as shipped (configured
only through a kubeconfig file named by KUBECONFIG), and by raw HTTP for the wire details
lightkube does not exercise."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube import ApiError, AsyncClient
from lightkube.core.client import FieldSelector
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from devplug.testing.apiserver import (
    POOL_NAME_FIELD_LABEL,
    SLICE_FIELD_LABELS,
    ApiServer,
    allocated_claim,
)
from devplug.testing.apiserver.schema import SchemaUnavailableError, StructuralSchema

DRIVER = "gpu.devplug.example.com"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
NAME_ALPHABET = set("bcdfghjklmnpqrstvwxz2456789")


def slice_body(
    node: str = "node1",
    *,
    driver: str = DRIVER,
    name: str | None = None,
    devices: tuple[str, ...] = ("gpu-0",),
    generation: int = 1,
) -> dict[str, Any]:
    meta = {"name": name} if name else {"generateName": f"{node}-{driver}-"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                {"name": device, "attributes": {"index": {"int": i}}}
                for i, device in enumerate(devices)
            ],
        },
    }


def as_slice(body: dict[str, Any]) -> ResourceSlice:
    obj = ResourceSlice.from_dict(body)
    assert isinstance(obj, ResourceSlice)
    return obj


def new_slice(**options: Any) -> ResourceSlice:
    return as_slice(slice_body(**options))


def meta(obj: ResourceSlice | ResourceClaim | Node) -> ObjectMeta:
    assert obj.metadata is not None
    return obj.metadata


def status(caught: pytest.ExceptionInfo[ApiError]) -> dict[str, Any]:
    """The Status lightkube raised, as the JSON the server sent."""
    return caught.value.status.to_dict()


def code_and_reason(caught: pytest.ExceptionInfo[ApiError]) -> tuple[int, str]:
    return status(caught)["code"], status(caught).get("reason", "")


def causes(caught: pytest.ExceptionInfo[ApiError]) -> list[tuple[str, str, str]]:
    found = status(caught).get("details", {}).get("causes", [])
    return [(c.get("field", ""), c.get("reason", ""), c.get("message", "")) for c in found]


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with ApiServer() as server:
        yield server


@pytest.fixture
def kubeconfig(api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = api.write_kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


@pytest.fixture
async def client(kubeconfig: Path) -> AsyncIterator[AsyncClient]:
    # No arguments: lightkube finds no in-cluster token here and loads $KUBECONFIG itself.
    client = AsyncClient()
    yield client
    await client.close()


@pytest.fixture
async def raw(api: ApiServer) -> AsyncIterator[httpx2.AsyncClient]:
    headers = {"Authorization": f"Bearer {api.token}"}
    async with httpx2.AsyncClient(base_url=api.url, headers=headers) as http:
        yield http


async def names(client: AsyncClient, **fields: str) -> list[str]:
    selector: FieldSelector = dict(fields)
    listing = client.list(ResourceSlice, fields=selector or None)
    return [str(meta(item).name) async for item in listing]


# ------------------------------------------------------------------ through lightkube


async def test_create_with_generate_name_gets_a_name_and_server_metadata(
    api: ApiServer, client: AsyncClient
) -> None:
    created = meta(await client.create(new_slice()))
    name = str(created.name)
    prefix = f"node1-{DRIVER}-"
    assert name.startswith(prefix) and len(name) == len(prefix) + 5
    assert set(name[len(prefix) :]) <= NAME_ALPHABET
    assert created.uid and created.creationTimestamp is not None
    assert created.generation == 1
    assert created.resourceVersion == str(api.resource_version)
    assert set(api.slices()) == {name}


async def test_create_with_a_taken_name_is_409_already_exists(client: AsyncClient) -> None:
    await client.create(new_slice(name="node1-fixed"))
    with pytest.raises(ApiError) as caught:
        await client.create(new_slice(name="node1-fixed"))
    assert code_and_reason(caught) == (409, "AlreadyExists")
    assert status(caught)["message"] == (
        'resourceslices.resource.k8s.io "node1-fixed" already exists'
    )


async def test_list_field_selectors_are_anded(api: ApiServer, client: AsyncClient) -> None:
    await client.create(new_slice(name="a-node1", node="node1"))
    await client.create(new_slice(name="b-node2", node="node2"))
    await client.create(new_slice(name="c-other", node="node1", driver="other.example.com"))

    assert await names(client, **{"spec.driver": DRIVER, "spec.nodeName": "node1"}) == ["a-node1"]
    assert await names(client, **{"spec.driver": DRIVER}) == ["a-node1", "b-node2"]
    assert await names(client, **{"spec.nodeName": "node1"}) == ["a-node1", "c-other"]
    assert await names(client) == ["a-node1", "b-node2", "c-other"]
    listing = client.list(ResourceSlice)
    assert [s async for s in listing] and listing.resourceVersion == str(api.resource_version)


async def test_pool_name_is_no_field_label_of_a_1_34_server(client: AsyncClient) -> None:
    with pytest.raises(ApiError) as caught:
        await names(client, **{"spec.pool.name": "node1"})
    assert code_and_reason(caught) == (400, "BadRequest")
    assert status(caught)["message"] == (
        "field label not supported for resource.k8s.io/v1, Kind=ResourceSlice: spec.pool.name"
    )


async def test_pool_name_selects_on_a_server_that_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ApiServer(field_labels=SLICE_FIELD_LABELS | {POOL_NAME_FIELD_LABEL}) as newer:
        monkeypatch.setenv("KUBECONFIG", str(newer.write_kubeconfig(tmp_path / "kc")))
        client = AsyncClient()
        try:
            await client.create(new_slice(name="in-pool", node="node1"))
            await client.create(new_slice(name="other-pool", node="node2"))
            assert await names(client, **{"spec.pool.name": "node1"}) == ["in-pool"]
        finally:
            await client.close()


async def test_list_in_chunks_follows_continue_from_one_snapshot(
    api: ApiServer, client: AsyncClient
) -> None:
    for index in range(5):
        await client.create(new_slice(name=f"slice-{index}"))
    seen = []
    async for item in client.list(ResourceSlice, chunk_size=2):
        seen.append(meta(item).name)
        if len(seen) == 1:  # after the first page: not part of this list
            await client.create(new_slice(name="slice-9"))
    assert seen == [f"slice-{index}" for index in range(5)]
    pages = [r for r in api.request_log if r.verb == "list"]
    assert len(pages) == 3 and "continue=" in pages[-1].target


async def test_replace_bumps_generation_on_spec_changes_and_refuses_a_stale_version(
    api: ApiServer, client: AsyncClient
) -> None:
    created = await client.create(new_slice())
    stale = as_slice(created.to_dict())
    created.spec.pool.generation = 2
    replaced = await client.replace(created)
    assert meta(replaced).generation == 2
    assert int(str(meta(replaced).resourceVersion)) > int(str(meta(stale).resourceVersion))

    with pytest.raises(ApiError) as caught:
        await client.replace(stale)
    assert code_and_reason(caught) == (409, "Conflict")
    assert "the object has been modified" in status(caught)["message"]

    writes, version = api.writes, api.resource_version
    unchanged = await client.replace(replaced)  # nothing differs: stored as it was
    assert meta(unchanged).resourceVersion == meta(replaced).resourceVersion
    assert (api.writes, api.resource_version) == (writes + 1, version)


async def test_replace_that_changes_the_driver_or_node_is_422(client: AsyncClient) -> None:
    created = await client.create(new_slice())
    created.spec.driver = "other.example.com"
    created.spec.nodeName = "node2"
    with pytest.raises(ApiError) as caught:
        await client.replace(created)
    assert code_and_reason(caught) == (422, "Invalid")
    found = {(field, message.split(": ")[-1]) for field, _, message in causes(caught)}
    assert found == {("spec.driver", "field is immutable"), ("spec.nodeName", "field is immutable")}


async def test_watch_sees_added_modified_and_deleted_across_a_deletecollection(
    api: ApiServer, client: AsyncClient, raw: httpx2.AsyncClient
) -> None:
    listing = client.list(ResourceSlice)
    assert [s async for s in listing] == []
    seen: list[tuple[str, str]] = []

    async def watch() -> None:
        fields: FieldSelector = {"spec.driver": DRIVER, "spec.nodeName": "node1"}
        events = client.watch(
            ResourceSlice, fields=fields, resource_version=listing.resourceVersion
        )
        async for kind, obj in events:
            seen.append((kind, str(meta(obj).name)))
            if [k for k, _ in seen].count("DELETED") == 2:
                return

    watching = asyncio.create_task(watch())
    await api.wait_for(lambda server: server.open_watches == 1, what="the watch to open")
    first = await client.create(new_slice(name="first"))
    await client.create(new_slice(name="second"))
    await client.create(new_slice(name="elsewhere", node="node2"))
    first.spec.pool.generation = 2
    await client.replace(first)
    # The kubelet's wipe: a deletecollection by field selector.
    wiped = await raw.delete(SLICES_PATH, params={"fieldSelector": "spec.nodeName=node1"})
    assert wiped.status_code == 200
    assert [item["metadata"]["name"] for item in wiped.json()["items"]] == ["first", "second"]
    await asyncio.wait_for(watching, 5)

    assert seen == [
        ("ADDED", "first"),
        ("ADDED", "second"),
        ("MODIFIED", "first"),
        ("DELETED", "first"),
        ("DELETED", "second"),
    ]
    assert set(api.slices()) == {"elsewhere"}
    assert api.requests["deletecollection"] == 1


async def test_delete_removes_and_a_missing_slice_is_404(
    api: ApiServer, client: AsyncClient
) -> None:
    await client.create(new_slice(name="doomed"))
    await client.delete(ResourceSlice, "doomed")
    assert api.slices() == {}
    with pytest.raises(ApiError) as caught:
        await client.delete(ResourceSlice, "doomed")
    assert code_and_reason(caught) == (404, "NotFound")
    assert status(caught)["message"] == 'resourceslices.resource.k8s.io "doomed" not found'


async def test_a_claim_is_read_from_its_namespace(api: ApiServer, client: AsyncClient) -> None:
    result = {"request": "gpu", "driver": DRIVER, "pool": "node1", "device": "gpu-0"}
    put = api.put_claim(allocated_claim("claim-1", "team-a", [result], uid="uid-claim-1"))
    claim = (await client.get(ResourceClaim, "claim-1", namespace="team-a")).to_dict()
    assert claim["metadata"]["uid"] == "uid-claim-1" == put["metadata"]["uid"]
    assert claim["status"]["allocation"]["devices"]["results"] == [result]
    with pytest.raises(ApiError) as caught:
        await client.get(ResourceClaim, "claim-1", namespace="team-b")
    assert code_and_reason(caught) == (404, "NotFound")


async def test_a_node_gives_its_uid_for_owner_references(
    api: ApiServer, client: AsyncClient
) -> None:
    stored = api.put_node("node1")
    node = await client.get(Node, "node1")
    assert meta(node).uid == stored["metadata"]["uid"]
    with pytest.raises(ApiError) as caught:
        await client.get(Node, "node2")
    assert status(caught)["message"] == 'nodes "node2" not found'


async def test_an_invalid_slice_is_422_with_the_causes(api: ApiServer, client: AsyncClient) -> None:
    body = slice_body(name="odd")
    body["spec"]["devices"][0]["name"] = "Card_0.UPPER"
    with pytest.raises(ApiError) as caught:
        await client.create(as_slice(body))
    assert code_and_reason(caught) == (422, "Invalid")
    assert status(caught)["message"].startswith(
        'ResourceSlice.resource.k8s.io "odd" is invalid: spec.devices[0].name: '
    )
    assert [c[:2] for c in causes(caught)] == [("spec.devices[0].name", "FieldValueInvalid")]
    assert api.slices() == {}


async def test_too_many_devices_is_422_too_many(client: AsyncClient) -> None:
    devices = tuple(f"gpu-{index}" for index in range(129))
    with pytest.raises(ApiError) as caught:
        await client.create(new_slice(devices=devices))
    assert [c[:2] for c in causes(caught)] == [("spec.devices", "FieldValueTooMany")]


async def test_the_semantic_validator_is_a_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = slice_body(name="odd")
    body["spec"]["devices"][0]["name"] = "Card_0.UPPER"  # the structural schema lets it through
    async with ApiServer(slice_validator=None) as lenient:
        monkeypatch.setenv("KUBECONFIG", str(lenient.write_kubeconfig(tmp_path / "kc")))
        client = AsyncClient()
        try:
            created = await client.create(as_slice(body))
        finally:
            await client.close()
    assert meta(created).name == "odd"


async def test_a_wrong_token_is_401(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kc", token="stolen")))
    client = AsyncClient()
    try:
        with pytest.raises(ApiError) as caught:
            await names(client)
    finally:
        await client.close()
    assert code_and_reason(caught) == (401, "Unauthorized")


async def test_requests_are_counted_by_verb(api: ApiServer, client: AsyncClient) -> None:
    created = await client.create(new_slice())
    await names(client)
    await client.get(ResourceSlice, str(meta(created).name))
    await client.replace(created)
    with pytest.raises(ApiError):
        await client.create(new_slice(name="Bad_Name"))
    assert dict(api.requests) == {"create": 2, "list": 1, "get": 1, "update": 1}
    assert api.writes == 3  # a refused write is still a write request


async def test_an_outage_refuses_connections_then_serves_the_same_objects(
    api: ApiServer, client: AsyncClient
) -> None:
    await client.create(new_slice(name="kept"))
    port = api.port
    await api.go_down("refuse")
    with pytest.raises(httpx2.ConnectError):
        await names(client)
    await api.come_back()
    assert api.port == port
    assert await names(client) == ["kept"]


async def test_an_outage_cuts_open_watches(api: ApiServer, client: AsyncClient) -> None:
    async def watch() -> None:
        async for _ in client.watch(ResourceSlice, resource_version=str(api.resource_version)):
            pass

    watching = asyncio.create_task(watch())
    await api.wait_for(lambda server: server.open_watches == 1, what="the watch to open")
    async with api.down("unavailable"):
        with pytest.raises(httpx2.HTTPError):
            await asyncio.wait_for(watching, 5)
        with pytest.raises(ApiError) as caught:
            await names(client)
        assert code_and_reason(caught) == (503, "ServiceUnavailable")
    assert await names(client) == []


async def test_wait_for_wakes_on_a_write(api: ApiServer, client: AsyncClient) -> None:
    waiting = asyncio.create_task(api.wait_for(lambda server: len(server.slices()) == 1))
    await asyncio.sleep(0)
    assert not waiting.done()
    await client.create(new_slice())
    await asyncio.wait_for(waiting, 5)


# ------------------------------------------------------------------ raw HTTP: the wire


@pytest.mark.parametrize("value", ["true", "True", "1", ""])
async def test_watch_parameter_true_spellings_open_a_chunked_watch(
    api: ApiServer, raw: httpx2.AsyncClient, value: str
) -> None:
    async with raw.stream("GET", SLICES_PATH, params={"watch": value}) as response:
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.headers["content-type"] == "application/json"
        assert api.open_watches == 1
    assert dict(api.requests) == {"watch": 1}


@pytest.mark.parametrize("value", ["false", "False", "0"])
async def test_watch_parameter_false_spellings_list(
    api: ApiServer, raw: httpx2.AsyncClient, value: str
) -> None:
    response = await raw.get(SLICES_PATH, params={"watch": value})
    assert response.status_code == 200
    assert response.json()["kind"] == "ResourceSliceList"
    assert dict(api.requests) == {"list": 1}


async def test_a_watch_from_a_compacted_version_gets_one_410_expired_event(
    api: ApiServer, raw: httpx2.AsyncClient
) -> None:
    created = (await raw.post(SLICES_PATH, json=slice_body())).json()
    old = created["metadata"]["resourceVersion"]
    api.delete_slices()
    api.compact()
    async with raw.stream(
        "GET", SLICES_PATH, params={"watch": "true", "resourceVersion": old}
    ) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    [event] = [json.loads(line) for line in lines]
    assert event == {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {old} ({api.resource_version})",
            "reason": "Expired",
            "code": 410,
        },
    }


async def test_a_watch_from_a_future_version_is_504(
    api: ApiServer, raw: httpx2.AsyncClient
) -> None:
    ahead = str(api.resource_version + 10)
    response = await raw.get(SLICES_PATH, params={"watch": "1", "resourceVersion": ahead})
    assert response.status_code == 504
    assert response.json()["details"]["causes"] == [
        {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
    ]


async def test_a_watch_without_version_opens_with_the_current_objects_then_bookmarks_and_times_out(
    api: ApiServer, raw: httpx2.AsyncClient
) -> None:
    await raw.post(SLICES_PATH, json=slice_body(name="present"))
    params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "1"}
    events = []
    async with raw.stream("GET", SLICES_PATH, params=params) as response:
        async for line in response.aiter_lines():
            events.append(json.loads(line))
            if len(events) == 1:
                api.send_bookmarks()
    # The stream ended by itself after timeoutSeconds, with the terminating chunk.
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in events[:2]] == [
        ("ADDED", "present"),
        ("BOOKMARK", None),
    ]
    assert events[1]["object"]["metadata"] == {"resourceVersion": str(api.resource_version)}


async def test_error_answers_are_status_objects(api: ApiServer, raw: httpx2.AsyncClient) -> None:
    response = await raw.get(f"{SLICES_PATH}/missing")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'resourceslices.resource.k8s.io "missing" not found',
        "reason": "NotFound",
        "details": {"name": "missing", "group": "resource.k8s.io", "kind": "resourceslices"},
        "code": 404,
    }


async def test_an_unknown_field_is_422_not_dropped(api: ApiServer, raw: httpx2.AsyncClient) -> None:
    body = slice_body(name="extra")
    body["spec"]["bogus"] = True
    response = await raw.post(SLICES_PATH, json=body)
    assert response.status_code == 422
    assert response.json()["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'unknown field "spec.bogus"',
            "field": "spec.bogus",
        }
    ]
    assert api.slices() == {}


async def test_delete_preconditions_that_do_not_hold_are_409(
    api: ApiServer, raw: httpx2.AsyncClient
) -> None:
    created = (await raw.post(SLICES_PATH, json=slice_body(name="guarded"))).json()
    uid = created["metadata"]["uid"]
    for preconditions, what in (
        ({"uid": "someone-else"}, "UID"),
        ({"resourceVersion": "1"}, "ResourceVersion"),
    ):
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": preconditions}
        response = await raw.request("DELETE", f"{SLICES_PATH}/guarded", json=body)
        assert response.status_code == 409
        assert f"Precondition failed: {what} in precondition" in response.json()["message"]
    body = {
        "preconditions": {"uid": uid, "resourceVersion": created["metadata"]["resourceVersion"]}
    }
    response = await raw.request("DELETE", f"{SLICES_PATH}/guarded", json=body)
    assert response.status_code == 200 and api.slices() == {}


async def test_claim_fixtures_are_checked_against_the_schema(api: ApiServer) -> None:
    claim = allocated_claim(
        "c", "default", [{"request": "gpu", "driver": DRIVER, "pool": "p", "device": "d"}]
    )
    del claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"]
    with pytest.raises(ValueError, match="deviceClassName: Required value"):
        api.put_claim(claim)


def test_schemas_of_an_unknown_version_are_refused_with_the_known_ones() -> None:
    with pytest.raises(
        SchemaUnavailableError, match=r"no schemas for Kubernetes 1\.99\.0; it has: .*1\.34\.0"
    ):
        StructuralSchema("1.99.0")


def test_without_kubernetes_validate_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes_validate.utils", None)
    with pytest.raises(
        SchemaUnavailableError, match=r"pip install 'devplug\[test\]'.*schema_version=None"
    ):
        StructuralSchema("1.34.0")
