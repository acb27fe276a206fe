"""Talking to the kubelet: Register, and noticing when the kubelet restarts.

One inotify watch on the device plugin dir (for every resource server together, so a node
with many resources uses one inotify instance) bumps a counter whenever a socket file in the
dir is created, deleted or moved, or the dir itself goes away. Servers wake on the counter and
check for themselves whether their own socket vanished or ``kubelet.sock`` was re-created;
they also re-check on a timer, the stat backstop for a missed or impossible watch.
"""

from __future__ import annotations

import asyncio
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from asyncinotify import Inotify, Mask

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.daemon.values import LatestValue

log = structlog.get_logger("devplug.kubelet")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
# While the dir is missing or cannot be watched, look again this often.
DIR_POLL_S = 1.0

_WATCH_MASK = (
    Mask.CREATE
    | Mask.DELETE
    | Mask.MOVED_FROM
    | Mask.MOVED_TO
    | Mask.DELETE_SELF
    | Mask.MOVE_SELF
    | Mask.ONLYDIR
)
_GONE = Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED | Mask.UNMOUNT
_PARENT_MASK = Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ONLYDIR


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """Tells one incarnation of a file from the next, even when the inode number is reused."""

    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity | None:
        """The identity of the socket at ``path``; None if it is missing or not a socket."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISSOCK(st.st_mode):
            return None
        return cls(st.st_ino, st.st_ctime_ns)


class KubeletDirWatcher:
    """Watches the device plugin dir; ``changes`` bumps on every relevant event."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.changes: LatestValue[int] = LatestValue(0)

    def _bump(self) -> None:
        self.changes.set(self.changes.value + 1)

    async def run(self) -> None:
        missing_logged = False
        failure_logged: str | None = None
        while True:
            if not self.directory.is_dir():
                if not missing_logged:
                    log.warning("kubelet.dir.missing", dir=str(self.directory))
                    missing_logged = True
                await asyncio.sleep(DIR_POLL_S)
                continue
            if missing_logged:
                log.info("kubelet.dir.found", dir=str(self.directory))
                missing_logged = False
            try:
                await self._watch()
                failure_logged = None
            except OSError as exc:
                # inotify limits (ENOSPC, EMFILE) must not stop the daemon: poll instead, and
                # say so once rather than on every retry.
                if exc.strerror != failure_logged:
                    log.error(
                        "kubelet.watch.failed",
                        dir=str(self.directory),
                        error=exc.strerror,
                        fallback=f"stat checks every {DIR_POLL_S}s until a watch can be set",
                    )
                    failure_logged = exc.strerror
                await asyncio.sleep(DIR_POLL_S)
                self._bump()

    async def _watch(self) -> None:
        """Watch the dir, and its parent for the dir itself being removed or replaced.

        The parent watch matters: a removed dir's own DELETE_SELF arrives only once nothing
        references it any more, and a listening unix socket bound in it keeps it referenced.
        """
        with Inotify() as inotify:
            inotify.add_watch(self.directory, _WATCH_MASK)
            parent = inotify.add_watch(self.directory.parent, _PARENT_MASK)
            # Anything may have happened before the watch existed: let servers re-check.
            self._bump()
            async for event in inotify:
                about_dir = event.watch is parent and str(event.name) == self.directory.name
                if about_dir or (event.watch is not parent and event.mask & _GONE):
                    log.warning("kubelet.dir.gone", dir=str(self.directory))
                    self._bump()
                    return
                if event.mask & Mask.Q_OVERFLOW or (
                    event.watch is not parent
                    and event.name is not None
                    and str(event.name).endswith(".sock")
                ):
                    self._bump()


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
