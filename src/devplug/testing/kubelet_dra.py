"""A kubelet stand-in for DRA drivers: the plugin watcher's registration handshake and the DRA
manager's calls, over real unix sockets.

What it does, as the kubelet does (``pkg/kubelet/pluginmanager``, ``pkg/kubelet/cm/dra``):

- watches a ``plugins_registry`` dir (inotify, and a scan at start), ignoring names that begin
  with ``.`` and files that are not sockets;
- for each socket calls ``/pluginregistration.Registration/GetInfo`` and checks the answer:
  type ``DRAPlugin``, a valid driver name, an absolute endpoint that exists and is a socket,
  and a supported version it knows; it takes the first entry of the plugin's list that it
  knows (``known_services``, by default a 1.34+ kubelet's ``v1.DRAPlugin``,
  ``v1beta1.DRAPlugin``), then calls NotifyRegistrationStatus(true), or (false, error);
- is stricter where that catches a driver bug early: a plugin that does not list
  ``v1.DRAPlugin`` is refused while the stand-in knows v1 (a 1.32/1.33 kubelet would take
  v1beta1 alone: pass ``known_services=(V1BETA1,)`` to play one);
- calls GetInfo again every ``health_interval_s`` and deregisters a plugin that stops
  answering, or whose socket is removed or replaced; a socket that fails is tried again on
  the next round;
- calls NodePrepareResources/NodeUnprepareResources on the raw method paths of the chosen
  version (or one a test forces), with the kubelet's 45 s timeout, and fails the test when an
  answer lacks a requested claim (the kubelet would report "skipped" and ask again);
- :meth:`KubeletDra.restart` drops every connection, forgets every plugin and discovers the
  dir afresh, as a restarted kubelet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import grpc

from devplug._kits.dirwatch import DirWatcher
from devplug._proto import dra_v1_pb2, dra_v1beta1_pb2
from devplug._proto import pluginregistration_v1_pb2 as reg
from devplug.dra.naming import driver_name_problem
from devplug.testing.simulator import SimulatorRpcError
from devplug.testing.waiting import describe_callable, waiting_for

V1 = "v1.DRAPlugin"
V1BETA1 = "v1beta1.DRAPlugin"
KNOWN_SERVICES = (V1, V1BETA1)  # servicesSupportedByKubelet, in its order
PLUGIN_TYPE = "DRAPlugin"
GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY_REGISTRATION_STATUS = "/pluginregistration.Registration/NotifyRegistrationStatus"
CALL_TIMEOUT_S = 45.0  # defaultClientCallTimeout, pkg/kubelet/cm/dra/plugin/dra_plugin.go
INFO_TIMEOUT_S = 10.0
HEALTH_INTERVAL_S = 5.0
DEFAULT_WAIT_S = 10.0

_MESSAGES: dict[str, ModuleType] = {V1: dra_v1_pb2, V1BETA1: dra_v1beta1_pb2}


def method_path(service: str, method: str) -> str:
    """The kubelet's method path: ``/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/<method>``."""
    version, _, name = service.partition(".")
    return f"/k8s.io.kubelet.pkg.apis.dra.{version}.{name}/{method}"


@dataclass(frozen=True, slots=True)
class ClaimName:
    """A claim as the kubelet names it in a call."""

    namespace: str
    uid: str
    name: str

    @classmethod
    def of(cls, claim: Mapping[str, Any]) -> ClaimName:
        """The name of a ResourceClaim object (as the stand-in API server stores it)."""
        meta = claim["metadata"]
        return cls(meta["namespace"], meta["uid"], meta["name"])


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    """One claim of a NodePrepareResources answer."""

    devices: tuple[PreparedDevice, ...]
    error: str


@dataclass(frozen=True, slots=True)
class DraRegistration:
    """One registration attempt and its verdict."""

    socket: str  # the file name in the registry dir
    driver: str
    endpoint: str
    supported_versions: tuple[str, ...]
    service: str | None  # the version chosen
    accepted: bool
    error: str | None
    generation: int
    notify_error: str | None = None  # what the plugin answered NotifyRegistrationStatus with


@dataclass(frozen=True, slots=True)
class DraDeregistration:
    driver: str
    reason: str
    generation: int


class DraPluginSession:
    """A registered DRA driver as the kubelet sees it: its info and a channel to it."""

    def __init__(
        self,
        registration: DraRegistration,
        registration_socket: Path,
        identity: tuple[int, int],
        call_timeout_s: float,
    ) -> None:
        assert registration.service is not None
        self.registration = registration
        self.driver = registration.driver
        self.endpoint = Path(registration.endpoint)
        self.service = registration.service
        self.generation = registration.generation
        self.registration_socket = registration_socket
        self.identity = identity
        self.call_timeout_s = call_timeout_s
        self.channel = grpc.aio.insecure_channel(f"unix://{self.endpoint}")
        self.registration_channel = grpc.aio.insecure_channel(f"unix://{registration_socket}")

    async def get_info(self, timeout: float = INFO_TIMEOUT_S) -> reg.PluginInfo:
        return await _get_info(self.registration_channel, timeout)

    async def prepare(
        self, claims: Iterable[ClaimName], *, version: str | None = None
    ) -> dict[str, ClaimAnswer]:
        """NodePrepareResources over the chosen version (or ``version``); the answer by uid."""
        service, answer = await self._claims_call("NodePrepareResources", claims, version)
        return {
            uid: ClaimAnswer(
                tuple(
                    PreparedDevice(
                        tuple(d.request_names),
                        d.pool_name,
                        d.device_name,
                        tuple(d.cdi_device_ids),
                        d.share_id if service == V1 and d.HasField("share_id") else None,
                    )
                    for d in entry.devices
                ),
                entry.error,
            )
            for uid, entry in answer.claims.items()
        }

    async def unprepare(
        self, claims: Iterable[ClaimName], *, version: str | None = None
    ) -> dict[str, str]:
        """NodeUnprepareResources; the error ("" for none) by uid."""
        _, answer = await self._claims_call("NodeUnprepareResources", claims, version)
        return {uid: entry.error for uid, entry in answer.claims.items()}

    async def _claims_call(
        self, method: str, claims: Iterable[ClaimName], version: str | None
    ) -> tuple[str, Any]:
        """Call ``method`` (``Node[Un]prepareResources``) for ``claims``; the service called
        and its answer, which must cover every claim asked for."""
        service = version or self.service
        if service not in self.registration.supported_versions:
            raise AssertionError(
                f"{self.driver} did not advertise {service} (it lists "
                f"{list(self.registration.supported_versions)}): the kubelet would not call it"
            )
        pb = _MESSAGES[service]
        requested = list({c.uid: c for c in claims}.values())
        request = getattr(pb, f"{method}Request")(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in requested]
        )
        answer = await self._call(
            method_path(service, method), request, getattr(pb, f"{method}Response")
        )
        missing = [c.uid for c in requested if c.uid not in answer.claims]
        unasked = sorted(set(answer.claims) - {c.uid for c in requested})
        if missing or unasked:
            raise AssertionError(
                f"{method} skipped {len(missing)} ResourceClaims {missing} and answered "
                f"unrequested uids {unasked}"
            )
        return service, answer

    async def _call(self, path: str, request: Any, response_type: Any) -> Any:
        call = self.channel.unary_unary(
            path,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        try:
            return await call(request, timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise SimulatorRpcError(exc.code().name, exc.details() or "") from None

    async def close(self) -> None:
        await self.channel.close(None)
        await self.registration_channel.close(None)


async def _get_info(channel: grpc.aio.Channel, timeout: float) -> reg.PluginInfo:
    call = channel.unary_unary(
        GET_INFO,
        request_serializer=reg.InfoRequest.SerializeToString,
        response_deserializer=reg.PluginInfo.FromString,
    )
    info: reg.PluginInfo = await call(reg.InfoRequest(), timeout=timeout)
    return info


class KubeletDra:
    """``async with KubeletDra(registry_dir) as kubelet:``; see the module doc."""

    def __init__(
        self,
        registry_dir: Path,
        *,
        known_services: Sequence[str] = KNOWN_SERVICES,
        health_interval_s: float = HEALTH_INTERVAL_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        info_timeout_s: float = INFO_TIMEOUT_S,
    ) -> None:
        self.registry_dir = Path(registry_dir)
        self.known_services = tuple(known_services)
        self.health_interval_s = health_interval_s
        self.call_timeout_s = call_timeout_s
        self.info_timeout_s = info_timeout_s
        self.generation = 0
        self.plugins: dict[str, DraPluginSession] = {}
        self.registrations: list[DraRegistration] = []
        self.deregistrations: list[DraDeregistration] = []
        self.health_checks = 0
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        # The sockets (name, identity) this kubelet tried to register.
        self._tried: set[tuple[str, tuple[int, int]]] = set()

    async def __aenter__(self) -> KubeletDra:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Create the registry dir if missing (the kubelet does) and start discovering."""
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        watcher = DirWatcher(
            self.registry_dir, lambda name: not name.startswith("."), "kubelet_dra"
        )
        self._tasks = [
            asyncio.create_task(watcher.run(), name="kubelet-dra-watch"),
            asyncio.create_task(self._run(watcher), name="kubelet-dra-reconcile"),
        ]

    async def stop(self) -> None:
        """Stop watching and drop every plugin connection (what the kubelet going away does)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sessions = list(self.plugins.values())
        self.plugins = {}
        await asyncio.gather(*(s.close() for s in sessions))

    async def restart(self) -> None:
        """A kubelet restart: connections dropped, every plugin forgotten, the dir scanned."""
        await self.stop()
        self._tried.clear()
        self.generation += 1
        await self.start()

    # ------------------------------------------------------------------ calls

    def plugin(self, driver: str) -> DraPluginSession:
        session = self.plugins.get(driver)
        if session is None:
            raise AssertionError(
                f"{driver} is not registered with the kubelet stand-in: the kubelet would "
                f"not call it ({self._seen(driver)})"
            )
        return session

    async def prepare(
        self, driver: str, claims: Iterable[ClaimName], *, version: str | None = None
    ) -> dict[str, ClaimAnswer]:
        return await self.plugin(driver).prepare(claims, version=version)

    async def unprepare(
        self, driver: str, claims: Iterable[ClaimName], *, version: str | None = None
    ) -> dict[str, str]:
        return await self.plugin(driver).unprepare(claims, version=version)

    # ------------------------------------------------------------------ waiting

    async def wait_for_plugin(
        self,
        driver: str,
        *,
        generation: int | None = None,
        replacing: DraPluginSession | None = None,
        timeout: float = DEFAULT_WAIT_S,
    ) -> DraPluginSession:
        """Wait until ``driver`` is registered in ``generation`` (default: the current one);
        with ``replacing``, by a registration newer than that session's."""
        wanted = self.generation if generation is None else generation

        def ready() -> DraPluginSession | None:
            session = self.plugins.get(driver)
            if session is not None and session.generation >= wanted and session is not replacing:
                return session
            return None

        what = f"{driver} to register with the kubelet DRA stand-in (generation {wanted})"
        async with waiting_for(timeout, what, lambda: self._seen(driver)), self._changed:
            while (session := ready()) is None:
                await self._changed.wait()
            return session

    async def wait_for_registration(
        self,
        predicate: Callable[[DraRegistration], bool],
        *,
        after: int = 0,
        timeout: float = DEFAULT_WAIT_S,
    ) -> DraRegistration:
        """The first registration attempt (the ``after``-th or later) matching ``predicate``."""
        what = f"a registration attempt matching {describe_callable(predicate)}"
        async with waiting_for(timeout, what, lambda: self._seen(None)), self._changed:
            while True:
                for attempt in self.registrations[after:]:
                    if predicate(attempt):
                        return attempt
                await self._changed.wait()

    async def wait_for_deregistration(
        self, driver: str, *, after: int = 0, timeout: float = DEFAULT_WAIT_S
    ) -> DraDeregistration:
        """The first deregistration of ``driver`` (the ``after``-th or later)."""
        what = f"{driver} to be deregistered"
        async with waiting_for(timeout, what, lambda: self._seen(driver)), self._changed:
            while True:
                for gone in self.deregistrations[after:]:
                    if gone.driver == driver:
                        return gone
                await self._changed.wait()

    def _seen(self, driver: str | None) -> str:
        attempts = [r for r in self.registrations if driver is None or r.driver == driver]
        if not attempts:
            return f"no registration attempt (registry dir {self.registry_dir})"
        last = attempts[-1]
        verdict = "accepted" if last.accepted else f"refused: {last.error}"
        gone = [d.reason for d in self.deregistrations if driver is None or d.driver == driver]
        return f"{len(attempts)} attempts, the last {verdict} (generation {last.generation})" + (
            f"; deregistered: {gone[-3:]}" if gone else ""
        )

    # ------------------------------------------------------------------ the plugin watcher

    async def _run(self, watcher: DirWatcher) -> None:
        loop = asyncio.get_running_loop()
        next_health = loop.time() + self.health_interval_s
        while True:
            version = watcher.changes.version
            health = loop.time() >= next_health
            if health:
                next_health = loop.time() + self.health_interval_s
                self.health_checks += 1
            await self._reconcile(health)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(next_health - loop.time(), 0.0)):
                    await watcher.changes.wait_changed(version)

    def _sockets(self) -> dict[str, tuple[int, int]]:
        """Socket files of the dir (not ``.``-names) -> (inode, mtime)."""
        found: dict[str, tuple[int, int]] = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(self.registry_dir):
                if entry.name.startswith("."):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISSOCK(st.st_mode):
                        found[entry.name] = (st.st_ino, st.st_mtime_ns)
        return found

    async def _reconcile(self, health: bool) -> None:
        present = self._sockets()
        for session in list(self.plugins.values()):
            identity = present.get(session.registration_socket.name)
            if identity is None:
                await self._deregister(session, "socket removed")
            elif identity != session.identity:
                await self._deregister(session, "socket replaced")
            elif health:
                try:
                    await session.get_info(self.info_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    await self._deregister(session, f"GetInfo failed: {exc.code().name}")
        known = {(s.registration_socket.name, s.identity) for s in self.plugins.values()}
        for name, identity in present.items():
            # A socket that failed is tried again on the health rounds, not on every event.
            if (name, identity) not in known and (health or (name, identity) not in self._tried):
                await self._register(name, identity)

    async def _deregister(self, session: DraPluginSession, reason: str) -> None:
        async with self._changed:
            if self.plugins.get(session.driver) is session:
                del self.plugins[session.driver]
            self.deregistrations.append(DraDeregistration(session.driver, reason, self.generation))
            self._changed.notify_all()
        await session.close()

    async def _register(self, name: str, identity: tuple[int, int]) -> None:
        """GetInfo, validate, NotifyRegistrationStatus; a session when accepted."""
        self._tried.add((name, identity))
        path = self.registry_dir / name
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            try:
                info = await _get_info(channel, self.info_timeout_s)
            except grpc.aio.AioRpcError as exc:
                failed = f"failed to get plugin info: {exc.code().name}: {exc.details()}"
                await self._record(
                    DraRegistration(name, "", "", (), None, False, failed, self.generation)
                )
                return
            service, error = self._validate(info)
            notify_error = await self._notify(channel, error)
        attempt = DraRegistration(
            socket=name,
            driver=info.name,
            endpoint=info.endpoint,
            supported_versions=tuple(info.supported_versions),
            service=service,
            accepted=error is None,
            error=error,
            generation=self.generation,
            notify_error=notify_error,
        )
        session = None
        if error is None:
            session = DraPluginSession(attempt, path, identity, self.call_timeout_s)
        await self._record(attempt, session)

    def _validate(self, info: reg.PluginInfo) -> tuple[str | None, str | None]:
        """The chosen service, or why the registration is refused."""
        if info.type != PLUGIN_TYPE:
            return None, f"plugin type {info.type!r} is not {PLUGIN_TYPE!r}"
        problem = driver_name_problem(info.name)
        if problem is not None:
            return None, f"invalid driver name {info.name!r}: {problem}"
        endpoint = Path(info.endpoint)
        if not endpoint.is_absolute():
            return None, f"endpoint {info.endpoint!r} is not an absolute path"
        try:
            mode = os.lstat(endpoint).st_mode
        except OSError:
            return None, f"endpoint {info.endpoint} does not exist"
        if not stat.S_ISSOCK(mode):
            return None, f"endpoint {info.endpoint} is not a unix socket"
        versions = list(info.supported_versions)
        if not versions:
            return None, "empty list for supported versions"
        if V1 in self.known_services and V1 not in versions:
            return None, f"{V1} is not among the supported versions {versions}"
        service = next((v for v in versions if v in self.known_services), None)
        if service is None:
            return (
                None,
                f"none of {versions} is supported (the kubelet knows {list(self.known_services)})",
            )
        return service, None

    async def _notify(self, channel: grpc.aio.Channel, error: str | None) -> str | None:
        """NotifyRegistrationStatus; what the plugin answered, if an error."""
        call = channel.unary_unary(
            NOTIFY_REGISTRATION_STATUS,
            request_serializer=reg.RegistrationStatus.SerializeToString,
            response_deserializer=reg.RegistrationStatusResponse.FromString,
        )
        status = reg.RegistrationStatus(plugin_registered=error is None, error=error or "")
        try:
            await call(status, timeout=self.info_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return None

    async def _record(
        self, attempt: DraRegistration, session: DraPluginSession | None = None
    ) -> None:
        replaced = None
        async with self._changed:
            self.registrations.append(attempt)
            if session is not None:
                replaced = self.plugins.get(session.driver)
                self.plugins[session.driver] = session
            self._changed.notify_all()
        if replaced is not None:
            await replaced.close()
