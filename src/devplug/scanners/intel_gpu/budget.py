"""Keeping each resource's ListAndWatch message under the kubelet's 4 MiB receive limit.

A message past the limit fails the kubelet's stream and drops the resource's capacity to zero,
so it is never sent. At start-up a host whose GPUs would not fit is refused (the daemon exits
with a configuration error naming ``shared_dev_num`` and the value that fits). Later, GPUs that
arrive and would push a list over are held back with an error, while everything else in the
same scan (removals, health changes) still goes through: the advertised GPUs' sizes never grow
(health is counted at its longest), so holding back newcomers always suffices.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import structlog

from devplug.errors import ConfigError
from devplug.scanners.intel_gpu.entry import GpuEntry
from devplug.scanners.intel_gpu.policy import share_order
from devplug.scanners.intel_gpu.settings import max_shares_per_gpu
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES, WARN_FRACTION

log = structlog.get_logger("devplug.scanners.intel_gpu")

_SHOWN_ADDRESSES = 10


class ListTooLargeError(ConfigError):
    """A resource's ListAndWatch message would exceed the kubelet's receive limit."""


Totals = MutableMapping[str, tuple[int, int]]


class ListBudget:
    def __init__(self, field: str, shared_dev_num: int) -> None:
        self.field = f"{field}.shared_dev_num"
        self.shared_dev_num = shared_dev_num
        self._near_limit: set[str] = set()

    def _problem(self, resource: str, total: int, gpus: int) -> str:
        return (
            f"{resource}: {gpus} GPUs x {self.shared_dev_num} ids would make a {total:,}-byte "
            f"ListAndWatch message, over the kubelet's {KUBELET_MAX_RECEIVE_BYTES:,}-byte "
            f"limit; set shared_dev_num to at most {max_shares_per_gpu(gpus)}"
        )

    def refuse_if_over(self, totals: Mapping[str, tuple[int, int]], resources: set[str]) -> None:
        """Raise ListTooLargeError for the first of ``resources`` past the limit."""
        for resource in sorted(resources):
            total, gpus = totals.get(resource, (0, 0))
            if total > KUBELET_MAX_RECEIVE_BYTES:
                message = self._problem(resource, total, gpus)
                log.error("intel_gpu.list_too_large", field=self.field, reason=message)
                raise ListTooLargeError(self.field, message)

    def hold_back(
        self,
        entries: MutableMapping[str, GpuEntry],
        before: Mapping[str, GpuEntry],
        totals: Totals,
        resources: set[str],
    ) -> list[str]:
        """Take newcomers (GPUs not in their resource ``before``) out of ``entries`` and
        ``totals`` until every one of ``resources`` fits; return the PCI paths held back."""
        held: list[str] = []
        for resource in sorted(resources):
            total, gpus = totals.get(resource, (0, 0))
            if total <= KUBELET_MAX_RECEIVE_BYTES:
                continue
            wanted = (total, gpus)
            newcomers = [
                path
                for path, entry in entries.items()
                if entry.resource == resource
                and ((old := before.get(path)) is None or old.resource != resource)
            ]
            # The last in address order wait: the GPUs advertised stay a stable prefix.
            newcomers.sort(key=lambda path: share_order(entries[path].ids[0]), reverse=True)
            waiting: list[str] = []
            for path in newcomers:
                if total <= KUBELET_MAX_RECEIVE_BYTES:
                    break
                total -= entries.pop(path).list_bytes
                gpus -= 1
                waiting.append(path)
            totals[resource] = (total, gpus)
            log.error(
                "intel_gpu.gpus_held_back",
                field=self.field,
                reason=self._problem(resource, *wanted),
                held_back=[p.rsplit("/", 1)[-1] for p in waiting[:_SHOWN_ADDRESSES]],
                count=len(waiting),
            )
            held.extend(waiting)
        return held

    def warn_if_near(self, totals: Mapping[str, tuple[int, int]]) -> None:
        """Warn once per resource when its list reaches WARN_FRACTION of the limit."""
        near = {
            resource
            for resource, (total, _) in totals.items()
            if total >= WARN_FRACTION * KUBELET_MAX_RECEIVE_BYTES
        }
        for resource in sorted(near - self._near_limit):
            log.warning(
                "intel_gpu.list_near_limit",
                resource=resource,
                bytes=totals[resource][0],
                limit=KUBELET_MAX_RECEIVE_BYTES,
                hint=f"lower {self.field}",
            )
        self._near_limit = near
