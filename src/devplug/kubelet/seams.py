"""What the kubelet front needs from the rest of the daemon, as protocols it owns.

The front is independent of CDI and of the metrics (an import-linter contract): the daemon's
composition hands it objects that fit these protocols (``devplug.cdi.allocate.CdiNames``,
``devplug.ops.metrics.Metrics``), and tests can hand it their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from devplug.model import ContainerAllocation, DeviceInfo, DeviceTree


class AdvertisedTree(Protocol):
    """One publication of the tree the front follows (the scan loop's ``Advertised``)."""

    @property
    def tree(self) -> DeviceTree: ...

    @property
    def owners(self) -> Mapping[str, object]:
        """resource -> the scanner whose hooks serve it."""
        ...


class ServingEvents(Protocol):
    """What the servers report as they go (counted by the metrics)."""

    def registered(self, resource: str, ok: bool) -> None: ...

    def kubelet_restarted(self, resource: str) -> None: ...

    def allocated(self, resource: str, result: str) -> None: ...

    def list_built(self, resource: str, size_bytes: int) -> None: ...


class NoServingEvents:
    """Reports go nowhere (no metrics wired)."""

    def registered(self, resource: str, ok: bool) -> None:
        pass

    def kubelet_restarted(self, resource: str) -> None:
        pass

    def allocated(self, resource: str, result: str) -> None:
        pass

    def list_built(self, resource: str, size_bytes: int) -> None:
        pass


class AnswerExtension(Protocol):
    """Adds to the default Allocate answers (the CDI names of the specs on disk)."""

    @property
    def generation(self) -> int:
        """Changes whenever an answer extended before may differ now (cached answers drop)."""
        ...

    def confirm(self, resource: str) -> None:
        """Called once per Allocate before ``extend``: check what it relies on still holds."""
        ...

    def extend(
        self,
        resource: str,
        ids: Sequence[str],
        answer: ContainerAllocation,
        devices: Mapping[str, DeviceInfo],
    ) -> ContainerAllocation: ...
