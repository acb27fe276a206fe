"""The DRA front as the daemon runs it: the slice publisher, the kubelet plugin and the claim
preparer over one API client, following the advertised tree.

- :class:`DraFront` publishes the DRA resources of each tree the scan loop publishes as this
  node's pool (:mod:`.publisher`), serves the registration and DRA sockets
  (:mod:`.registration`), and prepares claims (:mod:`.claims`) against the pool as last
  published: the device names the scheduler allocated from. The CDI ids Prepare answers with
  come from the composition (``cdi``: the CDI specs on disk are another front's), so they are
  the ids the device-plugin front's Allocate names.
- :meth:`DraFront.from_environment` takes what the ``dra`` section cannot give from where a
  DaemonSet gives it: the node's name from ``NODE_NAME`` (the downward API), the API server
  from ``KUBECONFIG`` or the in-cluster config; and it reads the prepared-claims checkpoint.
  Anything missing or wrong is a ConfigError naming the variable, or the checkpoint file and
  its field (:class:`~devplug.dra.checkpoint.CheckpointError`), before anything is served.
- :func:`check_resources`: each ``dra.resources`` entry must be one that a configured scanner
  makes. A scan cannot tell (a GPU plugged in an hour from now is a resource of this node
  too), the scanners' config can: a scanner that implements ``ResourceNamer`` says which
  names it may advertise, whatever the host has; one that does not may advertise any.
- :func:`unstable_ids`: DRA device names are made from devplug's ids, and a claim allocated
  a name keeps it; the generic scanner's ids are the kernel's /dev names (``ttyUSB0``) unless
  its entry sets ``id_property``, and those can change at a reboot or a replug. Such a
  resource under ``dra.resources`` is warned about once, at start.

Stopping (cancelling :meth:`DraFront.run`) removes both sockets (the registration socket
first) and leaves the slices, which the kubelet deletes itself once the plugin is gone
(see :mod:`.publisher`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from devplug._kits.values import Watchable
from devplug.config import DraSettings
from devplug.dra.apiclient import KubeApi, load_api_client
from devplug.dra.checkpoint import CHECKPOINT_FILE, Checkpoint, PreparedClaim, load_checkpoint
from devplug.dra.claims import CallObserver, CdiIds, ClaimPreparer
from devplug.dra.naming import pool_name, pool_name_problem
from devplug.dra.publisher import PublishStats, PublishTiming, SlicePublisher
from devplug.dra.registration import KubeletPlugin, PluginPaths, PluginTiming
from devplug.errors import ConfigError
from devplug.model import DeviceInfo, DeviceTree
from devplug.scanners.base import ResourceNamer, Scanner
from devplug.scanners.generic import GenericScanner

log = structlog.get_logger(__name__)

NODE_NAME = "NODE_NAME"


class AdvertisedTree(Protocol):
    """One publication of the tree the front follows (the scan loop's ``Advertised``)."""

    @property
    def tree(self) -> DeviceTree: ...


@dataclass(frozen=True, slots=True)
class DraTiming:
    """Publishing and plugin timings; tests shorten them, the defaults suit a real node."""

    publish: PublishTiming = field(default_factory=PublishTiming)
    plugin: PluginTiming = field(default_factory=PluginTiming)


def check_resources(resources: Collection[str], scanners: Sequence[Scanner]) -> None:
    """ConfigError (``dra.resources``) for a resource none of ``scanners`` makes, as far as
    their ``ResourceNamer`` declarations tell; a scanner without one may make any."""
    if any(not isinstance(scanner, ResourceNamer) for scanner in scanners):
        return
    names = ", ".join(sorted(scanner.name for scanner in scanners)) or "none"
    for resource in resources:
        if not any(
            scanner.makes_resource(resource)
            for scanner in scanners
            if isinstance(scanner, ResourceNamer)
        ):
            raise ConfigError(
                "dra.resources",
                f"{resource!r} is made by none of the configured scanners ({names}); name a "
                "resource they advertise (devplug scan lists them), or configure the scanner "
                "that makes it",
            )


def unstable_ids(resources: Collection[str], scanners: Sequence[Scanner]) -> list[str]:
    """The ``resources`` a generic scanner entry makes with ids from /dev names (no
    ``id_property``): their DRA device names may move from device to device at a reboot."""
    return sorted(
        entry.resource
        for scanner in scanners
        if isinstance(scanner, GenericScanner)
        for entry in scanner.entries
        if entry.resource in resources and entry.id_property is None
    )


def node_name(environ: Mapping[str, str]) -> str:
    """This node's name from ``NODE_NAME``; ConfigError naming the variable."""
    name = environ.get(NODE_NAME, "")
    if not name:
        raise ConfigError(
            NODE_NAME,
            "is not set: give the daemon its node's name (the DaemonSet sets it from "
            "spec.nodeName through the downward API)",
        )
    problem = pool_name_problem(name)
    if problem is not None:
        raise ConfigError(NODE_NAME, f"{name!r} is not a node name: {problem}")
    return name


async def _trees(advertised: Watchable[AdvertisedTree | None]) -> AsyncIterator[DeviceTree]:
    async for published in advertised.as_changed():
        if published is not None:
            yield published.tree


def _advertised_device(
    advertised: Watchable[AdvertisedTree | None], resource: str, device_id: str
) -> DeviceInfo | None:
    published = advertised.value
    return None if published is None else published.tree.get(resource, {}).get(device_id)


class DraFront:
    """This node's DRA driver: its pool's slices, its kubelet plugin, its prepared claims."""

    def __init__(
        self,
        settings: DraSettings,
        *,
        api: KubeApi,
        node_name: str,
        advertised: Watchable[AdvertisedTree | None],
        cdi: CdiIds,
        timing: DraTiming | None = None,
        observe_calls: CallObserver | None = None,
        prepared: Mapping[str, PreparedClaim] | None = None,
    ) -> None:
        """``prepared``: the checkpoint's claims, read by the caller (else the plugin reads
        them when it starts)."""
        timing = timing or DraTiming()
        self.settings = settings
        self.api = api
        self.paths = PluginPaths.under(settings.kubelet_root, settings.driver)
        self.publisher = SlicePublisher(
            api,
            _trees(advertised),
            node_name=node_name,
            driver=settings.driver,
            resources=settings.resources,
            timing=timing.publish,
        )
        self.preparer = ClaimPreparer(
            driver=settings.driver,
            pool_name=pool_name(node_name),
            read_claim=api.get_claim,
            pool=self.publisher.pool,
            advertised=lambda resource, device_id: _advertised_device(
                advertised, resource, device_id
            ),
            cdi=cdi,
            checkpoint=Checkpoint(self.paths.plugin_dir / CHECKPOINT_FILE, settings.driver),
            observe=observe_calls,
            prepared=prepared,
        )
        self.plugin = KubeletPlugin(self.paths, self.preparer, timing=timing.plugin)

    @classmethod
    def from_environment(
        cls,
        settings: DraSettings,
        scanners: Sequence[Scanner],
        environ: Mapping[str, str],
        *,
        advertised: Watchable[AdvertisedTree | None],
        cdi: CdiIds,
        timing: DraTiming | None = None,
        observe_calls: CallObserver | None = None,
    ) -> DraFront:
        """The front for ``settings``, its node and API server from ``environ``, its prepared
        claims from the checkpoint; ConfigError naming the setting or variable when something
        is missing or wrong, CheckpointError (one) naming the file and the field when the
        checkpoint cannot be read. Reads files: call it at start-up."""
        check_resources(settings.resources, scanners)
        node = node_name(environ)
        for resource in unstable_ids(settings.resources, scanners):
            log.warning(
                "dra.names.unstable",
                resource=resource,
                reason="its device ids (and so its DRA device names) are the kernel's /dev "
                "names, which can change at a reboot or a replug: a claim allocated a device "
                "by name may then be given another one",
                fix="set id_property on its scanners.generic entry to a udev property that "
                "stays with the device (ID_PATH, ID_SERIAL)",
            )
        # The paths and the checkpoint before the API client is made: nothing to close on an
        # error. A checkpoint that cannot be read stops the daemon before anything serves: it
        # cannot tell which devices running pods hold.
        paths = PluginPaths.under(settings.kubelet_root, settings.driver)
        prepared = load_checkpoint(paths.plugin_dir / CHECKPOINT_FILE, settings.driver)
        if prepared:
            log.info("dra.checkpoint.loaded", claims=len(prepared))
        api = load_api_client(environ)
        return cls(
            settings,
            api=api,
            node_name=node,
            advertised=advertised,
            cdi=cdi,
            timing=timing,
            observe_calls=observe_calls,
            prepared=prepared,
        )

    @property
    def driver(self) -> str:
        return self.settings.driver

    @property
    def resources(self) -> frozenset[str]:
        return frozenset(self.settings.resources)

    def registered(self) -> bool:
        """Whether both sockets are in place and the kubelet accepted the registration last
        time it said (NotifyRegistrationStatus)."""
        said = self.plugin.registration.status.value
        return self.plugin.serving.value and said is not None and said.registered

    async def registration_changes(self) -> AsyncIterator[bool]:
        """:meth:`registered` now, then again each time it may have changed."""
        status, serving = self.plugin.registration.status, self.plugin.serving
        while True:
            yield self.registered()
            waits = {
                asyncio.ensure_future(status.wait_changed(status.version)),
                asyncio.ensure_future(serving.wait_changed(serving.version)),
            }
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
                await asyncio.gather(*waits, return_exceptions=True)

    def prepared(self) -> Mapping[str, PreparedClaim]:
        return self.preparer.prepared()

    @property
    def slices(self) -> PublishStats:
        return self.publisher.stats

    async def run(self) -> None:
        """Publish, register and serve until cancelled; then remove both sockets and close the
        API client."""
        log.info(
            "dra.front.started",
            driver=self.driver,
            resources=sorted(self.resources),
            registration_socket=str(self.paths.registration_socket),
        )
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.publisher.run(), name="dra-slices")
                group.create_task(self.plugin.run(), name="dra-plugin")
        finally:
            await self.api.aclose()
