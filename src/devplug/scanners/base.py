"""What a scanner is, and the optional hooks it may implement.

A scanner is a plain synchronous object: ``scan(source)`` reads devices through a
:class:`~devplug.scanners.udev.UdevSource` and returns a :class:`~devplug.model.DeviceTree`.
The daemon runs it in a worker thread, so it may block on sysfs reads but must not touch the
event loop. Hooks mirror Intel's device plugin framework; each is a separate Protocol so a
scanner implements only what it needs, and the server discovers them with ``isinstance``.
Hook methods run on the event loop and may be plain functions or coroutines: a plain function
must be quick (no file or device I/O), since every RPC of the daemon waits while it runs; do
slow work in a coroutine with ``asyncio.to_thread``. The lifecycle hooks
(:class:`ResourceStarter`, :class:`ResourceStopper`) are the exception: they exist to do slow
work, so a plain function there runs in a worker thread. Scanners should let
:class:`~devplug.errors.ScanCancelled` (raised by the source when the daemon stops) propagate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from devplug.model import ContainerAllocation, DeviceInfo, DeviceTree

if TYPE_CHECKING:
    from devplug.scanners.udev import UdevEvent, UdevSource


@runtime_checkable
class Scanner(Protocol):
    """Turns what udev shows into a DeviceTree."""

    name: str

    def scan(self, source: UdevSource) -> DeviceTree: ...


@runtime_checkable
class IncrementalScanner(Protocol):
    """A scanner that can update its previous tree from udev events instead of a full scan.

    A full scan of a big host takes hundreds of milliseconds; an event names the few devices
    that changed. ``subsystems`` are the subsystems whose events may change the scanner's
    devices (None: any), used to filter the event socket. ``rescan`` gets the scanner's
    previous tree and a batch of events, re-reads the devices they name from sysfs (an
    ``add`` or ``change`` says where to look; sysfs says what is there), and returns the whole
    new tree, or None to ask for a full scan. Scanners without this protocol are fully
    rescanned on every batch of events.

    A ``remove`` event is believed, not re-read: the kernel sends it before it deletes the
    device's sysfs dir, so a re-read may still find the device. Whatever a scanner returns,
    the scan runner leaves out every device whose ``sources`` all lie at or below a removed
    path; a scanner whose devices are built from several sources, of which a removal may take
    only some (a GPU's drm minors), asks :class:`~devplug.scanners.incremental.RemovedPaths`
    which are gone.
    """

    name: str

    @property
    def subsystems(self) -> frozenset[str] | None: ...

    def scan(self, source: UdevSource) -> DeviceTree: ...

    def rescan(
        self, source: UdevSource, previous: DeviceTree, events: Sequence[UdevEvent]
    ) -> DeviceTree | None: ...


@runtime_checkable
class Reporter(Protocol):
    """A scanner with more to say than what it advertises (devices it found but cannot
    serve, and why). ``report()`` describes its last scan as JSON-ready sections that
    ``devplug scan`` prints beside ``"resources"``."""

    def report(self) -> Mapping[str, object]: ...


@runtime_checkable
class ResourceNamer(Protocol):
    """A scanner that can tell from its config alone which resources it may advertise.

    ``makes_resource(resource)`` is True when some device could put ``resource`` in the
    scanner's tree, whatever the host has now. devplug asks it at start to refuse a
    ``dra.resources`` entry that no configured scanner makes: a scan cannot decide that (a
    GPU may be plugged in an hour later), and a misspelt name would otherwise serve nothing
    for good. A scanner without it may make any resource, as far as devplug can tell.
    """

    def makes_resource(self, resource: str) -> bool: ...


@runtime_checkable
class Allocator(Protocol):
    """Replaces the default Allocate answer.

    Return one ContainerAllocation per entry of ``requests`` (each a list of device ids, already
    checked to be advertised and healthy), or None to use the default answer. The answer is
    sent as it is: CDI names are added to default answers only (set ``cdi_devices`` yourself,
    ``<kind>=<device id>``, to name devices of the resource's spec).
    """

    def allocate(
        self,
        resource: str,
        requests: Sequence[Sequence[str]],
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[ContainerAllocation] | Awaitable[Sequence[ContainerAllocation] | None] | None: ...


@runtime_checkable
class PostAllocator(Protocol):
    """Adjusts the answer (default or an Allocator's) before it is sent."""

    def post_allocate(
        self,
        resource: str,
        requests: Sequence[Sequence[str]],
        answers: Sequence[ContainerAllocation],
    ) -> Sequence[ContainerAllocation] | Awaitable[Sequence[ContainerAllocation]]: ...


@runtime_checkable
class PreferredAllocator(Protocol):
    """Replaces the default GetPreferredAllocation policy for one container.

    ``available`` and ``must_include`` come from the kubelet. Return the preferred ids; the
    server makes sure ``must_include`` is honoured and the answer stays within ``available``.
    A request offering more than 2,000 ids in all its containers together is answered off the
    event loop: a plain function is then called in a worker thread (one request at a time per
    resource), so it may compute over thousands of ids but must not touch the loop.
    """

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[str] | Awaitable[Sequence[str]]: ...


@runtime_checkable
class ContainerPreStarter(Protocol):
    """Runs before each container that got devices starts (PreStartContainer).

    Implementing it makes the server ask the kubelet to call PreStartContainer. Raise
    :class:`~devplug.errors.AllocationError` to refuse the start.
    """

    def pre_start_container(
        self, resource: str, device_ids: Sequence[str]
    ) -> Awaitable[None] | None: ...


@runtime_checkable
class ResourceStarter(Protocol):
    """Prepares a resource before the kubelet learns of it (bind drivers, create VFs, load
    firmware): KubeVirt's device plugin manager's ``Start``.

    ``start(resource)`` is awaited when the resource first appears in the scanner's tree,
    before its first Register; the server does not even listen until it returns. A kubelet
    restart does not call it again (the resource stays prepared and simply re-registers); a
    resource that was stopped (it left the tree, or the daemon restarted) is started again.
    An exception, or a run past the daemon's hook timeout (60 s by default), keeps the resource
    unregistered: the failure is logged with its reason and ``start`` is called again with
    back-off (1 s doubling to 60 s) until it returns; the daemon and its other resources go on.
    Make it idempotent: a retry may follow a half-done attempt. A ``CancelledError`` it raises
    while the daemon did not cancel it counts as a failure too.

    A coroutine function runs on the event loop and is cancelled at the timeout; a plain
    function runs in a worker thread, which a timeout cannot stop: a retry then waits for it.
    """

    def start(self, resource: str) -> Awaitable[None] | None: ...


@runtime_checkable
class ResourceStopper(Protocol):
    """Tears a resource down after the kubelet let go of it: KubeVirt DPM's ``Stop``.

    ``stop(resource)`` runs once the resource's last (empty) list was sent and its server
    stopped, when the resource leaves the scanner's tree, and for every served resource when
    the daemon shuts down (after its servers stopped). It runs only for resources whose
    ``start`` returned (or that have no ``start``), on the scanner whose ``start`` ran. An
    exception or a timeout is logged; nothing retries it. Threads and timeouts as for
    :class:`ResourceStarter`, except at shutdown: the whole stop fits the daemon's
    ``stop_timeout_s``, and a stop hook gets what is left of it when that is less; a thread
    still running when it is spent is left behind as the process exits.
    """

    def stop(self, resource: str) -> Awaitable[None] | None: ...
