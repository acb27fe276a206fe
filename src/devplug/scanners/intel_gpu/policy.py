"""GetPreferredAllocation policies for shared GPUs: devplug's NUMA policy, set up Intel's way.

Intel's semantics, on ids in PCI address order, then share number, with the shares of one
GPU as a unit (:mod:`devplug.preferred` holds the mechanism):

- ``none``: spread: one share from each distinct GPU first, then fill in order;
- ``balanced``: repeatedly take a share from the GPU with the most free shares (ties: the
  first GPU in order);
- ``packed``: fill GPUs in order.

Unlike Intel's plugin, every policy takes the kubelet's ``must_include`` ids first (Intel
ignores them, so a restarted init container's devices could be dropped), counts the GPUs they
use as already used, and keeps the answer on one NUMA node when one can hold it: the must-include
devices' node if they have one, else the node the policy prefers (packed: the fullest node that
still fits; none and balanced: the node with the most free shares). Never raises: a request
that cannot be met gets the best partial answer, since an error fails the pod's admission.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from devplug.model import DeviceInfo
from devplug.preferred import PreferredPolicy, by_first_source
from devplug.scanners.intel_gpu.settings import AllocationPolicy


def share_order(device_id: str) -> tuple[str, int]:
    """Sort key for GPU ids: by PCI address, then by share number ("-2" before "-10").

    The kernel writes the domain as %04x (four digits or more) and the rest fixed-width, so
    with the domain padded to eight digits plain string order is bus order.
    """
    head, sep, tail = device_id.rpartition("-")
    share = int(tail) if sep and tail.isdigit() else -1
    if share < 0:
        head = device_id
    domain, colon, rest = head.partition(":")
    return (domain.rjust(8, "0") + colon + rest if colon else head), share


# Each policy as devplug's: the fill within a NUMA node, and which node when several fit.
# A share's GPU is its first source (the PCI function); ids the scanner does not advertise
# (any more) are left to the kubelet.
_GPU = PreferredPolicy(unit=by_first_source, key=share_order, keep_unknown=False)
POLICIES: Mapping[AllocationPolicy, PreferredPolicy] = {
    "none": replace(_GPU, fill="spread", nodes="roomiest"),
    "balanced": replace(_GPU, fill="balanced", nodes="roomiest"),
    "packed": replace(_GPU, fill="packed", nodes="tightest"),
}


def preferred_gpu_shares(
    policy: AllocationPolicy,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    devices: Mapping[str, DeviceInfo],
) -> list[str]:
    """The scanner's answer: ``policy`` over the advertised, healthy ``available`` shares."""
    return POLICIES[policy](available, must_include, size, devices)
