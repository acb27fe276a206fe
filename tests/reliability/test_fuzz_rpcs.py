"""Fuzzing every DevicePlugin RPC of a running daemon with arbitrary requests (hypothesis).

One real daemon serves six resources through three scanners: a plain StaticScanner (no hooks:
PreStartContainer is not offered, but is called anyway), a scanner whose Allocator,
PreferredAllocator and ContainerPreStarter hooks misbehave on purpose (junk, short, str and
failing answers, refusals), and a scanner whose GetPreferredAllocation is Intel's GPU policy
(none, balanced, packed, and the monitoring resource). The kubelet simulator connects to each.

Each hypothesis example is one to four RPCs sent at once: unknown, duplicate, empty and huge id
lists; ids with NUL, "/", "..", non-ASCII, and up to hundreds of kilobytes long; absurd
allocation sizes (int32: 0, negative, 2**31 - 1); must_include ids outside available; hundreds
of containers in one request; unknown protobuf fields appended to the request. Every answer must
come within a deadline with a proper status: OK, or NOT_FOUND / INVALID_ARGUMENT naming an
offending id, never INTERNAL or UNKNOWN; successful answers must be right (Allocate: only for
advertised healthy ids; GetPreferredAllocation: must_include first, within available and
must_include, filled as far as the healthy ids allow). Afterwards the daemon must serve
normally: same registrations, a normal Allocate and a fresh ListAndWatch list work.

Hypothesis runs in a worker thread (``asyncio.to_thread``) and hands each example's RPCs to the
test's event loop, where the daemon and the simulator live, with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import grpc
import pytest
import structlog
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.daemon import Daemon
from devplug.errors import AllocationError
from devplug.kubelet.servicer import MAX_STREAMS
from devplug.model import ContainerAllocation, DeviceInfo, DeviceNode, DeviceTree, Health
from devplug.scanners.base import Scanner
from devplug.scanners.intel_gpu import (
    MONITORING_ID,
    MONITORING_RESOURCE,
    IntelGpuScanner,
    IntelGpuSettings,
)
from devplug.scanners.udev import UdevSource
from devplug.testing import StaticScanner, daemon_settings
from devplug.testing.harness import in_process_daemon
from devplug.testing.simulator import KubeletSimulator, PluginSession

T = TypeVar("T")

# The long run takes minutes: lift pytest-timeout's 120 s (the same switch as conftest's scaled).
LONG_RUN = os.environ.get("DEVPLUG_RELIABILITY_LONG", "") not in ("", "0")
TEST_TIMEOUT_S = 3600 if LONG_RUN else 120

# A hang is a failure: every RPC has a deadline, every example a (longer) one.
CALL_TIMEOUT_S = 20.0
CASE_TIMEOUT_S = 60.0
# gRPC's default limit on a received message; a bigger request is refused by gRPC itself.
GRPC_MAX_MESSAGE = 4 * 1024 * 1024
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

PLAIN = "example.com/plain"
HOOKED = "example.com/hooked"
I915 = "gpu.intel.com/i915"  # Intel policy "none"
XE = "gpu.intel.com/xe"  # Intel policy "balanced"
PACKED = "example.com/gpu-packed"  # Intel policy "packed"
MONITORING = MONITORING_RESOURCE

Rpc = Literal["options", "list", "preferred", "allocate", "prestart"]
RPCS: tuple[Rpc, ...] = ("options", "list", "preferred", "allocate", "prestart")
METHODS: dict[Rpc, tuple[str, str, type[Message]]] = {
    "options": ("GetDevicePluginOptions", "unary", pb.DevicePluginOptions),
    "list": ("ListAndWatch", "stream", pb.ListAndWatchResponse),
    "preferred": ("GetPreferredAllocation", "unary", pb.PreferredAllocationResponse),
    "allocate": ("Allocate", "unary", pb.AllocateResponse),
    "prestart": ("PreStartContainer", "unary", pb.PreStartContainerResponse),
}
REQUESTS: dict[Rpc, type[Message]] = {
    "options": pb.Empty,
    "list": pb.Empty,
    "preferred": pb.PreferredAllocationRequest,
    "allocate": pb.AllocateRequest,
    "prestart": pb.PreStartContainerRequest,
}


# ---------------------------------------------------------------------------- the devices


def serial_devices(prefix: str, healthy: int, unhealthy: int) -> dict[str, DeviceInfo]:
    devices = {}
    for i in range(healthy + unhealthy):
        devices[f"{prefix}{i}"] = DeviceInfo(
            health=Health.HEALTHY if i < healthy else Health.UNHEALTHY,
            health_reason="" if i < healthy else "cable pulled",
            nodes=(DeviceNode(f"/dev/tty{prefix.upper()}{i}"),),
            env={"SERIAL": f"{prefix}{i}"},
            numa_nodes=(i % 2,),
        )
    return devices


SHARES = 3


def gpu_devices(buses: Sequence[int], sick_bus: int) -> dict[str, DeviceInfo]:
    """``SHARES`` ids per GPU, ``<address>-<share>``, as the Intel scanner names them."""
    devices = {}
    for n, bus in enumerate(buses):
        address = f"0000:{bus:02x}:00.0"
        info = DeviceInfo(
            health=Health.UNHEALTHY if bus == sick_bus else Health.HEALTHY,
            health_reason=f"no driver is bound to {address} (was i915)" if bus == sick_bus else "",
            nodes=(DeviceNode(f"/dev/dri/card{bus}"), DeviceNode(f"/dev/dri/renderD{128 + n}")),
            numa_nodes=(0 if bus < 0x80 else 1,),
            sources=(f"/sys/devices/pci0000:{bus & 0x80:02x}/{address}",),
        )
        for share in range(SHARES):
            devices[f"{address}-{share}"] = info
    return devices


TREES: dict[str, dict[str, DeviceInfo]] = {
    PLAIN: serial_devices("dev", healthy=10, unhealthy=2),
    HOOKED: serial_devices("hk", healthy=6, unhealthy=1),
    I915: gpu_devices([0x03, 0x04, 0x83, 0x84], sick_bus=0x84),
    XE: gpu_devices([0x05, 0x06, 0x07, 0x85], sick_bus=0x06),
    PACKED: gpu_devices([0x08, 0x09, 0x88, 0x89], sick_bus=0x88),
    MONITORING: {
        MONITORING_ID: DeviceInfo(
            nodes=(DeviceNode("/dev/dri/card3"), DeviceNode("/dev/dri/card5"))
        )
    },
}
RESOURCES = tuple(TREES)
HEALTHY = {r: sorted(i for i, info in TREES[r].items() if info.healthy) for r in RESOURCES}
UNHEALTHY = {r: sorted(i for i, info in TREES[r].items() if not info.healthy) for r in RESOURCES}
FOREIGN = {
    r: sorted({i for o in RESOURCES if o != r for i in TREES[o]} - set(TREES[r])) for r in RESOURCES
}
# The hooked scanner refuses to pre-start containers with this device.
REFUSING_ID = "hk3"


# ---------------------------------------------------------------------------- the scanners


class HookedScanner(StaticScanner):
    """Hooks that misbehave in every way the servicer must absorb (never with INTERNAL)."""

    name = "hooked"

    def __init__(self) -> None:
        super().__init__({HOOKED: TREES[HOOKED]})
        self.prestarts = 0

    def allocate(
        self, resource: str, requests: Sequence[Sequence[str]], devices: Mapping[str, DeviceInfo]
    ) -> Sequence[ContainerAllocation] | None:
        if len(requests) == 1:
            return None  # the default answer
        return [ContainerAllocation(env={"IDS": ",".join(ids)}) for ids in requests]

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[str] | Awaitable[Sequence[str]]:
        mode = size % 5
        if mode == 0:  # junk: not offered, duplicates, unhealthy, reversed
            return ["not-offered", *reversed(available), *must_include, *UNHEALTHY[HOOKED]]
        if mode == 1:  # short: the default policy tops it up
            return list(available)[: max(size, 0) // 2]
        if mode == 2:
            raise RuntimeError("the hook has a bug")
        if mode == 3:
            return self._later(available)
        return ",".join(available)  # a str, not a list of ids

    async def _later(self, available: Sequence[str]) -> Sequence[str]:
        await asyncio.sleep(0)
        return sorted(available)

    async def pre_start_container(self, resource: str, device_ids: Sequence[str]) -> None:
        await asyncio.sleep(0)
        if REFUSING_ID in device_ids:
            raise AllocationError("invalid", f"{resource}: {REFUSING_ID} failed its reset")
        self.prestarts += 1


class GpuPolicyScanner:
    """Fixed GPU devices; GetPreferredAllocation is the Intel GPU scanner's, per policy."""

    name = "gpu-policy"

    def __init__(self) -> None:
        self.tree = DeviceTree({r: TREES[r] for r in (I915, XE, PACKED, MONITORING)})
        spread = IntelGpuScanner(IntelGpuSettings(shared_dev_num=SHARES, allocation_policy="none"))
        self.policies = {
            I915: spread,
            XE: IntelGpuScanner(
                IntelGpuSettings(shared_dev_num=SHARES, allocation_policy="balanced")
            ),
            PACKED: IntelGpuScanner(
                IntelGpuSettings(shared_dev_num=SHARES, allocation_policy="packed")
            ),
            MONITORING: spread,
        }

    def scan(self, source: UdevSource) -> DeviceTree:
        return self.tree

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[str] | Awaitable[Sequence[str]]:
        return self.policies[resource].preferred_allocation(
            resource, available, must_include, size, devices
        )


def scanners() -> list[Scanner]:
    plain = StaticScanner({PLAIN: TREES[PLAIN]})
    return [plain, HookedScanner(), GpuPolicyScanner()]


EXPECTED_OPTIONS = {
    r: pb.DevicePluginOptions(
        pre_start_required=r == HOOKED, get_preferred_allocation_available=True
    )
    for r in RESOURCES
}


# ---------------------------------------------------------------------------- the requests


@dataclass(frozen=True, slots=True)
class Call:
    rpc: Rpc
    resource: str
    request: Message
    suffix: bytes = b""  # unknown fields appended to the serialized request

    def raw(self) -> bytes:
        return self.request.SerializeToString() + self.suffix

    def __repr__(self) -> str:  # huge requests would flood hypothesis' report
        return (
            f"Call({self.rpc}, {self.resource}, {_summary(self.request)}, suffix={self.suffix!r})"
        )


def _short(value: str) -> str:
    return repr(value) if len(value) <= 40 else f"{value[:20]!r}...({len(value)} chars)"


def _ids(ids: Sequence[str]) -> str:
    if len(ids) <= 8:
        return "[" + ", ".join(_short(i) for i in ids) + "]"
    return f"[{', '.join(_short(i) for i in ids[:3])}, ... {len(ids)} ids]"


def _summary(request: Message) -> str:
    if isinstance(request, pb.AllocateRequest):
        containers = [_ids(c.devices_ids) for c in request.container_requests[:4]]
        return f"{len(request.container_requests)} containers: {', '.join(containers)}"
    if isinstance(request, pb.PreferredAllocationRequest):
        parts = [
            f"(available={_ids(c.available_deviceIDs)}, must={_ids(c.must_include_deviceIDs)}, "
            f"size={c.allocation_size})"
            for c in request.container_requests[:4]
        ]
        return f"{len(request.container_requests)} containers: {', '.join(parts)}"
    if isinstance(request, pb.PreStartContainerRequest):
        return _ids(request.devices_ids)
    return type(request).__name__


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _unknown_field(number: int, wire_type: int, payload: bytes, value: int) -> bytes:
    key = _varint(number << 3 | wire_type)
    if wire_type == 0:
        return key + _varint(value)
    if wire_type == 1:
        return key + value.to_bytes(8, "little")
    if wire_type == 5:
        return key + (value & 0xFFFFFFFF).to_bytes(4, "little")
    return key + _varint(len(payload)) + payload


unknown_fields = st.lists(
    st.builds(
        _unknown_field,
        st.integers(16, 2**29 - 1),
        st.sampled_from([0, 1, 2, 5]),
        st.binary(max_size=64),
        st.integers(0, 2**64 - 1),
    ),
    min_size=1,
    max_size=3,
).map(b"".join)
suffixes = st.one_of(st.just(b""), st.just(b""), unknown_fields)

# Characters that break naive code: NUL, path separators, dots, non-ASCII, invisible ones.
WEIRD = "\x00/.\\ \t\n%*:é日💥\u202e\ufeff\U000e0041"
SPECIAL_IDS = [
    "",
    ".",
    "..",
    "/",
    "//",
    "../..",
    "\x00",
    "a/b",
    "../../etc/passwd",
    "dev0\x00",
    "dev0/",
    "/dev0",
    "dev0/..",
    " dev0",
    "DEV0",
    "%00",
    "*",
    "💥",
    "\u202edev0",
    "\ufeffdev0",
    "\U0010ffff",
    MONITORING_ID,
    "0000:03:00.0",
]
MUTATIONS: list[Callable[[str], str]] = [
    str.upper,
    lambda i: i + "\x00",
    lambda i: "/" + i,
    lambda i: "../" + i,
    lambda i: i + "/..",
    lambda i: " " + i,
    lambda i: i[:-1],
    lambda i: i + i,
    lambda i: i.replace("0", "\uff10"),  # a fullwidth zero
    lambda i: i * 1000,
]
LONG_UNITS = ["a", "é", "/", "\x00", "..", "💥", "/..", "\U000e0041", "dev0"]


def _repeat(unit: str, times: int) -> str:
    return unit * times


def _distinct_long(unit: str, length: int, count: int) -> list[str]:
    return [f"{unit * length}{k}" for k in range(count)]


def _huge(kind: str, resource: str, count: int) -> list[str]:
    ghosts = [f"ghost-{k}" for k in range(count)]
    if kind == "ghosts":
        return ghosts
    if kind == "repeated":  # every healthy id, over and over (duplicates)
        healthy = HEALTHY[resource]
        return [healthy[k % len(healthy)] for k in range(count)]
    if kind == "valid+ghosts":
        return [*HEALTHY[resource], *ghosts]
    return [*ghosts, *sorted(TREES[resource])]  # ghosts, then every advertised id


def id_elements(resource: str) -> st.SearchStrategy[str]:
    advertised = sorted(TREES[resource])
    options = [
        st.sampled_from(HEALTHY[resource]),
        st.sampled_from(HEALTHY[resource]),
        st.sampled_from(FOREIGN[resource]),
        st.builds(lambda f, i: f(i), st.sampled_from(MUTATIONS), st.sampled_from(advertised)),
        st.text(st.sampled_from(WEIRD) | st.characters(codec="utf-8"), max_size=40),
        st.sampled_from(SPECIAL_IDS),
        st.builds(_repeat, st.sampled_from(LONG_UNITS), st.integers(81, 100_000)),
    ]
    if UNHEALTHY[resource]:
        options.append(st.sampled_from(UNHEALTHY[resource]))
    return st.one_of(options)


def valid_ids(resource: str, min_size: int = 1) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(HEALTHY[resource]), unique=True, min_size=min_size)


def id_lists(resource: str) -> st.SearchStrategy[list[str]]:
    return st.one_of(
        st.lists(id_elements(resource), max_size=12),
        valid_ids(resource),
        st.just([]),
        st.builds(
            _huge,
            st.sampled_from(["ghosts", "repeated", "valid+ghosts", "ghosts+advertised"]),
            st.just(resource),
            st.integers(1_000, 60_000),
        ),
        st.builds(
            _distinct_long,
            st.sampled_from(LONG_UNITS),
            st.integers(81, 2_000),
            st.integers(11, 40),
        ),
    )


allocation_sizes = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([INT32_MIN, INT32_MIN + 1, -1, 0, 1, INT32_MAX - 1, INT32_MAX]),
    st.integers(INT32_MIN, INT32_MAX),
)


@st.composite
def kubelet_like_preferred(
    draw: st.DrawFn, resource: str
) -> pb.ContainerPreferredAllocationRequest:
    """What a kubelet would send: free healthy ids, must_include among them, a size between."""
    available = draw(valid_ids(resource, min_size=0))
    must = draw(st.lists(st.sampled_from(available), unique=True)) if available else []
    size = draw(st.integers(len(must), max(len(must), len(available))))
    return pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
    )


def preferred_requests(resource: str) -> st.SearchStrategy[Message]:
    arbitrary = st.builds(
        pb.ContainerPreferredAllocationRequest,
        available_deviceIDs=id_lists(resource),
        must_include_deviceIDs=id_lists(resource),
        allocation_size=allocation_sizes,
    )
    container = kubelet_like_preferred(resource) | arbitrary
    many = st.builds(lambda c, n: [c] * n, kubelet_like_preferred(resource), st.integers(50, 500))
    return st.builds(
        pb.PreferredAllocationRequest, container_requests=st.lists(container, max_size=4) | many
    )


def allocate_requests(resource: str) -> st.SearchStrategy[Message]:
    container = st.builds(pb.ContainerAllocateRequest, devices_ids=id_lists(resource))
    valid = st.builds(pb.ContainerAllocateRequest, devices_ids=valid_ids(resource))
    many = st.builds(lambda c, n: [c] * n, valid, st.integers(50, 1_000))
    containers = st.lists(container, max_size=5) | st.lists(valid, min_size=1, max_size=5) | many
    return st.builds(pb.AllocateRequest, container_requests=containers)


def calls_for(resource: str) -> st.SearchStrategy[Call]:
    requests: dict[Rpc, st.SearchStrategy[Message]] = {
        "options": st.just(pb.Empty()),
        "list": st.just(pb.Empty()),
        "preferred": preferred_requests(resource),
        "allocate": allocate_requests(resource),
        "prestart": st.builds(pb.PreStartContainerRequest, devices_ids=id_lists(resource)),
    }
    return st.one_of(
        [st.builds(Call, st.just(rpc), st.just(resource), requests[rpc], suffixes) for rpc in RPCS]
    )


CALLS = {r: calls_for(r) for r in RESOURCES}
examples = st.lists(st.sampled_from(RESOURCES).flatmap(CALLS.__getitem__), min_size=1, max_size=4)


def _raw_call(rpc: Rpc, resource: str, raw: bytes) -> Call:
    """A call with bytes that may not parse: the request is what they parse as, if anything."""
    try:
        request = REQUESTS[rpc].FromString(raw)
    except DecodeError:
        return RawCall(rpc, resource, REQUESTS[rpc](), raw)
    return RawCall(rpc, resource, request, raw)


@dataclass(frozen=True, slots=True, repr=False)
class RawCall(Call):
    """Sends ``suffix`` alone: arbitrary bytes, not a serialized request."""

    def raw(self) -> bytes:
        return self.suffix


raw_examples = st.builds(
    _raw_call,
    st.sampled_from(RPCS),
    st.sampled_from(RESOURCES),
    st.binary(max_size=300)
    | st.builds(
        lambda a, b: a + b,
        st.sampled_from([b"\n", b"\x12", b"\x0a\x05\x0a\x03"]),
        st.binary(max_size=64),
    ),
)


# ---------------------------------------------------------------------------- calling


async def first_message(stream: Any) -> Any:
    """The first message of a server stream (None if it ends without one); then cancel it."""
    try:
        async for message in stream:
            return message
        return None
    finally:
        stream.cancel()


@dataclass(frozen=True, slots=True)
class Answer:
    code: str  # "OK" or the status name
    details: str = ""
    message: Any = None
    seconds: float = 0.0


@dataclass
class Fuzzer:
    """Runs examples from hypothesis' thread on the daemon's loop and checks every answer."""

    loop: asyncio.AbstractEventLoop
    sessions: Mapping[str, PluginSession]
    daemon_task: asyncio.Task[None]
    calls: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    examples: int = 0
    slowest: tuple[float, str] = (0.0, "")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=CASE_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"no answer within {CASE_TIMEOUT_S} s: the daemon hangs") from None

    def check_example(self, calls: Sequence[Call]) -> None:
        self.examples += 1
        answers = self.run(self._send_all(calls))
        # Streams one server keeps open at once (the kubelet's own among them): an example
        # opening more at the same time may find the cap reached, unless earlier ones have
        # closed meanwhile.
        lists = Counter(call.resource for call in calls if call.rpc == "list")
        for call, answer in zip(calls, answers, strict=True):
            self.calls[f"{call.rpc} {call.resource}"] += 1
            self.codes[f"{call.rpc} {answer.code}"] += 1
            self.slowest = max(self.slowest, (answer.seconds, repr(call)))
            if (
                call.rpc == "list"
                and lists[call.resource] + 1 > MAX_STREAMS
                and answer.code == "RESOURCE_EXHAUSTED"
                and "ListAndWatch streams are open already" in answer.details
            ):
                continue
            check_answer(call, answer)

    async def _send_all(self, calls: Sequence[Call]) -> list[Answer]:
        answers = await asyncio.gather(*(self.send(call) for call in calls))
        assert not self.daemon_task.done(), "the daemon stopped"
        return answers

    async def send(self, call: Call) -> Answer:
        session = self.sessions[call.resource]
        name, kind, response = METHODS[call.rpc]
        path = f"/v1beta1.DevicePlugin/{name}"
        started = self.loop.time()
        try:
            if kind == "stream":
                stream = session.channel.unary_stream(path, None, response.FromString)
                message = await first_message(stream(call.raw(), timeout=CALL_TIMEOUT_S))
                if message is None:
                    return Answer("EOF")
            elif not call.suffix:
                message = await getattr(session.stub, name)(call.request, timeout=CALL_TIMEOUT_S)
            else:
                unary = session.channel.unary_unary(path, None, response.FromString)
                message = await unary(call.raw(), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return Answer(exc.code().name, exc.details() or "", None, self.loop.time() - started)
        return Answer("OK", "", message, self.loop.time() - started)


# ---------------------------------------------------------------------------- the oracle


def refusals(resource: str, requests: Sequence[Sequence[str]], rpc: Rpc) -> dict[str, set[str]]:
    """Status name -> the ids that justify it; empty when the request must succeed."""
    devices = TREES[resource]
    found: dict[str, set[str]] = {}
    for ids in requests:
        duplicates = {i for i, n in Counter(ids).items() if n > 1}
        if duplicates:
            found.setdefault("INVALID_ARGUMENT", set()).update(duplicates)
        for device_id in ids:
            info = devices.get(device_id)
            if info is None:
                found.setdefault("NOT_FOUND", set()).add(device_id)
            elif not info.healthy:
                found.setdefault("INVALID_ARGUMENT", set()).add(device_id)
    if sum(len(ids) for ids in requests) > len(devices):
        # More ids than devices in all: a device named in two containers (one of them is
        # named, if none of the refusals above is).
        named = Counter(i for ids in requests for i in set(ids))
        found.setdefault("INVALID_ARGUMENT", set()).update(i for i, n in named.items() if n > 1)
    if not found and rpc == "prestart" and resource == HOOKED and REFUSING_ID in requests[0]:
        found["INVALID_ARGUMENT"] = {REFUSING_ID}
    return found


def check_refusal(resource: str, answer: Answer, expected: Mapping[str, set[str]]) -> None:
    assert answer.code in expected, (
        f"{answer.code} ({answer.details[:300]!r}); expected {sorted(expected) or 'OK'}"
    )
    assert resource in answer.details, answer.details[:300]
    # Ids are quoted (ascii(), first 80 characters; the list cut at 1,200 characters) by the
    # servicer; a hook names them as it likes.
    named = any(
        ascii(i[:80])[:200] in answer.details or i[:80] in answer.details
        for i in expected[answer.code]
    )
    assert named, f"no offending id named in {answer.details[:300]!r}"


def check_answer(call: Call, answer: Answer) -> None:
    if len(call.raw()) > GRPC_MAX_MESSAGE:
        # gRPC refuses it before the daemon sees it.
        assert answer.code == "RESOURCE_EXHAUSTED", answer
        return
    request: Any = call.request
    if call.rpc == "options":
        assert answer.code == "OK", answer
        assert answer.message == EXPECTED_OPTIONS[call.resource]
    elif call.rpc == "list":
        assert answer.code == "OK", answer
        listed = {d.ID: d.health for d in answer.message.devices}
        assert listed == {i: info.health.value for i, info in TREES[call.resource].items()}
    elif call.rpc == "preferred":
        assert answer.code == "OK", answer
        responses = answer.message.container_responses
        assert len(responses) == len(request.container_requests)
        for container, response in zip(request.container_requests, responses, strict=True):
            check_preferred(call.resource, container, list(response.deviceIDs))
    elif call.rpc == "allocate":
        requests = [list(c.devices_ids) for c in request.container_requests]
        expected = refusals(call.resource, requests, call.rpc)
        if expected:
            check_refusal(call.resource, answer, expected)
            return
        assert answer.code == "OK", answer
        responses = answer.message.container_responses
        assert len(responses) == len(requests)
        for ids, response in zip(requests, responses, strict=True):
            check_allocation(call.resource, ids, len(requests), response)
    else:
        expected = refusals(call.resource, [list(request.devices_ids)], call.rpc)
        if expected:
            check_refusal(call.resource, answer, expected)
        else:
            assert answer.code == "OK", answer


def check_allocation(
    resource: str, ids: Sequence[str], containers: int, response: pb.ContainerAllocateResponse
) -> None:
    devices = TREES[resource]
    if resource == HOOKED and containers > 1:
        assert dict(response.envs) == {"IDS": ",".join(ids)}
        return
    wanted = {n.host_path for i in ids for n in devices[i].nodes}
    assert {d.host_path for d in response.devices} == wanted
    assert {d.container_path for d in response.devices} == wanted
    if resource in (PLAIN, HOOKED):
        got = response.envs["SERIAL"].split(",") if ids else []
        assert sorted(got) == sorted(ids)


def check_preferred(
    resource: str, container: pb.ContainerPreferredAllocationRequest, answer: list[str]
) -> None:
    devices = TREES[resource]
    available = list(container.available_deviceIDs)
    must = list(dict.fromkeys(container.must_include_deviceIDs))
    # More ids offered than advertised: no kubelet does that; the unknown ones are dropped.
    if len(available) > len(devices):
        available = [i for i in available if i in devices]
    if len(container.must_include_deviceIDs) > len(devices):
        must = [i for i in must if i in devices]
    size = container.allocation_size
    assert len(answer) == len(set(answer)), f"duplicate ids in {_ids(answer)}"
    assert answer[: len(must)] == must, "must_include ids do not come first"
    assert set(answer) <= set(available) | set(must), "an id outside available and must_include"
    rest = answer[len(must) :]
    sick = [i for i in rest if i in devices and not devices[i].healthy]
    assert not sick, f"unhealthy ids chosen: {sick}"
    assert len(answer) <= max(size, len(must))
    # Filled as far as the usable ids allow (unknown ids count: they are the kubelet's).
    required = set(must)  # once: available and must_include may hold 60,000 ids each
    usable = [
        i
        for i in dict.fromkeys(available)
        if i not in required and (i not in devices or devices[i].healthy)
    ]
    assert len(answer) == min(max(size, len(must)), len(must) + len(usable)), (
        f"{len(answer)} ids for size {size}, {len(must)} must_include, {len(usable)} usable"
    )


# ---------------------------------------------------------------------------- the daemon


async def start_sessions(kubelet: KubeletSimulator) -> dict[str, PluginSession]:
    sessions = {}
    for resource in RESOURCES:
        session = await kubelet.wait_for_plugin(resource)
        listed = await session.wait_for_update()
        assert {i: d.health for i, d in listed.items()} == {
            i: info.health.value for i, info in TREES[resource].items()
        }
        assert session.options.pre_start_required == (resource == HOOKED)
        sessions[resource] = session
    return sessions


def daemon_task() -> asyncio.Task[None]:
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "devplug-daemon"]
    return task


async def assert_serving_normally(
    daemon: Daemon, kubelet: KubeletSimulator, sessions: Mapping[str, PluginSession]
) -> None:
    """Same registrations and streams as before the fuzzing; a normal Allocate and a fresh
    ListAndWatch work; no fuzzing stream is left open."""
    assert not daemon_task().done()
    assert sorted(r.resource for r in kubelet.registrations if r.accepted) == sorted(RESOURCES)
    for resource, session in sessions.items():
        assert kubelet.sessions[resource] is session
        assert not session.stream_ended.is_set(), session.stream_error
        healthy = HEALTHY[resource][0]
        (answer,) = await session.allocate([healthy])
        assert {n.host_path for n in answer.nodes} == {
            n.host_path for n in TREES[resource][healthy].nodes
        }
        message = await first_message(session.stub.ListAndWatch(pb.Empty(), timeout=CALL_TIMEOUT_S))
        assert message is not None
        assert {d.ID for d in message.devices} == set(TREES[resource])
        servicer = daemon.servers.servers[resource].servicer
        async with asyncio.timeout(5):
            while servicer.active_streams != 1:  # noqa: ASYNC110 - a counter, no event for 1
                await asyncio.sleep(0.01)


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


# ---------------------------------------------------------------------------- the tests


@contextlib.asynccontextmanager
async def fuzzed_daemon(
    kubelet: KubeletSimulator, kubelet_dir: Path, scanners: Sequence[Scanner]
) -> AsyncIterator[Fuzzer]:
    """The daemon with a Fuzzer for it; checks on exit that it still serves normally and that
    nothing but the deliberately broken preferred-allocation hook logged an error."""
    # Captured rather than rendered: a hook's traceback with its locals is slow to print.
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(daemon_settings(kubelet_dir), scanners) as daemon:
            sessions = await start_sessions(kubelet)
            yield Fuzzer(asyncio.get_running_loop(), sessions, daemon_task())
            await assert_serving_normally(daemon, kubelet, sessions)
    errors = Counter(e["event"] for e in logs if e["log_level"] in ("error", "critical"))
    assert set(errors) <= {"preferred.hook_failed"}, errors


@pytest.mark.timeout(TEST_TIMEOUT_S)
async def test_fuzzed_rpcs_get_proper_answers_and_the_daemon_keeps_serving(
    kubelet: KubeletSimulator, kubelet_dir: Path, scaled: Callable[[int, int], int]
) -> None:
    cases = scaled(300, 10_000)
    hooked = HookedScanner()
    plain = StaticScanner({PLAIN: TREES[PLAIN]})
    async with fuzzed_daemon(kubelet, kubelet_dir, [plain, hooked, GpuPolicyScanner()]) as fuzzer:

        @fuzz_settings(cases)
        @given(calls=examples)
        def every_answer_is_proper(calls: list[Call]) -> None:
            fuzzer.check_example(calls)

        await asyncio.to_thread(every_answer_is_proper)

    assert fuzzer.examples >= cases
    assert {key.split()[0] for key in fuzzer.calls} == set(RPCS)
    assert {key.split()[1] for key in fuzzer.codes} >= {"OK", "NOT_FOUND", "INVALID_ARGUMENT"}
    print(f"\n{fuzzer.examples} examples, {sum(fuzzer.calls.values())} RPCs: {dict(fuzzer.codes)}")
    print(f"slowest RPC: {fuzzer.slowest[0]:.3f} s: {fuzzer.slowest[1][:300]}")


@pytest.mark.timeout(TEST_TIMEOUT_S)
async def test_undecodable_request_bytes_are_refused_and_the_daemon_keeps_serving(
    kubelet: KubeletSimulator, kubelet_dir: Path, scaled: Callable[[int, int], int]
) -> None:
    """Bytes that are not a protobuf message (bad wire format, bad UTF-8) are refused by gRPC's
    deserializer before the servicer runs: gRPC Python answers UNKNOWN naming the DecodeError.
    Bytes that do parse are answered like the request they parse as."""
    cases = scaled(100, 2_000)
    async with fuzzed_daemon(kubelet, kubelet_dir, scanners()) as fuzzer:

        @fuzz_settings(cases)
        @given(call=raw_examples)
        def bytes_get_a_status(call: Call) -> None:
            answer = fuzzer.run(fuzzer.send(call))
            try:
                REQUESTS[call.rpc].FromString(call.raw())
            except DecodeError:
                assert answer.code == "UNKNOWN" and "DecodeError" in answer.details, answer
            else:
                check_answer(call, answer)

        await asyncio.to_thread(bytes_get_a_status)


async def test_requests_over_the_grpc_size_limit_are_refused_and_the_daemon_keeps_serving(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    huge = "x" * (GRPC_MAX_MESSAGE + 1)
    calls = [
        Call(
            "allocate",
            PLAIN,
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[huge])]
            ),
        ),
        Call(
            "preferred",
            I915,
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        must_include_deviceIDs=[huge], allocation_size=1
                    )
                ]
            ),
        ),
        # A valid request made huge by an unknown field.
        Call(
            "prestart",
            HOOKED,
            pb.PreStartContainerRequest(devices_ids=["hk0"]),
            _unknown_field(16, 2, huge.encode(), 0),
        ),
    ]
    async with fuzzed_daemon(kubelet, kubelet_dir, scanners()) as fuzzer:
        for call in calls:
            assert len(call.raw()) > GRPC_MAX_MESSAGE
            check_answer(call, await fuzzer.send(call))


async def test_a_refusal_naming_long_non_ascii_ids_reaches_the_client(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """Ten ids of 80 emoji (12 bytes each, percent-encoded) or 80 invisible tag characters
    (10-character escapes) once made a ~9.7 KB or ~8.1 KB grpc-message, past gRPC's 8 KiB
    metadata soft limit: a C-core client got RESOURCE_EXHAUSTED instead of NOT_FOUND."""
    calls = []
    for unit in ("💥", "\U000e0041"):
        ids = [f"{unit * 81}{k}" for k in range(11)]
        containers = [pb.ContainerAllocateRequest(devices_ids=ids)]
        calls.append(Call("allocate", PLAIN, pb.AllocateRequest(container_requests=containers)))
        calls.append(Call("prestart", HOOKED, pb.PreStartContainerRequest(devices_ids=ids)))
    codes: Counter[str] = Counter()
    async with fuzzed_daemon(kubelet, kubelet_dir, scanners()) as fuzzer:
        # The soft limit refused at random (~15% of the emoji calls, ~2.5% of the others).
        for _ in range(50):
            for call in calls:
                answer = await fuzzer.send(call)
                check_answer(call, answer)
                codes[answer.code] += 1
    assert codes == {"NOT_FOUND": 50 * len(calls)}, codes
