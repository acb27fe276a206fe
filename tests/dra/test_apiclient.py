"""devplug.dra.apiclient: where the API server is (KUBECONFIG, in-cluster), and the calls the
DRA front makes, against the stand-in API server over real HTTP(S)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from devplug.dra.apiclient import (
    ApiStatusError,
    ApiUnreachableError,
    LightkubeApi,
    UnsentFieldsError,
    WatchEvent,
    load_api_client,
)
from devplug.errors import ConfigError
from devplug.testing.apiserver import ApiServer, TlsFiles, allocated_claim

DRIVER = "gpu.devplug.example.com"
NODE = "node1"


def slice_body(name: str, *, node: str = NODE, generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"index": {"int": 0}}}],
        },
    }


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with ApiServer() as server:
        yield server


@pytest.fixture
async def client(api: ApiServer, tmp_path: Path) -> AsyncIterator[LightkubeApi]:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    client = load_api_client({"KUBECONFIG": str(kubeconfig)})
    yield client
    await client.aclose()


# ------------------------------------------------------------------ where the API server is


def test_no_kubeconfig_and_no_pod_is_a_config_error_naming_kubeconfig(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_api_client({}, service_account_dir=tmp_path)
    assert caught.value.field == "KUBECONFIG"
    assert "KUBERNETES_SERVICE_HOST is unset" in caught.value.message
    assert "\n" not in str(caught.value)


def test_a_missing_kubeconfig_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^KUBECONFIG: .*absent\.yaml.*not found"):
        load_api_client({"KUBECONFIG": str(tmp_path / "absent.yaml")})


def test_a_kubeconfig_list_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lists several files"):
        load_api_client({"KUBECONFIG": f"{tmp_path}/a:{tmp_path}/b"})


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("clusters: [\n", "not a usable kubeconfig"),
        (
            "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:1'}}]\n"
            "contexts: [{name: x, context: {cluster: c}}]\ncurrent-context: x\n",
            "context 'x' names no user",
        ),
        (
            "clusters: []\ncontexts: [{name: x, context: {cluster: gone, user: u}}]\n"
            "users: [{name: u, user: {token: t}}]\ncurrent-context: x\n",
            "it names 'gone', which it does not define",
        ),
        (
            "clusters: [{name: c, cluster: {server: '127.0.0.1:6443'}}]\n"
            "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
            "users: [{name: u, user: {token: t}}]\ncurrent-context: x\n",
            "is not an http(s) URL",
        ),
    ],
)
def test_an_unusable_kubeconfig_says_why(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_api_client({"KUBECONFIG": str(path)})
    assert caught.value.field.startswith("KUBECONFIG")
    assert problem in caught.value.message and str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("user", "setting"),
    [
        ("{client-certificate: missing.crt, client-key: missing.key}", "client-certificate"),
        ("{tokenFile: missing-token}", "tokenFile"),
    ],
)
def test_a_file_the_kubeconfig_names_that_is_missing_is_named(
    tmp_path: Path, user: str, setting: str
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
        f"users: [{{name: u, user: {user}}}]\ncurrent-context: x\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_api_client({"KUBECONFIG": str(path)})
    assert caught.value.field == "KUBECONFIG"
    missing = tmp_path / ("missing.crt" if setting == "client-certificate" else "missing-token")
    assert caught.value.message.startswith(
        f"{path}: {setting} {missing}: No such file or directory; "
    ), caught.value.message


def test_in_cluster_without_a_token_names_the_file(tmp_path: Path) -> None:
    environ = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError) as caught:
        load_api_client(environ, service_account_dir=tmp_path)
    assert caught.value.field == "in-cluster config"
    assert f"{tmp_path / 'token'} is missing" in caught.value.message


def self_signed(directory: Path) -> TlsFiles:
    """A certificate for 127.0.0.1 that is its own CA."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: the HTTPS tests need it to make a certificate")
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return TlsFiles(cert=cert, key=key, ca=cert)


async def test_in_cluster_config_reaches_the_server_over_https_with_the_token(
    tmp_path: Path,
) -> None:
    tls = self_signed(tmp_path)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    shutil.copy(tls.ca, account / "ca.crt")
    async with ApiServer(tls=tls, token="in-cluster-token") as api:
        api.put_node(NODE)
        (account / "token").write_text("in-cluster-token\n")
        environ = {"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)}
        client = load_api_client(environ, service_account_dir=account)
        try:
            node = await client.get_node(NODE)
            (account / "token").write_text("rotated-token\n")
            api.token = "rotated-token"
            assert (await client.get_node(NODE))["metadata"]["uid"] == node["metadata"]["uid"]
        finally:
            await client.aclose()
    assert [r.code for r in api.request_log] == [200, 401, 200]  # the 401 made it re-read the token


async def test_kubeconfig_wins_over_in_cluster(api: ApiServer, tmp_path: Path) -> None:
    environ = {
        "KUBECONFIG": str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        "KUBERNETES_SERVICE_HOST": "10.255.255.1",
        "KUBERNETES_SERVICE_PORT": "443",
    }
    client = load_api_client(environ, service_account_dir=tmp_path / "nothing-here")
    try:
        assert (await client.list_slices(DRIVER, NODE)).items == ()
    finally:
        await client.aclose()


# ------------------------------------------------------------------ the calls


async def test_create_list_replace_and_get_speak_json(api: ApiServer, client: LightkubeApi) -> None:
    created = await client.create_slice(slice_body("node1-a"))
    await client.create_slice(slice_body("node2-a", node="node2"))
    assert created["metadata"]["uid"] == api.slices()["node1-a"]["metadata"]["uid"]

    listed = await client.list_slices(DRIVER, NODE)
    assert [item["metadata"]["name"] for item in listed.items] == ["node1-a"]
    assert listed.resource_version == str(api.resource_version)
    assert "spec.driver=gpu.devplug.example.com,spec.nodeName=node1" in _decoded(
        api.request_log[-1].target
    )

    changed = {
        **created,
        "spec": {**created["spec"], "pool": {**created["spec"]["pool"], "generation": 2}},
    }
    replaced = await client.replace_slice(changed)
    assert replaced["metadata"]["generation"] == 2
    with pytest.raises(ApiStatusError) as caught:
        await client.replace_slice(changed)  # its resourceVersion is stale now
    assert (caught.value.code, caught.value.reason) == (409, "Conflict")


async def test_delete_honours_its_preconditions(api: ApiServer, client: LightkubeApi) -> None:
    created = await client.create_slice(slice_body("guarded"))
    meta = created["metadata"]
    with pytest.raises(ApiStatusError) as caught:
        await client.delete_slice("guarded", uid="another-uid")
    assert (caught.value.code, caught.value.reason) == (409, "Conflict")
    assert "Precondition failed: UID in precondition: another-uid" in caught.value.message
    await client.replace_slice({**created, "spec": {**created["spec"], "devices": []}})
    with pytest.raises(ApiStatusError, match="Precondition failed: ResourceVersion"):
        await client.delete_slice(
            "guarded", uid=meta["uid"], resource_version=meta["resourceVersion"]
        )
    assert "guarded" in api.slices()

    current = api.slices()["guarded"]["metadata"]
    await client.delete_slice(
        "guarded", uid=current["uid"], resource_version=current["resourceVersion"]
    )
    assert api.slices() == {}
    with pytest.raises(ApiStatusError) as missing:
        await client.delete_slice("guarded")
    assert (missing.value.code, missing.value.reason) == (404, "NotFound")


async def test_claims_and_nodes_come_back_as_json(api: ApiServer, client: LightkubeApi) -> None:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
    api.put_claim(allocated_claim("claim-1", "team-a", [result], uid="uid-1"))
    node = api.put_node(NODE)
    claim = await client.get_claim("team-a", "claim-1")
    assert claim["metadata"]["uid"] == "uid-1"
    assert claim["status"]["allocation"]["devices"]["results"] == [result]
    assert (await client.get_node(NODE))["metadata"]["uid"] == node["metadata"]["uid"]
    with pytest.raises(ApiStatusError) as caught:
        await client.get_claim("team-b", "claim-1")
    assert caught.value.code == 404


async def test_an_invalid_slice_carries_the_causes(client: LightkubeApi) -> None:
    body = slice_body("odd")
    body["spec"]["devices"][0]["name"] = "Card_0"
    with pytest.raises(ApiStatusError) as caught:
        await client.create_slice(body)
    assert caught.value.code == 422
    assert [(c.field, c.reason) for c in caught.value.causes] == [
        ("spec.devices[0].name", "FieldValueInvalid")
    ]


async def test_a_field_the_models_do_not_know_is_refused_before_sending(
    api: ApiServer, client: LightkubeApi
) -> None:
    body = slice_body("future")
    body["spec"]["devices"][0]["fieldFromKubernetes99"] = {"x": 1}
    with pytest.raises(UnsentFieldsError, match=r"spec\.devices\[0\]\.fieldFromKubernetes99"):
        await client.create_slice(body)
    assert api.writes == 0


async def test_watch_yields_events_as_json_and_ends_with_410_when_history_is_gone(
    api: ApiServer, client: LightkubeApi
) -> None:
    start = (await client.list_slices(DRIVER, NODE)).resource_version
    events: asyncio.Queue[WatchEvent] = asyncio.Queue()

    async def watch() -> None:
        async for event in client.watch_slices(DRIVER, NODE, start):
            events.put_nowait(event)

    watching = asyncio.create_task(watch())
    await api.wait_for(lambda server: server.open_watches == 1, what="the watch to open")
    await client.create_slice(slice_body("mine"))
    await client.create_slice(slice_body("not-mine", node="node2"))
    api.delete_slices(f"spec.nodeName={NODE}")
    seen = [await asyncio.wait_for(events.get(), 5) for _ in range(2)]
    assert [(e.type, e.object["metadata"]["name"]) for e in seen] == [
        ("ADDED", "mine"),
        ("DELETED", "mine"),
    ]
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    assert events.empty()

    api.compact()
    with pytest.raises(ApiStatusError) as caught:
        async for _ in client.watch_slices(DRIVER, NODE, start):
            pass
    assert (caught.value.code, caught.value.reason) == (410, "Expired")


async def test_an_unreachable_server_is_its_own_error(api: ApiServer, client: LightkubeApi) -> None:
    await api.go_down("refuse")
    with pytest.raises(ApiUnreachableError, match="ConnectError"):
        await client.list_slices(DRIVER, NODE)
    with pytest.raises(ApiUnreachableError):
        async for _ in client.watch_slices(DRIVER, NODE, "1"):
            pass
    await api.come_back()
    assert (await client.list_slices(DRIVER, NODE)).items == ()


def _decoded(target: str) -> str:
    from urllib.parse import unquote

    return unquote(target)
