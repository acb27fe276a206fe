"""devplug.dra.service and devplug.dra.claims: NodePrepareResources/NodeUnprepareResources as
the kubelet calls them (the kubelet DRA stand-in over real unix sockets), with claims read
from the stand-in API server, the pool from the slice builder and the CDI catalog of specs
rendered on disk."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from dra_plugin_env import DRIVER, IDS, KIND, NAMES, NODE, RESOURCE, plugin_env

from devplug._proto import dra_v1_pb2, dra_v1beta1_pb2
from devplug.cdi.allocate import CdiOptions, with_cdi
from devplug.dra.checkpoint import CheckpointError, load_checkpoint
from devplug.dra.slices import build_pool
from devplug.model import ContainerAllocation, Health
from devplug.testing import eventually
from devplug.testing.kubelet_dra import V1, V1BETA1, ClaimAnswer, ClaimName, method_path
from devplug.testing.simulator import SimulatorRpcError

FOREIGN = "other.example.com"


def ok(answer: ClaimAnswer) -> ClaimAnswer:
    assert answer.error == "", answer.error
    return answer


@pytest.mark.parametrize("version", [V1, V1BETA1])
async def test_prepare_answers_with_the_pool_device_and_the_allocate_cdi_ids(
    short_dir: Path, version: str
) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[0]])
        got = await env.kubelet.prepare(DRIVER, [claim], version=version)
        (device,) = ok(got[claim.uid]).devices
        assert device.request_names == ("gpus",)
        assert (device.pool_name, device.device_name) == (NODE, NAMES[0])
        assert device.cdi_device_ids == (f"{KIND}={IDS[0]}",)
        # ... exactly what the device-plugin front's Allocate names for the same device.
        options = CdiOptions(env.catalog, annotations=False, device_specs=False)
        allocate = with_cdi(RESOURCE, [IDS[0]], ContainerAllocation(), options, env.tree[RESOURCE])
        assert device.cdi_device_ids == allocate.cdi_devices
        assert device.share_id is None


async def test_prepare_is_recorded_in_a_0600_checkpoint_before_it_answers(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[1]])
        ok((await env.kubelet.prepare(DRIVER, [claim]))[claim.uid])
        assert stat.S_IMODE(os.lstat(env.checkpoint_path).st_mode) == 0o600
        saved = json.loads(env.checkpoint_path.read_text())
        assert (saved["version"], saved["driver"]) == (1, DRIVER)
        (device,) = saved["claims"][claim.uid]["devices"]
        assert (device["resource"], device["device_id"]) == (RESOURCE, IDS[1])
        assert not [n for n in os.listdir(env.paths.plugin_dir) if n.startswith(".")]


async def test_subrequest_names_are_cut_to_the_request_and_share_ids_kept_in_v1(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        result = {
            "request": "gpus/fast",
            "driver": DRIVER,
            "pool": NODE,
            "device": NAMES[2],
            "shareID": "4bd1c1b5-a7fb-4d8a-8a57-1f5e0e1a7c3e",
        }
        claim = env.put_claim("c1", [], extra_results=[result])
        (v1_device,) = ok((await env.kubelet.prepare(DRIVER, [claim]))[claim.uid]).devices
        assert v1_device.request_names == ("gpus",)
        assert v1_device.share_id == result["shareID"]
        beta = await env.kubelet.prepare(DRIVER, [claim], version=V1BETA1)
        (beta_device,) = ok(beta[claim.uid]).devices
        assert beta_device.request_names == ("gpus",) and beta_device.share_id is None


async def test_a_prepared_claim_gets_its_stored_answer_without_reading_it_again(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[0], NAMES[1]])
        first = await env.kubelet.prepare(DRIVER, [claim])
        ok(first[claim.uid])
        reads = env.api.requests.copy()
        # The claim at the API server now says something else: a read would refuse it.
        env.put_claim("c1", [NAMES[2]], uid="some-other-uid")
        again = await env.kubelet.prepare(DRIVER, [claim])
        assert again == first
        assert env.api.requests == reads


async def test_foreign_drivers_results_are_left_to_their_driver(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        foreign = {"request": "nic", "driver": FOREIGN, "pool": "elsewhere", "device": "nic-0"}
        mixed = env.put_claim("mixed", [NAMES[0]], extra_results=[foreign])
        only_foreign = env.put_claim("foreign", [], extra_results=[foreign])
        got = await env.kubelet.prepare(DRIVER, [mixed, only_foreign])
        assert [d.device_name for d in ok(got[mixed.uid]).devices] == [NAMES[0]]
        assert ok(got[only_foreign.uid]).devices == ()


async def test_each_bad_claim_gets_its_own_error_and_the_good_one_is_prepared(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        good = env.put_claim("good", [NAMES[0]])
        unallocated_stored = env.api.put_claim(
            {
                "metadata": {"name": "unallocated", "namespace": "team-a"},
                "spec": {"devices": {"requests": []}},
            }
        )
        unallocated = ClaimName.of(unallocated_stored)
        stored = env.put_claim("replaced", [NAMES[1]])
        replaced = ClaimName(stored.namespace, "uid-of-the-deleted-claim", stored.name)
        not_in_pool = env.put_claim("gone", ["0000-09-00-0"])
        other_pool = env.put_claim(
            "other-pool",
            [],
            extra_results=[{"request": "r", "driver": DRIVER, "pool": "node2", "device": NAMES[2]}],
        )
        missing = ClaimName("team-a", "uid-of-a-missing-claim", "nowhere")
        claims = [good, unallocated, replaced, not_in_pool, other_pool, missing]
        got = await env.kubelet.prepare(DRIVER, claims)
        assert [d.device_name for d in ok(got[good.uid]).devices] == [NAMES[0]]
        errors = {claim.name: got[claim.uid].error for claim in claims[1:]}
        assert "is not allocated" in errors["unallocated"]
        assert "has uid" in errors["replaced"] and "re-created" in errors["replaced"]
        assert "'0000-09-00-0' is not in this node's pool" in errors["gone"]
        assert "names pool 'node2', not this node's pool 'node1'" in errors["other-pool"]
        assert "cannot read ResourceClaim team-a/nowhere" in errors["nowhere"]
        assert "404" in errors["nowhere"]
        assert all(not got[claim.uid].devices for claim in claims[1:])
        saved = load_checkpoint(env.checkpoint_path, DRIVER)
        assert set(saved) == {good.uid}


async def test_a_device_whose_cdi_spec_is_missing_is_refused(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        spec = next(env.cdi_dir.iterdir())
        spec.unlink()  # deleted behind devplug's back: the catalog's confirm notices
        claim = env.put_claim("c1", [NAMES[0]])
        got = await env.kubelet.prepare(DRIVER, [claim])
        assert "the CDI spec of devplug.example.com/gpu on disk does not define" in (
            got[claim.uid].error
        )
        assert not env.checkpoint_path.exists()


async def test_a_device_left_out_of_the_pool_since_allocation_is_refused(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[0]])
        smaller = {RESOURCE: {i: info for i, info in env.tree[RESOURCE].items() if i != IDS[0]}}
        env.pool = build_pool(smaller, node_name=NODE, driver=DRIVER, generation=2)
        got = await env.kubelet.prepare(DRIVER, [claim])
        assert "not in this node's pool (generation 2)" in got[claim.uid].error


async def test_a_device_unhealthy_now_is_refused_while_the_published_pool_still_has_it(
    short_dir: Path,
) -> None:
    # The pool as last published lags behind the node (the API server away, a write being
    # retried): the device failed since, and must not be handed out on the old pool's word.
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claim, other = env.put_claim("c1", [NAMES[0]]), env.put_claim("c2", [NAMES[1]])
        failed = replace(
            env.tree[RESOURCE][IDS[0]],
            health=Health.UNHEALTHY,
            health_reason="cordoned: firmware update",
        )
        env.tree[RESOURCE][IDS[0]] = failed
        assert env.pool is not None and NAMES[0] in env.pool.devices  # not published yet
        got = await env.kubelet.prepare(DRIVER, [claim, other])
        error = got[claim.uid].error
        assert f"device {NAMES[0]!r} ({RESOURCE} {IDS[0]}) is unhealthy" in error
        assert "cordoned: firmware update" in error
        ok(got[other.uid])  # the rest of the batch is prepared
        del env.tree[RESOURCE][IDS[2]]  # removed, the pool not published since either
        third = env.put_claim("c3", [NAMES[2]])
        gone = (await env.kubelet.prepare(DRIVER, [third]))[third.uid]
        assert "is no longer advertised" in gone.error


async def test_one_device_is_prepared_for_one_claim_at_a_time(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        first = env.put_claim("first", [NAMES[0]])
        second = env.put_claim("second", [NAMES[0]])
        same_batch = env.put_claim("third", [NAMES[0]])
        ok((await env.kubelet.prepare(DRIVER, [first]))[first.uid])
        got = await env.kubelet.prepare(DRIVER, [second])
        assert "already prepared for ResourceClaim team-a/first" in got[second.uid].error
        assert got[second.uid].devices == ()

        await env.kubelet.unprepare(DRIVER, [first])
        both = await env.kubelet.prepare(DRIVER, [second, same_batch])
        ok(both[second.uid])
        assert "already prepared for ResourceClaim team-a/second" in both[same_batch.uid].error


async def test_two_batches_at_once_never_hand_out_one_device_twice(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claims = [env.put_claim(f"c{i}", [NAMES[0]]) for i in range(4)]
        gate = asyncio.Event()
        env.held.update({claim.name: gate for claim in claims})
        calls = [asyncio.create_task(env.kubelet.prepare(DRIVER, [claim])) for claim in claims]
        await eventually(lambda: len(env.reads) == len(claims), timeout=10)
        gate.set()  # every batch has its claim at once and races for the device
        answers = [(await call)[claim.uid] for call, claim in zip(calls, claims, strict=True)]
        assert sum(not answer.error for answer in answers) == 1
        assert len(load_checkpoint(env.checkpoint_path, DRIVER)) == 1


async def test_admin_access_may_share_a_prepared_device(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        user = env.put_claim("user", [NAMES[0]])
        admin = env.put_claim("admin", [NAMES[0]], admin_access=True)
        ok((await env.kubelet.prepare(DRIVER, [user]))[user.uid])
        ok((await env.kubelet.prepare(DRIVER, [admin]))[admin.uid])
        later = env.put_claim("later", [NAMES[0]])
        got = await env.kubelet.prepare(DRIVER, [later])
        assert "already prepared for ResourceClaim team-a/user" in got[later.uid].error


async def test_unprepare_drops_the_claim_and_an_unknown_uid_is_fine(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[0]])
        ok((await env.kubelet.prepare(DRIVER, [claim]))[claim.uid])
        unknown = ClaimName("team-a", "never-prepared", "c9")
        assert await env.kubelet.unprepare(DRIVER, [claim, unknown]) == {
            claim.uid: "",
            unknown.uid: "",
        }
        assert load_checkpoint(env.checkpoint_path, DRIVER) == {}
        assert await env.kubelet.unprepare(DRIVER, [claim], version=V1BETA1) == {claim.uid: ""}


async def test_a_daemon_restart_between_prepare_and_unprepare_keeps_the_claim(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        before = await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[0]])
        rival = env.put_claim("rival", [NAMES[0]])
        prepared = await env.kubelet.prepare(DRIVER, [claim])
        ok(prepared[claim.uid])

        await env.stop_plugin()
        await env.start_plugin()  # a new preparer: all it knows comes from the checkpoint
        await env.kubelet.wait_for_plugin(DRIVER, replacing=before)

        refused = await env.kubelet.prepare(DRIVER, [rival])
        assert "already prepared for ResourceClaim team-a/c1" in refused[rival.uid].error
        assert await env.kubelet.prepare(DRIVER, [claim]) == prepared
        assert await env.kubelet.unprepare(DRIVER, [claim]) == {claim.uid: ""}
        ok((await env.kubelet.prepare(DRIVER, [rival]))[rival.uid])


async def test_a_kubelet_restart_re_registers_and_re_prepares_with_the_same_answers(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claims = [env.put_claim(f"c{i}", [name]) for i, name in enumerate(NAMES)]
        first = await env.kubelet.prepare(DRIVER, claims)
        assert all(ok(answer) for answer in first.values())
        await env.kubelet.restart()
        await env.kubelet.wait_for_plugin(DRIVER, generation=1)
        assert await env.kubelet.prepare(DRIVER, claims) == first


async def test_a_checkpoint_that_cannot_be_written_fails_the_call_or_the_new_claims(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        stored = env.put_claim("stored", [NAMES[0]])
        ok((await env.kubelet.prepare(DRIVER, [stored]))[stored.uid])
        env.checkpoint_path.unlink()
        env.checkpoint_path.mkdir()  # the rename over it fails: nothing can be recorded
        new = env.put_claim("new", [NAMES[1]])
        with pytest.raises(SimulatorRpcError) as caught:
            await env.kubelet.prepare(DRIVER, [new])
        assert caught.value.code == "UNAVAILABLE"
        assert "cannot record the prepared claim" in caught.value.details

        mixed = await env.kubelet.prepare(DRIVER, [stored, new])
        ok(mixed[stored.uid])
        assert "cannot record the prepared claim" in mixed[new.uid].error
        env.checkpoint_path.rmdir()
        ok((await env.kubelet.prepare(DRIVER, [new]))[new.uid])


async def test_a_slow_claim_read_holds_up_no_other_call(short_dir: Path) -> None:
    """Claims are read before the lock is taken: while one batch waits for the API server,
    another Prepare and an Unprepare go through."""
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        done = env.put_claim("done", [NAMES[0]])
        ok((await env.kubelet.prepare(DRIVER, [done]))[done.uid])
        slow = env.put_claim("slow", [NAMES[1]])
        quick = env.put_claim("quick", [NAMES[2]])
        env.held["slow"] = asyncio.Event()
        waiting = asyncio.create_task(env.kubelet.prepare(DRIVER, [slow]))
        try:
            await eventually(lambda: "slow" in env.reads, timeout=10)
            async with asyncio.timeout(10):  # reading under the lock would never get here
                assert await env.kubelet.unprepare(DRIVER, [done]) == {done.uid: ""}
                ok((await env.kubelet.prepare(DRIVER, [quick]))[quick.uid])
        finally:
            env.held["slow"].set()
            answer = await waiting
        ok(answer[slow.uid])


async def test_the_api_server_down_fails_only_claims_that_need_a_read(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        stored = env.put_claim("stored", [NAMES[0]])
        new = env.put_claim("new", [NAMES[1]])
        ok((await env.kubelet.prepare(DRIVER, [stored]))[stored.uid])
        async with env.api.down():
            got = await env.kubelet.prepare(DRIVER, [stored, new])
        ok(got[stored.uid])
        assert "cannot read ResourceClaim team-a/new from the API server" in got[new.uid].error


async def test_raw_calls_on_the_kubelets_method_paths(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        claim = env.put_claim("c1", [NAMES[0]])
        async with grpc.aio.insecure_channel(f"unix://{env.paths.dra_socket}") as channel:
            for pb, path in (
                (dra_v1_pb2, "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"),
                (
                    dra_v1beta1_pb2,
                    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
                ),
            ):
                call = channel.unary_unary(
                    path,
                    request_serializer=pb.NodePrepareResourcesRequest.SerializeToString,
                    response_deserializer=pb.NodePrepareResourcesResponse.FromString,
                )
                request = pb.NodePrepareResourcesRequest(
                    claims=[pb.Claim(namespace=claim.namespace, uid=claim.uid, name=claim.name)]
                )
                answer = await call(request, timeout=10)
                assert [d.device_name for d in answer.claims[claim.uid].devices] == [NAMES[0]]
            assert method_path(V1, "NodeUnprepareResources") == (
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
            )
            wrong = channel.unary_unary(
                "/v1.DRAPlugin/NodePrepareResources",
                request_serializer=dra_v1_pb2.NodePrepareResourcesRequest.SerializeToString,
                response_deserializer=dra_v1_pb2.NodePrepareResourcesResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await wrong(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_claim_without_its_names_is_answered_with_an_error(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        got = await env.kubelet.prepare(DRIVER, [ClaimName("", "uid-1", "c1")])
        assert got["uid-1"].error == "claim /c1: namespace missing"


def test_a_checkpoint_names_its_problem_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"not a JSON object; move the file aside"):
        load_checkpoint(path, DRIVER)
    path.write_text(json.dumps({"version": 1, "driver": "other.example.com", "claims": {}}))
    with pytest.raises(CheckpointError, match=r"driver: 'other.example.com', not this daemon's"):
        load_checkpoint(path, DRIVER)
    device = {
        "request_names": ["gpus"],
        "pool_name": 3,
        "device_name": "gpu-0",
        "cdi_device_ids": [],
        "share_id": None,
        "resource": RESOURCE,
        "device_id": "0",
        "admin_access": False,
    }
    bad_device = {"namespace": "a", "name": "b", "devices": [device]}
    path.write_text(json.dumps({"version": 1, "driver": DRIVER, "claims": {"u": bad_device}}))
    with pytest.raises(CheckpointError, match=r"claims\.u\.devices\.0\.pool_name"):
        load_checkpoint(path, DRIVER)
    assert load_checkpoint(tmp_path / "absent.json", DRIVER) == {}
