"""The DRA kubelet plugin's two sockets: registration with the kubelet, and the DRA service.

The kubelet's plugin watcher finds ``<kubelet_root>/plugins_registry/<driver>-reg.sock``
(inotify, and a scan when it starts), calls ``pluginregistration.Registration/GetInfo``,
checks the answer, dials the endpoint it names, and tells the plugin the outcome with
NotifyRegistrationStatus. Afterwards it calls GetInfo again now and then as a health check.
So registering is passive: serve GetInfo truthfully and keep the socket there.

:class:`KubeletPlugin` starts the DRA service first (``<kubelet_root>/plugins/<driver>/
dra.sock``: the kubelet dials it as soon as it has the answer), then the registration socket;
it watches the registry dir with inotify and puts the socket back when it is removed or the
dir is deleted and re-created (a kubelet restart needs nothing: the kubelet finds the socket
and asks again); and when it stops (SIGTERM), it removes the registration socket first (the
kubelet deregisters the driver), then the DRA socket. Both sockets are 0600.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.dirwatch import DirWatcher
from devplug._kits.problems import ProblemLog, error_reason
from devplug._kits.socket_claim import SocketInUseError
from devplug._kits.values import LatestValue
from devplug._proto import pluginregistration_v1_pb2 as reg
from devplug._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from devplug.dra.claims import ClaimPreparer
from devplug.dra.naming import validate_driver_name
from devplug.dra.service import SUPPORTED_VERSIONS, add_dra_services
from devplug.dra.sockets import SocketServer, check_socket_path
from devplug.errors import ConfigError

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration's constant for DRA drivers
REGISTRY_DIR = "plugins_registry"
PLUGINS_DIR = "plugins"
DRA_SOCKET = "dra.sock"
PLUGIN_DIR_MODE = 0o750


@dataclass(frozen=True, slots=True)
class PluginPaths:
    """Where the kubelet looks for a DRA driver, under its root dir."""

    driver: str
    registry_dir: Path  # <root>/plugins_registry
    registration_socket: Path  # <root>/plugins_registry/<driver>-reg.sock
    plugin_dir: Path  # <root>/plugins/<driver>: the DRA socket and the checkpoint
    dra_socket: Path  # <root>/plugins/<driver>/dra.sock

    @classmethod
    def under(cls, kubelet_root: Path, driver: str) -> PluginPaths:
        """The paths of ``driver`` under ``kubelet_root`` (``dra.kubelet_root``); ConfigError
        when the root is relative or too long for unix sockets, InvalidNameError for a bad
        driver name."""
        validate_driver_name(driver)
        if not kubelet_root.is_absolute():
            raise ConfigError(
                "dra.kubelet_root",
                f"{kubelet_root} is relative: the kubelet is told the DRA socket's absolute "
                "path; give an absolute dir (as the kubelet's --root-dir, /var/lib/kubelet)",
            )
        registry = kubelet_root / REGISTRY_DIR
        plugin_dir = kubelet_root / PLUGINS_DIR / driver
        return cls(
            driver=driver,
            registry_dir=registry,
            registration_socket=check_socket_path(
                registry / f"{driver}-reg.sock", "dra.kubelet_root"
            ),
            plugin_dir=plugin_dir,
            dra_socket=check_socket_path(plugin_dir / DRA_SOCKET, "dra.kubelet_root"),
        )


@dataclass(frozen=True, slots=True)
class RegistrationStatus:
    """What the kubelet last said of our registration (NotifyRegistrationStatus)."""

    registered: bool
    error: str
    at: float  # time.time()


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """GetInfo's answer, and what NotifyRegistrationStatus said (``status``; None before)."""

    def __init__(self, paths: PluginPaths) -> None:
        self.info = reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=paths.driver,
            endpoint=str(paths.dra_socket),
            supported_versions=SUPPORTED_VERSIONS,
        )
        self.status: LatestValue[RegistrationStatus | None] = LatestValue(None)
        self.info_calls = 0
        self._log = log.bind(driver=paths.driver)

    async def GetInfo(
        self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> reg.PluginInfo:
        self.info_calls += 1
        self._log.debug("dra.registration.get_info")
        return self.info

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> reg.RegistrationStatusResponse:
        self.status.set(RegistrationStatus(request.plugin_registered, request.error, time.time()))
        if request.plugin_registered:
            self._log.info("dra.registration.accepted")
            return reg.RegistrationStatusResponse()
        self._log.error("dra.registration.refused", reason=request.error or "no reason given")
        # As the reference helper (k8s.io/dynamic-resource-allocation kubeletplugin) does: a
        # refusal is answered with an error, which the kubelet logs beside its own.
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"registration refused by the kubelet: {request.error}"
        )
        raise AssertionError("unreachable: abort raises")


@dataclass(frozen=True, slots=True)
class RegistrationInfo:
    """What a registration socket answers GetInfo with (``devplug status`` shows it)."""

    type: str
    driver: str
    endpoint: str
    supported_versions: tuple[str, ...]


class RegistrationProbeError(Exception):
    """The registration socket did not answer GetInfo (the message says why)."""


async def ask_registration(socket: Path, timeout: float) -> RegistrationInfo:
    """GetInfo on ``socket``, as the kubelet's plugin watcher asks it; RegistrationProbeError
    when it does not answer within ``timeout`` seconds."""
    channel = grpc.aio.insecure_channel(f"unix://{socket.absolute()}")
    try:
        stub = reg_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(reg.InfoRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        raise RegistrationProbeError(f"{exc.code().name}: {exc.details()}") from None
    finally:
        await channel.close(None)
    return RegistrationInfo(info.type, info.name, info.endpoint, tuple(info.supported_versions))


@dataclass(frozen=True, slots=True)
class PluginTiming:
    """Back-off and stop times; tests shorten them, the defaults suit a real node."""

    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0
    # inotify tells of the registry dir's changes; this only backs it up.
    stat_backstop_s: float = 30.0
    # In-flight calls get this long when the plugin stops (a Prepare writing the checkpoint).
    stop_grace_s: float = 1.0


class KubeletPlugin:
    """Serve the DRA service and the registration socket until cancelled."""

    def __init__(
        self, paths: PluginPaths, preparer: ClaimPreparer, *, timing: PluginTiming | None = None
    ) -> None:
        self.paths = paths
        self.preparer = preparer
        self.timing = timing or PluginTiming()
        self.registration = RegistrationServicer(paths)
        self.dra = SocketServer(
            paths.dra_socket,
            lambda server: add_dra_services(preparer, server),
            stop_grace_s=self.timing.stop_grace_s,
        )
        self.registrar = SocketServer(
            paths.registration_socket,
            lambda server: reg_grpc.add_RegistrationServicer_to_server(self.registration, server),
            stop_grace_s=self.timing.stop_grace_s,
        )
        # True while both sockets are in place (what the kubelet can find now).
        self.serving: LatestValue[bool] = LatestValue(False)
        self.watcher = DirWatcher(
            paths.registry_dir,
            lambda name: name == paths.registration_socket.name,
            "dra.registry",
        )
        self._log = log.bind(driver=paths.driver)

    async def run(self) -> None:
        """Load the checkpoint, serve, keep the sockets in place; on cancellation remove both
        sockets. A checkpoint that cannot be read stops it (CheckpointError)."""
        await self.preparer.load()
        try:
            async with asyncio.TaskGroup() as group:
                watch = group.create_task(self.watcher.run(), name="dra-registry-watch")
                try:
                    await self._keep_serving()
                finally:
                    watch.cancel()
        finally:
            await self._close()

    async def _keep_serving(self) -> None:
        backoff = Backoff(self.timing.backoff_initial_s, self.timing.backoff_max_s)
        problems = ProblemLog()
        while True:
            version = self.watcher.changes.version
            wait = self.timing.stat_backstop_s
            try:
                await self._ensure(self.dra, "service")
                if self.paths.registry_dir.is_dir():
                    await self._ensure(self.registrar, "registration")
                    problems.solved()
                else:
                    problems.report(
                        self._log,
                        "dra.registration.waiting",
                        "registry dir missing: is the kubelet running, with this root dir?",
                        level="warning",
                        dir=str(self.paths.registry_dir),
                    )
                backoff.reset()
            except (OSError, RuntimeError, SocketInUseError) as exc:
                wait = backoff.next()
                problems.report(
                    self._log,
                    "dra.listen.failed",
                    error_reason(exc),
                    retry_in_s=round(wait, 3),
                )
            serving = self.dra.intact() and self.registrar.intact()
            if serving != self.serving.value:
                self.serving.set(serving)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self.watcher.changes.wait_changed(version)

    async def _ensure(self, server: SocketServer, which: str) -> None:
        """Listen on ``server``'s socket unless it is there and ours."""
        if server.intact():
            return
        if server.listening:
            self._log.info(f"dra.{which}.socket.gone", socket=str(server.path))
        if server is self.dra:
            self.paths.plugin_dir.mkdir(PLUGIN_DIR_MODE, parents=True, exist_ok=True)
        await server.listen()
        self._log.info(f"dra.{which}.listening", socket=str(server.path))

    async def _close(self) -> None:
        """Registration first, so that the kubelet deregisters before the service goes."""
        self.serving.set(False)
        try:
            await self.registrar.close()
        finally:
            await self.dra.close()
        self._log.info("dra.plugin.stopped")
