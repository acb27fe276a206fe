"""A stand-in Kubernetes API server for the DRA front: the REST routes a node driver uses, with
the semantics a real server has for them, over real HTTP on 127.0.0.1.

Routes (``resource.k8s.io/v1`` unless said otherwise)::

    GET    /apis/resource.k8s.io/v1/resourceslices            list (fieldSelector, limit/continue)
    GET    /apis/resource.k8s.io/v1/resourceslices?watch=1    watch (chunked JSON lines)
    POST   /apis/resource.k8s.io/v1/resourceslices            create (generateName)
    DELETE /apis/resource.k8s.io/v1/resourceslices            deletecollection (the kubelet's wipe)
    GET|PUT|DELETE /apis/resource.k8s.io/v1/resourceslices/{name}
    GET    /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims[/{name}]
    GET    /api/v1/nodes[/{name}]

Claims and nodes are read-only over HTTP; tests put them with :meth:`ApiServer.put_claim` and
:meth:`ApiServer.put_node`, as the scheduler and the kubelet would. Writes are checked by the
structural schema (``kubernetes-validate``, see :mod:`.schema`), then by the
API server's semantic rules (``devplug.dra.validate``), and refused with 422 and its causes.

Not modelled: PATCH and server-side apply, label selectors, finalizers and graceful deletion,
garbage collection of owned objects, managedFields, dry runs, protobuf, HTTP/2. A request
for any of them is refused (400, 405 or 415), never half-served.

Query parameters are read as the API server reads them: a boolean is false only when absent,
``0`` or ``false`` in any case, so ``watch=true``, ``watch=True``, ``watch=1`` and ``watch=``
all watch (apimachinery ``runtime.Convert_Slice_string_To_bool``; not Go's ``ParseBool``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
import ssl
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from devplug._kits.values import LatestValue, Watchable
from devplug.dra.validate import validate_resource_slice
from devplug.testing.apiserver.checks import SliceValidator, WriteChecks
from devplug.testing.apiserver.field_selectors import (
    SLICE_FIELD_LABELS,
    FieldSelector,
)
from devplug.testing.apiserver.http1 import Request, Responder, serve_connection
from devplug.testing.apiserver.request import (
    Route,
    delete_options,
    int_param,
    json_body,
    list_body,
    query_bool,
    route_of,
    send_json,
    untyped,
    verb_of,
    watch_timeout,
)
from devplug.testing.apiserver.schema import DEFAULT_SCHEMA_VERSION, structural_schema
from devplug.testing.apiserver.status import (
    CLAIMS,
    NODES,
    SLICES,
    JsonObject,
    Kind,
    StatusError,
    bad_request,
)
from devplug.testing.apiserver.store import Store
from devplug.testing.apiserver.watch import WatchOptions, stream_watch
from devplug.testing.waiting import waiting_for

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the server saw it: the Kubernetes verb, resource, name and the answer."""

    verb: str
    resource: str
    name: str
    namespace: str
    code: int
    target: str


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for serving HTTPS: the server's certificate and key, and the CA that signed it
    (written into kubeconfigs as ``certificate-authority-data``)."""

    cert: Path
    key: Path
    ca: Path


class ApiServer:
    """The stand-in. ``async with ApiServer() as api:`` serves on a random port of 127.0.0.1.

    - ``token``: the bearer token every request must carry (401 otherwise); None: no check.
    - ``schema_version``: the Kubernetes version whose strict schemas check writes (needs
      ``kubernetes-validate``); None: no structural check.
    - ``slice_validator``: the semantic rules for ResourceSlices (default: devplug's mirror of
      the API server's ``validateResourceSliceSpec``); None: none.
    - ``field_labels``: the fields a ResourceSlice field selector may name (a 1.34 server's by
      default; add ``POOL_NAME_FIELD_LABEL`` to play a newer one).
    - ``history``: watch events kept; a watch from before them gets 410 Expired.
    - ``bookmark_interval``: seconds between BOOKMARKs to watches that allow them.
    - ``max_watch_seconds``: end every watch after this long (a real server ends watches after
      30-60 min), None: only ``timeoutSeconds`` ends them.
    """

    def __init__(
        self,
        *,
        token: str | None = "devplug-stand-in-token",
        schema_version: str | None = DEFAULT_SCHEMA_VERSION,
        slice_validator: SliceValidator | None = validate_resource_slice,
        field_labels: frozenset[str] = SLICE_FIELD_LABELS,
        history: int = 1000,
        tls: TlsFiles | None = None,
        bookmark_interval: float = 60.0,
        max_watch_seconds: float | None = None,
    ) -> None:
        self.token = token
        self.schema_version = schema_version
        self.field_labels = field_labels
        self.tls = tls
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self.requests: Counter[str] = Counter()
        self.request_log: deque[RequestRecord] = deque(maxlen=10_000)
        self._schema = structural_schema(schema_version) if schema_version else None
        self._store = Store(history=history, validate=WriteChecks(self._schema, slice_validator))
        self._activity: LatestValue[int] = LatestValue(0)
        self._bookmarks: LatestValue[int] = LatestValue(0)
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._mode: Literal["up", "refuse", "unavailable", "stopped"] = "stopped"
        self._open_watches = 0
        self.host = "127.0.0.1"
        self.port = 0

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self._listen()
        self._mode = "up"

    async def stop(self) -> None:
        self._mode = "stopped"
        await self._drop_connections(close_listener=True)

    async def __aenter__(self) -> ApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def write_kubeconfig(self, path: Path, *, token: str | None = None) -> Path:
        """A kubeconfig for this server (its token, or ``token``; its CA when serving TLS),
        written atomically; returns ``path``."""
        cluster: dict[str, Any] = {"server": self.url}
        if self.tls is not None:
            cluster["certificate-authority-data"] = base64.b64encode(
                self.tls.ca.read_bytes()
            ).decode()
        user = {"token": token or self.token or "none"}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": cluster}],
            "users": [{"name": "stand-in", "user": user}],
            "contexts": [
                {"name": "stand-in", "context": {"cluster": "stand-in", "user": "stand-in"}}
            ],
            "current-context": "stand-in",
        }
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(config, indent=2))  # JSON is YAML
        os.replace(temporary, path)
        return path

    # ---------------------------------------------------------------- availability

    async def go_down(self, mode: Literal["refuse", "unavailable"] = "refuse") -> None:
        """Play an API server outage: ``refuse`` closes the port (connection refused), while
        ``unavailable`` answers every request 503 ServiceUnavailable. Open connections and
        watches are cut either way."""
        self._mode = mode
        await self._drop_connections(close_listener=mode == "refuse")
        self._changed()

    async def come_back(self) -> None:
        """Serve again, on the same port, with everything stored as before."""
        if self._server is None:
            await self._listen()
        self._mode = "up"
        self._changed()

    @contextlib.asynccontextmanager
    async def down(self, mode: Literal["refuse", "unavailable"] = "refuse") -> AsyncIterator[None]:
        """``async with api.down():`` - unavailable inside the block, back after it."""
        await self.go_down(mode)
        try:
            yield
        finally:
            await self.come_back()

    # ---------------------------------------------------------------- what tests read

    @property
    def resource_version(self) -> int:
        return self._store.rv

    @property
    def writes(self) -> int:
        """Write requests served so far (create, update, patch, delete, deletecollection),
        refused ones included."""
        return sum(count for verb, count in self.requests.items() if verb in WRITE_VERBS)

    @property
    def open_watches(self) -> int:
        return self._open_watches

    @property
    def activity(self) -> Watchable[int]:
        """Changes whenever anything here does: a write, a request answered, a watch opened
        or closed, an outage. Await it (``wait_for``) instead of polling."""
        return self._activity

    def slices(self, field_selector: str | None = None) -> dict[str, JsonObject]:
        """The stored ResourceSlices (copies) by name, optionally filtered like a list."""
        selector = FieldSelector.parse(field_selector, self.field_labels, SLICES)
        return {
            obj["metadata"]["name"]: copy.deepcopy(obj)
            for obj in self._store.items(SLICES, selector)
        }

    async def wait_for(
        self, predicate: Callable[[ApiServer], object], timeout: float = 5.0, what: str = ""
    ) -> None:
        """Return once ``predicate(self)`` holds; re-checked after every change, never polled."""

        def seen() -> str:
            return f"resourceVersion {self.resource_version}, requests {dict(self.requests)}"

        async with waiting_for(timeout, what or "the API server stand-in's state", seen):
            async for _ in self._activity.as_changed():
                if predicate(self):
                    return

    # ---------------------------------------------------------------- what tests write

    def put_claim(self, claim: Mapping[str, Any]) -> JsonObject:
        """Store a ResourceClaim as the scheduler would (create or overwrite; a watch-visible
        write). Checked against the structural schema when one is loaded."""
        obj = dict(claim)
        if self._schema is not None:
            problems = self._schema.problems(
                CLAIMS, {"apiVersion": CLAIMS.api_version, "kind": CLAIMS.kind, **obj}
            )
            if problems:
                raise ValueError(
                    "claim fixture is not a valid ResourceClaim: "
                    + "; ".join(f"{p.field}: {p.message}" for p in problems)
                )
        if not obj.get("metadata", {}).get("namespace"):
            raise ValueError("claim fixture needs metadata.namespace")
        stored = self._store.put(CLAIMS, obj)
        self._changed()
        return copy.deepcopy(stored)

    def put_node(self, name: str, labels: Mapping[str, str] | None = None) -> JsonObject:
        """Store a Node named ``name``; returns it (its ``metadata.uid`` is what owner
        references name)."""
        meta: JsonObject = {"name": name}
        if labels:
            meta["labels"] = dict(labels)
        stored = self._store.put(NODES, {"metadata": meta, "spec": {}, "status": {}})
        self._changed()
        return copy.deepcopy(stored)

    def delete_slices(self, field_selector: str | None = None) -> int:
        """Delete the matching slices as another client would (the kubelet's wipe), with the
        same events; not counted in ``requests``. Returns how many went."""
        selector = FieldSelector.parse(field_selector, self.field_labels, SLICES)
        deleted = self._store.delete_collection(SLICES, selector)
        self._changed()
        return len(deleted)

    def compact(self) -> None:
        """Forget the watch history so far: a watch or continue from before now gets 410."""
        self._store.compact()

    def send_bookmarks(self) -> None:
        """Send a BOOKMARK now to every watch that allows them."""
        self._bookmarks.set(self._bookmarks.value + 1)

    # ---------------------------------------------------------------- HTTP

    async def _listen(self) -> None:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.tls.cert, self.tls.key)
        self._server = await asyncio.start_server(
            self._accept, self.host, self.port, ssl=context, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            await serve_connection(reader, writer, self._handle)
        finally:
            del self._connections[task]

    async def _drop_connections(self, *, close_listener: bool) -> None:
        """Cut every open connection the way a dying server does (the peer sees a reset), and
        wait until their handlers have ended."""
        if close_listener and self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        tasks = list(self._connections)
        for writer in self._connections.values():
            writer.transport.abort()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _changed(self) -> None:
        self._activity.set(self._activity.value + 1)

    async def _handle(self, request: Request, responder: Responder) -> None:
        route = route_of(request.path)
        verb = verb_of(request, route)
        if route is not None:
            self.requests[verb] += 1
        try:
            await self._answer(request, responder, route, verb)
        except StatusError as error:
            await send_json(responder, error.code, error.status())
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as exc:  # a bug here: a 500, as a real server answers a handler panic
            failure = StatusError(500, "InternalError", f"stand-in API server bug: {exc!r}")
            await send_json(responder, 500, failure.status())
        finally:
            if route is not None:
                record = RequestRecord(
                    verb,
                    route.kind.plural,
                    route.name,
                    route.namespace,
                    responder.status,
                    request.target,
                )
                self.request_log.append(record)
            self._changed()

    async def _answer(
        self, request: Request, responder: Responder, route: Route | None, verb: str
    ) -> None:
        if self._mode == "unavailable":
            raise StatusError(
                503, "ServiceUnavailable", "the API server is unavailable (stand-in outage)"
            )
        if (
            self.token is not None
            and request.headers.get("authorization") != f"Bearer {self.token}"
        ):
            raise StatusError(401, "Unauthorized", "Unauthorized")
        if route is None:
            raise StatusError(404, "NotFound", "the server could not find the requested resource")
        if route.kind != SLICES and verb not in ("get", "list"):
            raise StatusError(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        for unsupported in ("labelSelector", "dryRun", "sendInitialEvents"):
            if request.param(unsupported):
                raise bad_request(
                    f"{unsupported} is not supported by devplug's stand-in API server"
                )
        kind, store = route.kind, self._store
        if verb == "get":
            await send_json(responder, 200, store.get(kind, route.namespace, route.name))
        elif verb == "list":
            await send_json(responder, 200, self._list(request, route))
        elif verb == "watch":
            await self._watch(request, responder, route)
        elif verb == "create":
            await send_json(responder, 201, store.create(kind, json_body(request, kind)))
        elif verb == "update":
            await send_json(
                responder,
                200,
                store.update(kind, route.namespace, route.name, json_body(request, kind)),
            )
        elif verb == "delete":
            # The deleted object comes back, not a Status: the resourceslices storage sets
            # ReturnDeletedObject (pkg/registry/resource/resourceslice/storage/storage.go).
            preconditions = delete_options(request).get("preconditions") or {}
            await send_json(
                responder, 200, store.delete(kind, route.namespace, route.name, preconditions)
            )
        elif verb == "deletecollection":
            delete_options(request)
            deleted = store.delete_collection(kind, self._selector(request, kind))
            await send_json(
                responder, 200, list_body(kind, store.rv, [untyped(obj) for obj in deleted])
            )
        else:
            raise StatusError(
                405, "MethodNotAllowed", f"{verb} is not supported by devplug's stand-in API server"
            )

    def _selector(self, request: Request, kind: Kind) -> FieldSelector:
        labels = (
            self.field_labels
            if kind == SLICES
            else frozenset({"metadata.name", "metadata.namespace"})
        )
        return FieldSelector.parse(request.param("fieldSelector"), labels, kind)

    def _list(self, request: Request, route: Route) -> JsonObject:
        selector = self._selector(request, route.kind)
        if route.kind.namespaced:
            selector = FieldSelector(
                ((("metadata.namespace", "=", route.namespace),) if route.namespace else ())
                + selector.terms
            )
        limit = int_param(request, "limit") or 0
        rv, items, token, remaining = self._store.page(
            route.kind, selector, limit, request.param("continue")
        )
        body = list_body(route.kind, rv, [untyped(obj) for obj in items])
        if token:
            body["metadata"]["continue"] = token
        if remaining is not None:
            body["metadata"]["remainingItemCount"] = remaining
        return body

    async def _watch(self, request: Request, responder: Responder, route: Route) -> None:
        options = WatchOptions(
            kind=route.kind,
            selector=self._selector(request, route.kind),
            resource_version=request.param("resourceVersion") or "",
            timeout=watch_timeout(int_param(request, "timeoutSeconds"), self.max_watch_seconds),
            bookmarks=query_bool(request.query.get("allowWatchBookmarks")),
            bookmark_interval=self.bookmark_interval,
        )
        self._open_watches += 1
        self._changed()
        try:
            await stream_watch(request, responder, self._store, options, self._bookmarks)
        finally:
            self._open_watches -= 1


def allocated_claim(
    name: str,
    namespace: str,
    results: Sequence[Mapping[str, str]],
    *,
    uid: str | None = None,
    device_class: str = "devplug.example.com",
) -> JsonObject:
    """A ResourceClaim as the scheduler leaves it: one request per distinct ``request`` name in
    ``results`` (each ``{"request", "driver", "pool", "device"}``), allocated to them."""
    requests = sorted({str(result["request"]).split("/")[0] for result in results})
    meta: JsonObject = {"name": name, "namespace": namespace}
    if uid is not None:
        meta["uid"] = uid
    return {
        "apiVersion": CLAIMS.api_version,
        "kind": CLAIMS.kind,
        "metadata": meta,
        "spec": {
            "devices": {
                "requests": [
                    {"name": request, "exactly": {"deviceClassName": device_class}}
                    for request in requests
                ]
            }
        },
        "status": {"allocation": {"devices": {"results": [dict(result) for result in results]}}},
    }
