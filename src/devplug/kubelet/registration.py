"""Talking to the kubelet: Register, and noticing when the kubelet restarts.

One inotify watch on the device plugin dir (:class:`~devplug._kits.dirwatch.DirWatcher`, for
every resource server together, so a node with many resources uses one inotify instance)
bumps a counter whenever a socket file in the dir is created, deleted or moved, or the dir
itself goes away. Servers wake on the counter and check for themselves whether their own
socket vanished or ``kubelet.sock`` was re-created; they also re-check on a timer, the stat
backstop for a missed or impossible watch.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog

from devplug._kits.dirwatch import DirWatcher
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"


class KubeletDirWatcher(DirWatcher):
    """One watch for every server: bumps on socket files created, deleted or moved."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, lambda name: name.endswith(".sock"), "kubelet")


class RegistrationError(Exception):
    """Register failed; ``retryable`` is False when the kubelet refused the request itself."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


async def register(
    kubelet_dir: Path,
    *,
    endpoint: str,
    resource: str,
    options: pb.DevicePluginOptions,
    timeout: float,
) -> None:
    """Call Registration.Register on ``kubelet.sock``; raise RegistrationError on failure.

    The kubelet dials the plugin back and calls GetDevicePluginOptions before it answers, so
    this must be awaited while the plugin's own server is already serving.
    """
    target = f"unix://{kubelet_dir / KUBELET_SOCKET}"
    request = pb.RegisterRequest(
        version=API_VERSION, endpoint=endpoint, resource_name=resource, options=options
    )
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.RegistrationStub(channel)
        try:
            await stub.Register(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            retryable = code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
            raise RegistrationError(
                f"{code.name}: {exc.details() or 'no details'}", retryable
            ) from None
