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


async def test_a_device_cordoned_while_the_pool_cannot_be_published_is_refused(
    node: Node,
) -> None:
    async with serving(node) as daemon:
        await node.wait_for_pool({IGPU_NAME}, "the pool")
        assert daemon.dra is not None
        claim: ClaimName = node.claim("train", IGPU_NAME)
        # The API server goes on answering reads of claims, but no longer the slices' list and
        # watch (a selector it refuses): the publisher cannot see its slices, so it publishes
        # nothing, and the pool as last published keeps the GPU.
        mirror = daemon.dra.publisher.mirror
        node.api.field_labels = frozenset()
        await mirror.changes.wait_for(lambda _: not mirror.synced, timeout=10)
        await devplug(node, "cordon", I915, IGPU, "--reason", "firmware update")
        await daemon.scan_loop.advertised.wait_for(
            lambda now: now is not None and not now.tree[I915][IGPU].healthy, timeout=10
        )
        pool = daemon.dra.publisher.pool()
        assert pool is not None and IGPU_NAME in pool.devices  # still published as it was
        answer = (await node.dra.prepare("gpu.intel.com", [claim]))[claim.uid]
        assert f"({I915} {IGPU}) is unhealthy" in answer.error
        assert "firmware update" in answer.error
        assert daemon.dra.prepared() == {}
