"""A cordoned device leaves the DRA pool, and a claim allocated it before is refused at
Prepare; uncordoned, it comes back. The node (API server and kubelet DRA stand-ins, a mock
i915 GPU served through DRA) is test_dra_daemon's."""

from __future__ import annotations

from helpers import run_devplug
from test_dra_daemon import I915, IGPU, IGPU_NAME, Node, node, serving

from devplug.testing.kubelet_dra import ClaimName

__all__ = ["node"]  # the fixture, used by name


async def devplug(node: Node, *args: str) -> str:
    code, out, err = await run_devplug(*args, "--kubelet-dir", str(node.kubelet_dir))
    assert code == 0, err
    return out


async def test_a_cordoned_device_leaves_the_pool_and_comes_back_uncordoned(node: Node) -> None:
    async with serving(node):
        await node.wait_for_pool({IGPU_NAME}, "the pool")
        claim: ClaimName = node.claim("train", IGPU_NAME)  # allocated before the cordon
        await devplug(node, "cordon", I915, IGPU, "--reason", "firmware update")
        await node.wait_for_pool(set(), "the cordoned GPU out of the pool")
        answer = (await node.dra.prepare("gpu.intel.com", [claim]))[claim.uid]
        assert "became unhealthy" in answer.error

        await devplug(node, "uncordon", I915, IGPU)  # the node's hold-down is 0
        await node.wait_for_pool({IGPU_NAME}, "the uncordoned GPU back in the pool")
