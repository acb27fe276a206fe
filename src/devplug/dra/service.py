"""The kubelet's DRAPlugin service, v1 and v1beta1, on one gRPC server.

A 1.34+ kubelet calls ``/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/...``, a 1.32-1.33 kubelet
the v1beta1 paths; both are served on the same socket (``<kubelet_root>/plugins/<driver>/
dra.sock``) and answer alike from one :class:`~devplug.dra.claims.ClaimPreparer`. The two
versions differ only in v1's ``Device.share_id``, which v1beta1 has not.

Per-claim failures are per-claim ``error`` strings. The call fails (UNAVAILABLE) only when
nothing could be done for any claim, and with INTERNAL on a bug, logged with its traceback;
either way the kubelet asks again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import ModuleType
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from devplug._proto import dra_v1_pb2 as v1
from devplug._proto import dra_v1_pb2_grpc as v1_grpc
from devplug._proto import dra_v1beta1_pb2 as v1beta1
from devplug._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from devplug.dra.checkpoint import PreparedDevice
from devplug.dra.claims import CallFailedError, ClaimPreparer, ClaimRef, Prepared

log = structlog.get_logger(__name__)

# The names a plugin lists in GetInfo's supported_versions: "<version>.<service>" (the
# kubelet's dra/v1 and dra/v1beta1 types.go), most preferred first.
SERVICE_V1 = "v1.DRAPlugin"
SERVICE_V1BETA1 = "v1beta1.DRAPlugin"
SUPPORTED_VERSIONS = (SERVICE_V1, SERVICE_V1BETA1)

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]


class DraPluginServicer(v1_grpc.DRAPluginServicer, v1beta1_grpc.DRAPluginServicer):
    """DRAPlugin of one version (``messages``: its generated message module), answering
    from ``preparer``. The versions' messages have the same names and fields, but for v1's
    ``Device.share_id``; so one class serves either (it is both generated servicers)."""

    def __init__(self, preparer: ClaimPreparer, messages: ModuleType, version: str) -> None:
        self.preparer = preparer
        self.pb = messages
        self.version = version
        self.share_ids = "share_id" in messages.Device.DESCRIPTOR.fields_by_name

    async def NodePrepareResources(self, request: Any, context: Context) -> Any:
        refs, bad = _refs(request.claims)
        answers = await self._call("prepare", lambda: self.preparer.prepare(refs), refs, context)
        answers.update({uid: Prepared(error=why) for uid, why in bad.items()})
        pb = self.pb
        return pb.NodePrepareResourcesResponse(
            claims={
                uid: pb.NodePrepareResourceResponse(
                    devices=[self._device(d) for d in answer.devices], error=answer.error
                )
                for uid, answer in answers.items()
            }
        )

    def _device(self, device: PreparedDevice) -> Any:
        share = {"share_id": device.share_id} if self.share_ids else {}
        return self.pb.Device(
            request_names=device.request_names,
            pool_name=device.pool_name,
            device_name=device.device_name,
            cdi_device_ids=device.cdi_device_ids,
            **share,
        )

    async def NodeUnprepareResources(self, request: Any, context: Context) -> Any:
        refs, bad = _refs(request.claims)
        answers = await self._call(
            "unprepare", lambda: self.preparer.unprepare(refs), refs, context
        )
        answers.update(bad)
        pb = self.pb
        return pb.NodeUnprepareResourcesResponse(
            claims={uid: pb.NodeUnprepareResourceResponse(error=e) for uid, e in answers.items()}
        )

    async def _call(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        refs: Sequence[ClaimRef],
        context: Context,
    ) -> T:
        started = time.perf_counter()
        try:
            answers = await call()
        except CallFailedError as exc:
            log.error(f"dra.{what}.failed", version=self.version, claims=len(refs), reason=str(exc))
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:
            log.exception(f"dra.{what}.failed", version=self.version, claims=len(refs))
            await _abort(context, grpc.StatusCode.INTERNAL, f"devplug failed to {what}: {exc}")
        log.debug(
            f"dra.{what}.done",
            version=self.version,
            claims=len(refs),
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
        return answers


async def _abort(context: Context, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


def _refs(claims: Iterable[Any]) -> tuple[list[ClaimRef], dict[str, str]]:
    """The claims as ClaimRefs, and an error by uid for each that lacks a field the kubelet
    always sets (such a claim is answered, not prepared)."""
    refs: list[ClaimRef] = []
    bad: dict[str, str] = {}
    for claim in claims:
        missing = [field for field in ("namespace", "uid", "name") if not getattr(claim, field)]
        if missing:
            bad[claim.uid] = f"claim {claim.namespace}/{claim.name}: {', '.join(missing)} missing"
        else:
            refs.append(ClaimRef(claim.namespace, claim.uid, claim.name))
    return refs, bad


def add_dra_services(preparer: ClaimPreparer, server: grpc.aio.Server) -> None:
    """Serve DRAPlugin v1 and v1beta1 from ``preparer`` on ``server``."""
    v1_grpc.add_DRAPluginServicer_to_server(DraPluginServicer(preparer, v1, "v1"), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(
        DraPluginServicer(preparer, v1beta1, "v1beta1"), server
    )
