"""The DRA front's API-server client: the REST calls the slice publisher and Prepare need,
behind one small interface (:class:`KubeApi`) that speaks plain JSON dicts, so that the
publisher never sees a client library's types. The one module that imports lightkube
(docs/dra.md, "Why lightkube"); kubernetes_asyncio could take its place behind the same
interface.

Where the API server is: :func:`load_api_client` reads the standard ``KUBECONFIG`` variable
(one kubeconfig file: server URL, bearer token or client certificate) and otherwise the
in-cluster config (``KUBERNETES_SERVICE_HOST``/``_PORT`` and the ServiceAccount's token and CA
in ``/var/run/secrets/kubernetes.io/serviceaccount``). An explicit ``KUBECONFIG`` wins, as
with kubectl and client-go; no ``~/.kube/config`` fallback: a daemon on a node should not pick
up whichever credentials root happens to have. Anything missing or unusable is a
:class:`~devplug.errors.ConfigError` naming the setting and the fix.

Errors: an answer from the API server is an :class:`ApiStatusError` (its Status: code, reason,
message, causes); not reaching it (refused, reset, timed out, a TLS failure) is an
:class:`ApiUnreachableError`. A watch from a resourceVersion the server no longer has ends with
``ApiStatusError`` code 410: list again and watch from the list's resourceVersion.
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx2
import msgspec
import yaml
from lightkube import ApiError, AsyncClient
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.core.client import FieldSelector
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.core.generic_client import GenericAsyncClient
from lightkube.models.meta_v1 import Status
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from devplug.errors import ConfigError, DevplugError

JsonObject = dict[str, Any]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FIELD_MANAGER = "devplug"
_IN_CLUSTER = "in-cluster config"


@dataclass(frozen=True, slots=True)
class StatusCause:
    field: str
    reason: str
    message: str


class ApiStatusError(DevplugError):
    """The API server answered with an error Status (409 Conflict, 404 NotFound, 422 Invalid
    with ``causes``, 410 Expired, ...)."""

    def __init__(
        self, code: int, reason: str, message: str, causes: tuple[StatusCause, ...] = ()
    ) -> None:
        super().__init__(f"{code} {reason or 'error'}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.causes = causes


class ApiUnreachableError(DevplugError):
    """The API server could not be reached or stopped answering mid-way."""


class UnsentFieldsError(DevplugError, ValueError):
    """The object has fields the client's models do not know: sent, they would vanish."""


@dataclass(frozen=True, slots=True)
class SliceList:
    resource_version: str
    items: tuple[JsonObject, ...]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED
    object: JsonObject


class KubeApi(Protocol):
    """What the DRA front asks of the API server. Objects are the wire JSON (camelCase)."""

    async def list_slices(self, driver: str, node: str) -> SliceList: ...

    def watch_slices(
        self, driver: str, node: str, resource_version: str, *, timeout_s: int | None = None
    ) -> AsyncIterator[WatchEvent]: ...

    async def create_slice(self, obj: Mapping[str, Any]) -> JsonObject: ...

    async def replace_slice(self, obj: Mapping[str, Any]) -> JsonObject: ...

    async def delete_slice(
        self, name: str, *, uid: str | None = None, resource_version: str | None = None
    ) -> None: ...

    async def get_claim(self, namespace: str, name: str) -> JsonObject: ...

    async def get_node(self, name: str) -> JsonObject: ...

    async def aclose(self) -> None: ...


class LightkubeApi:
    """:class:`KubeApi` on lightkube's AsyncClient."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list_slices(self, driver: str, node: str) -> SliceList:
        with _translated():
            listing = self._client.list(ResourceSlice, fields=_own(driver, node))
            items = tuple([item.to_dict() async for item in listing])
            return SliceList(listing.resourceVersion, items)

    async def watch_slices(
        self, driver: str, node: str, resource_version: str, *, timeout_s: int | None = None
    ) -> AsyncIterator[WatchEvent]:
        """Events after ``resource_version``, without end: lightkube re-opens the watch from
        the last event when the server ends one (after ``timeout_s``, the request's
        ``timeoutSeconds``, when given). Raises on the first error (410 included). A
        connection that goes silent is not noticed here (lightkube reads watches without a
        timeout): the caller bounds the watch."""
        events = self._client.watch(
            ResourceSlice,
            fields=_own(driver, node),
            resource_version=resource_version,
            server_timeout=timeout_s,
        )
        try:
            with _translated():
                async for type_, obj in events:
                    yield WatchEvent(type_, obj.to_dict())
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def create_slice(self, obj: Mapping[str, Any]) -> JsonObject:
        with _translated():
            created = await self._client.create(_model(obj))
            return created.to_dict()

    async def replace_slice(self, obj: Mapping[str, Any]) -> JsonObject:
        """PUT; the object's ``metadata.resourceVersion`` makes it conditional (409 when stale)."""
        with _translated():
            replaced = await self._client.replace(_model(obj))
            return replaced.to_dict()

    async def delete_slice(
        self, name: str, *, uid: str | None = None, resource_version: str | None = None
    ) -> None:
        """DELETE, only if the slice still has ``uid`` and ``resource_version`` (when given;
        409 otherwise). The preconditions travel in a DeleteOptions body, the only place the
        API server reads them; lightkube's ``delete()`` sends no body, so this goes through
        lightkube's own request path with one."""
        preconditions = {
            key: value
            for key, value in (("uid", uid), ("resourceVersion", resource_version))
            if value is not None
        }
        generic: GenericAsyncClient = self._client._client
        request = generic.prepare_request("delete", res=ResourceSlice, name=name)
        if preconditions:
            request.data = {
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "preconditions": preconditions,
            }
        with _translated():
            # GenericAsyncClient.send is unannotated in lightkube 1.0.1.
            response = await generic.send(generic.build_adapter_request(request))  # type: ignore[no-untyped-call]
            generic.handle_response("delete", response, request)

    async def get_claim(self, namespace: str, name: str) -> JsonObject:
        with _translated():
            claim = await self._client.get(ResourceClaim, name, namespace=namespace)
            return claim.to_dict()

    async def get_node(self, name: str) -> JsonObject:
        with _translated():
            node = await self._client.get(Node, name)
            return node.to_dict()

    async def aclose(self) -> None:
        await self._client.close()


def load_api_client(
    environ: Mapping[str, str] | None = None,
    *,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    timeout: float = 10.0,
) -> LightkubeApi:
    """A client for the API server that ``KUBECONFIG`` or the in-cluster config names; reads
    their files (call it at start-up, not on a busy loop). ConfigError when neither is usable."""
    config = api_server_config(os.environ if environ is None else environ, service_account_dir)
    where = "KUBECONFIG" if config.fname is not None else _IN_CLUSTER
    source = f"{config.fname}: " if config.fname is not None else ""
    _check_files(config, where, source)
    try:
        client = AsyncClient(
            config=config, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER
        )
    except (ssl.SSLError, OSError, LightkubeConfigError) as exc:
        raise ConfigError(
            where, f"{source}cannot use its certificates or credentials: {_describe(exc)}"
        ) from None
    return LightkubeApi(client)


def _check_files(config: SingleConfig, where: str, source: str) -> None:
    """ConfigError naming the setting and the file, for a file the config names that cannot
    be read (the TLS library's own error names neither)."""
    user = config.user
    named = [  # (setting, the file it names, the setting that holds the content instead)
        ("certificate-authority", config.cluster.certificate_auth, "certificate-authority-data"),
        ("client-certificate", user.client_cert if user else None, "client-certificate-data"),
        ("client-key", user.client_key if user else None, "client-key-data"),
        ("tokenFile", user.token_file if user else None, "token"),
    ]
    for setting, name, inline in named:
        if not name:
            continue
        try:
            path = Path(config.abs_file(name))
            with path.open("rb"):
                pass
        except LightkubeConfigError as exc:
            raise ConfigError(where, f"{source}{setting}: {exc}") from None
        except OSError as exc:
            raise ConfigError(
                where,
                f"{source}{setting} {path}: {exc.strerror or exc}; name a file devplug can "
                f"read, or give its content as {inline}",
            ) from None


def api_server_config(environ: Mapping[str, str], service_account_dir: Path) -> SingleConfig:
    """Which API server, and how to authenticate: ``KUBECONFIG`` first, then in-cluster."""
    kubeconfig = environ.get("KUBECONFIG", "")
    if kubeconfig:
        return _from_kubeconfig(kubeconfig)
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return _in_cluster(environ, service_account_dir)
    raise ConfigError(
        "KUBECONFIG",
        "no API server configured: not running in a pod (KUBERNETES_SERVICE_HOST is unset) "
        "and KUBECONFIG is not set; set KUBECONFIG to a kubeconfig file",
    )


def _from_kubeconfig(value: str) -> SingleConfig:
    if os.pathsep in value:
        raise ConfigError(
            "KUBECONFIG", f"lists several files ({value}); devplug reads one: name just one"
        )
    path = Path(value)
    try:
        config = KubeConfig.from_file(path).get()
    except LightkubeConfigError as exc:
        raise ConfigError("KUBECONFIG", f"{path}: {exc}") from None
    except (OSError, yaml.YAMLError, KeyError, TypeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            "KUBECONFIG", f"{path}: not a usable kubeconfig ({_describe(exc)})"
        ) from None
    if config is None:
        raise ConfigError("KUBECONFIG", f"{path}: has no current-context")
    if config.user is None:
        raise ConfigError(
            "KUBECONFIG",
            f"{path}: context {config.context_name!r} names no user: add one with a token or "
            "a client certificate",
        )
    _check_server(config.cluster.server, f"KUBECONFIG ({path})")
    return config


def _in_cluster(environ: Mapping[str, str], account: Path) -> SingleConfig:
    host, port = environ["KUBERNETES_SERVICE_HOST"], environ.get("KUBERNETES_SERVICE_PORT", "")
    if not port.isdigit():
        raise ConfigError(_IN_CLUSTER, f"KUBERNETES_SERVICE_PORT is {port!r}, not a port number")
    for needed in ("token", "ca.crt"):
        if not (account / needed).is_file():
            raise ConfigError(
                _IN_CLUSTER,
                f"{account / needed} is missing: mount the pod's ServiceAccount token "
                "(automountServiceAccountToken: true), or set KUBECONFIG",
            )
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address
    server = f"https://{host}:{port}"
    cluster = Cluster(server=server, certificate_auth=str(account / "ca.crt"))
    # token_file: re-read on 401, since the kubelet rotates projected tokens.
    user = User(token_file=str(account / "token"))
    config = KubeConfig.from_one(cluster=cluster, user=user).get()
    assert config is not None
    return config


def _check_server(server: str | None, where: str) -> None:
    if not server or not server.startswith(("https://", "http://")):
        raise ConfigError(where, f"cluster server {server!r} is not an http(s) URL")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"it names {exc.args[0]!r}, which it does not define"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _own(driver: str, node: str) -> FieldSelector:
    """The field selector of a node-local driver's own slices (what the kubelet wipes by)."""
    return {"spec.driver": driver, "spec.nodeName": node}


def _model(obj: Mapping[str, Any]) -> ResourceSlice:
    """The typed object lightkube sends; refuses what its models would silently drop."""
    model = ResourceSlice.from_dict(dict(obj))
    assert isinstance(model, ResourceSlice)
    dropped = _dropped(obj, model.to_dict(), "")
    if dropped:
        raise UnsentFieldsError(
            f"ResourceSlice fields unknown to the installed lightkube-models, which would not be "
            f"sent: {', '.join(dropped)} (upgrade lightkube-models)"
        )
    return model


def _dropped(sent: Any, kept: Any, path: str) -> list[str]:
    if isinstance(sent, Mapping) and isinstance(kept, Mapping):
        found = []
        for key, value in sent.items():
            where = f"{path}.{key}" if path else str(key)
            if value is None:
                continue
            if key not in kept:
                found.append(where)
            else:
                found.extend(_dropped(value, kept[key], where))
        return found
    if isinstance(sent, list) and isinstance(kept, list):
        return [
            p
            for i, (a, b) in enumerate(zip(sent, kept, strict=False))
            for p in _dropped(a, b, f"{path}[{i}]")
        ]
    return []


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """lightkube's and httpx2's errors as this module's."""
    try:
        yield
    except ApiError as exc:
        raise _status_error(exc.status) from exc
    except httpx2.HTTPStatusError as exc:
        code = exc.response.status_code
        raise ApiStatusError(code, "", f"HTTP {code} without a Status body") from exc
    except httpx2.RequestError as exc:
        raise ApiUnreachableError(f"API server unreachable: {type(exc).__name__}: {exc}") from exc


def _status_error(status: Status) -> ApiStatusError:
    details = status.details
    causes = tuple(
        StatusCause(cause.field or "", cause.reason or "", cause.message or "")
        for cause in ((details.causes if details is not None else None) or [])
    )
    return ApiStatusError(status.code or 0, status.reason or "", status.message or "", causes)
