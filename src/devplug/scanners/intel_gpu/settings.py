"""The ``scanners.intel_gpu`` config section, validated with errors that name the fix.

``shared_dev_num`` multiplies every GPU's ids, so it is also checked against the kubelet's
4 MiB ListAndWatch limit: a value too big for even one GPU is refused here, and a host with
too many GPUs for it at the scanner's first scan (:func:`refuse_if_too_big`). Later changes of
the host are the daemon's list limit's to handle, as for every scanner.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import structlog
from pydantic import Field, field_validator

from devplug.config import SectionSettings
from devplug.errors import ConfigError
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES, most_shares, shared_ids_bytes

log = structlog.get_logger(__name__)

AllocationPolicy = Literal["none", "balanced", "packed"]
ByPath = Literal["single", "none", "all"]

_PCI_DEVICE_ID = re.compile(r"^0x[0-9a-f]{4}\Z")
# The longest id a share can have on a real host, with the longer health word and a NUMA node:
# what one share costs in the kubelet's ListAndWatch message at most.
_WORST_ADDRESS = "ffff:ff:1f.7"
_WORST_NUMA = (255,)


def share_bytes(shares: int) -> int:
    """Upper bound of one GPU's ListAndWatch bytes with ``shares`` ids."""
    return shared_ids_bytes(_WORST_ADDRESS, shares, _WORST_NUMA)


def max_shares_per_gpu(gpus: int = 1) -> int:
    """The largest ``shared_dev_num`` whose list surely fits the kubelet's limit with ``gpus``
    GPUs in one resource (0 if not even one id each does)."""
    return most_shares(gpus, _WORST_ADDRESS, _WORST_NUMA)


class ListTooLargeError(ConfigError):
    """A resource's ListAndWatch message would exceed the kubelet's receive limit."""


class ResourceSize(NamedTuple):
    """One resource's ListAndWatch bytes (every id counted as Unhealthy) and its GPUs."""

    bytes: int
    gpus: int


def refuse_if_too_big(field: str, shares: int, sizes: Mapping[str, ResourceSize]) -> None:
    """Raise ListTooLargeError, naming ``<field>.shared_dev_num`` and the largest value that
    fits, for the first resource (by name) whose list passes the kubelet's limit.

    The scanner's first scan calls this: a host that cannot be served with its config is
    refused at start-up (exit status 2) or at a reload (the running config stays), rather than
    served with GPUs held back from the first moment.
    """
    for resource, size in sorted(sizes.items()):
        if size.bytes > KUBELET_MAX_RECEIVE_BYTES:
            message = (
                f"{resource}: {size.gpus} GPUs x {shares} ids would make a {size.bytes:,}-byte "
                f"ListAndWatch message, over the kubelet's {KUBELET_MAX_RECEIVE_BYTES:,}-byte "
                f"limit; set shared_dev_num to at most {max_shares_per_gpu(size.gpus)}"
            )
            # devplug run prints the error on stderr only; this puts it in the log as well.
            log.error("intel_gpu.list_too_large", field=f"{field}.shared_dev_num", reason=message)
            raise ListTooLargeError(f"{field}.shared_dev_num", message)


class IntelGpuSettings(SectionSettings):
    """Intel GPU scanner settings; names and meanings follow Intel's GPU plugin flags.

    ``shared_dev_num``: ids per GPU (``-shared-dev-num``). ``allocation_policy``: how
    GetPreferredAllocation picks shares (``-allocation-policy``). ``bypath``: which
    /dev/dri/by-path links containers get (``-bypath``). ``allow_ids``/``deny_ids``: PCI device
    ids such as "0x56c0" (``-allow-ids``/``-deny-ids``). ``monitoring``: also advertise
    ``gpu.intel.com/monitoring`` (``-enable-monitoring``).
    """

    shared_dev_num: int = Field(default=1, ge=1)
    allocation_policy: AllocationPolicy = "none"
    bypath: ByPath = "single"
    allow_ids: tuple[str, ...] = ()
    deny_ids: tuple[str, ...] = ()
    monitoring: bool = False

    @field_validator("allow_ids", "deny_ids", mode="before")
    @classmethod
    def _device_ids(cls, value: Any) -> Any:
        if not isinstance(value, list | tuple):
            return value  # pydantic reports the type error
        out = []
        for item in value:
            text = str(item).strip().lower()
            if not _PCI_DEVICE_ID.match(text):
                raise ValueError(
                    f"PCI device ids are 0x followed by four hex digits, e.g. '0x56c0'; "
                    f"got {item!r} (quote them in YAML)"
                )
            out.append(text)
        return tuple(dict.fromkeys(out))

    def check_section(self, field: str) -> None:
        if self.allow_ids and self.deny_ids:
            raise ConfigError(
                f"{field}.deny_ids",
                "allow_ids and deny_ids are mutually exclusive; keep only one of them",
            )
        most = max_shares_per_gpu()
        if self.shared_dev_num > most:
            raise ConfigError(
                f"{field}.shared_dev_num",
                f"{self.shared_dev_num} ids for even one GPU would exceed the kubelet's "
                f"{KUBELET_MAX_RECEIVE_BYTES // (1024 * 1024)} MiB ListAndWatch limit; "
                f"use at most {most}",
            )

    def admits(self, device_id: str | None) -> bool:
        """Whether allow_ids/deny_ids let a GPU with this PCI device id through."""
        if self.allow_ids:
            return device_id in self.allow_ids
        return device_id not in self.deny_ids
