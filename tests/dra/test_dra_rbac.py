"""The DRA overlay's ClusterRole (deploy/kubernetes/dra/rbac.yaml) against what the DRA front
really asks of the API server: the slice publisher through a first publish, a change and a
shrink (create, update, delete), and Prepare reading a claim, over the lightkube client and
the stand-in API server, which logs each request's Kubernetes verb and resource. Every
request must be one the role grants (the role works), and every grant must be used (it is
the narrowest that does)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import yaml
from dra_plugin_env import DRIVER, IDS, NAMES, NODE, RESOURCE, plugin_env

from devplug._kits.values import LatestValue
from devplug.dra.publisher import PublishTiming, SlicePublisher
from devplug.model import DeviceInfo, DeviceTree

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "dra" / "rbac.yaml"
# The API group of each resource the stand-in serves (its log names resources by plural).
GROUPS = {"resourceslices": "resource.k8s.io", "resourceclaims": "resource.k8s.io", "nodes": ""}
FAST = PublishTiming(settle_s=0.05, retry_initial_s=0.05, retry_max_s=0.4)


def granted() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every grant of the overlay's ClusterRole."""
    (role,) = [d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "ClusterRole"]
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def gpus(count: int) -> DeviceTree:
    """``count`` devices of the resource: past 128, the pool takes two slices."""
    return DeviceTree(
        {
            RESOURCE: {
                f"0000:{1 + n // 256:02x}:{n % 256 // 8:02x}.{n % 8}": DeviceInfo()
                for n in range(count)
            }
        }
    )


def pool(api: Any) -> list[tuple[int, int]]:
    """(generation, devices) of each of the pool's slices."""
    slices = api.slices(f"spec.driver={DRIVER},spec.nodeName={NODE}").values()
    return sorted((s["spec"]["pool"]["generation"], len(s["spec"]["devices"])) for s in slices)


async def test_the_dra_role_grants_exactly_what_the_dra_front_asks_for(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        env.api.put_node(NODE)  # the slices' owner
        trees: LatestValue[DeviceTree | None] = LatestValue(gpus(200))
        publisher = SlicePublisher(
            env.client, trees, node_name=NODE, driver=DRIVER, resources={RESOURCE}, timing=FAST
        )
        task = asyncio.create_task(publisher.run(), name="publisher-under-test")
        try:
            await env.api.wait_for(lambda api: pool(api) == [(1, 72), (1, 128)], what="2 slices")
            trees.set(gpus(3))  # one slice updated, the other deleted
            await env.api.wait_for(lambda api: pool(api) == [(2, 3)], what="the pool shrunk")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[0]])
        answer = (await env.kubelet.prepare(DRIVER, [claim]))[claim.uid]
        assert answer.error == "" and answer.devices[0].cdi_device_ids[0].endswith(IDS[0])

        asked = {(GROUPS[r.resource], r.resource, r.verb) for r in env.api.request_log}
        failed = [r for r in env.api.request_log if r.code >= 400]
        assert failed == [], failed
    grants = granted()
    assert asked - grants == set(), "requests the role does not grant (they would get 403)"
    assert grants - asked == set(), "grants nothing asks for (the role is wider than it needs)"
