"""Podman as a real CDI consumer: an isolated podman, a tiny local image, the host's CDI dir.

Podman 4.3.1 (Debian 12) reads CDI specs only from /etc/cdi and /var/run/cdi: its CDI
registry is created with the library's default dirs, and nothing configures them (the binary
has no ``cdi_spec_dirs``: containers.conf gained that key in 2024, containers/common PR 1834,
long after the containers/common 0.50 Debian 12 ships). So the tests put specs in
the machine's /var/run/cdi under kinds no one else uses (``test-<random hex>.devplug.io/...``)
and remove exactly those files afterwards: see :class:`HostCdiDir`.

Everything else podman touches is private to the test session: its config files
(``CONTAINERS_CONF``, ``CONTAINERS_STORAGE_CONF``) select vfs storage, cgroupfs, file events,
runc and a temp dir for storage and state, so the machine's own podman storage and settings
are neither used nor changed. The image is busybox-static's /bin/busybox plus a few applet
links, imported from a tar: no registry, no network.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
import stat
import struct
import subprocess
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from cdi_library import real_machine_env, unavailable

HOST_CDI_DIR = Path("/var/run/cdi")
BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "stat", "ls", "cat")
IMAGE = "localhost/devplug-cdi-consumer:busybox"
# runc, not crun: crun refuses this kind of machine's hybrid cgroup layout. Explicit ulimits:
# podman's default copies the host's limits, and raising a hard limit needs CAP_SYS_RESOURCE,
# which these machines' root lacks ("error setting rlimit type 7: operation not permitted").
RUN_OPTIONS = (
    "--rm",
    "--network",
    "none",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
)
APT_PACKAGES = "podman runc busybox-static"


def device_id(path: str | Path) -> str:
    """``major:minor`` of a device node, in hex, as busybox's ``stat -c %t:%T`` prints it."""
    rdev = os.stat(path).st_rdev
    return f"{os.major(rdev):x}:{os.minor(rdev):x}"


def node_access(path: str | Path) -> str:
    """A node's permission bits (octal) and group id, as busybox's ``stat -c '%a %g'`` prints
    them: what a container must see of a node it gets through CDI."""
    info = os.stat(path)
    return f"{stat.S_IMODE(info.st_mode):o} {info.st_gid}"


def is_char_device(path: str | Path) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def _is_static_elf(path: Path) -> bool:
    """True for a 64-bit little-endian ELF without a PT_INTERP segment (no dynamic loader).

    Debian's ``busybox`` package also installs /bin/busybox, dynamically linked; copied into
    an image with no libc it could not start.
    """
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    pt_interp = 3
    return all(
        struct.unpack_from("<I", data, phoff + i * phentsize)[0] != pt_interp for i in range(phnum)
    )


def _image_tar() -> bytes:
    """A root filesystem with /bin/busybox and its applet links, as a tar in memory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for directory in ("bin", "dev", "proc", "sys", "etc", "tmp"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        binary = BUSYBOX.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(binary), 0o755
        tar.addfile(info, io.BytesIO(binary))
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(info)
    return buffer.getvalue()


class Podman:
    """podman with its own config, storage and state under ``base`` (a temp dir)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        storage = base / "storage.conf"
        storage.write_text(
            "[storage]\n"
            'driver = "vfs"\n'  # plain directories: no mounts to leak, works on any fs
            f'graphroot = "{base / "root"}"\n'
            f'runroot = "{base / "runroot"}"\n'
        )
        engine = base / "containers.conf"
        engine.write_text(
            "[engine]\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'  # no systemd or D-Bus needed
            'events_logger = "file"\n'  # no journald needed
            f'tmp_dir = "{base / "tmp"}"\n'
        )
        # The config variables replace the machine's files (/etc/containers/...) outright.
        self.env = real_machine_env(
            CONTAINERS_CONF=str(engine), CONTAINERS_STORAGE_CONF=str(storage)
        )

    def __call__(
        self, *args: str, stdin: bytes | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["podman", *args],
            input=stdin,
            capture_output=True,
            timeout=timeout,
            check=False,
            env=self.env,
        )
        return subprocess.CompletedProcess(
            result.args,
            result.returncode,
            result.stdout.decode(errors="replace"),
            result.stderr.decode(errors="replace"),
        )

    def run(
        self, devices: Sequence[str], *command: str, options: Sequence[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        """``podman run`` of the test image with these ``--device`` names (CDI or paths) and
        any further ``options`` (``--user``, say)."""
        device_options = [option for d in devices for option in ("--device", d)]
        return self(
            "run",
            *RUN_OPTIONS,
            *options,
            *device_options,
            IMAGE,
            *command,
        )

    def prepare(self) -> None:
        """Check podman works here and import the test image; RuntimeError if it cannot."""
        info = self("info", "--format", "{{.Host.OCIRuntime.Name}} {{.Store.GraphDriverName}}")
        if info.returncode != 0:
            raise RuntimeError(f"podman info failed: {info.stderr.strip()}")
        if info.stdout.split() != ["runc", "vfs"]:
            raise RuntimeError(f"podman ignored its test config: {info.stdout!r}")
        imported = self("import", "-", IMAGE, stdin=_image_tar())
        if imported.returncode != 0:
            raise RuntimeError(f"podman import failed: {imported.stderr.strip()}")
        probe = self.run([], "stat", "-c", "%t:%T", "/dev/null")
        if probe.returncode != 0 or probe.stdout.strip() != device_id("/dev/null"):
            raise RuntimeError(
                f"podman cannot run a container here (exit status {probe.returncode}): "
                f"{probe.stdout}{probe.stderr}".strip()
            )

    def remove_everything(self) -> None:
        # Containers of an interrupted run; then the storage dir (vfs: no mounts).
        self("rm", "--all", "--force", timeout=120)
        shutil.rmtree(self.base, ignore_errors=True)


def why_podman_cannot_run() -> str | None:
    """A reason this machine cannot run the podman tests, or None. Cheap checks only."""
    if os.geteuid() != 0:
        return "the podman CDI tests need root (rootful podman, and specs in /var/run/cdi)"
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: apt-get install {APT_PACKAGES}"
    if not BUSYBOX.is_file() or not _is_static_elf(BUSYBOX):
        return f"{BUSYBOX} is missing or not static: apt-get install busybox-static"
    return None


@contextlib.contextmanager
def isolated_podman(base: Path) -> Iterator[Podman]:
    """A :class:`Podman` under ``base`` with the test image, removed with everything it made
    afterwards; the test skips (fails with ``CI=true``) where podman cannot run."""
    reason = why_podman_cannot_run()
    if reason is not None:
        unavailable(reason)
    podman = Podman(base)
    try:
        podman.prepare()
    except RuntimeError as exc:
        podman.remove_everything()
        unavailable(str(exc))
    try:
        yield podman
    finally:
        podman.remove_everything()


class HostCdiDir:
    """The machine's /var/run/cdi, shared with whatever else runs here.

    Every spec this test session puts there has a kind of the session's own vendor,
    ``test-<12 hex digits>.devplug.io``, and so a file name containing :attr:`token` (devplug
    names spec files after the kind). Clean-up removes only names containing the token, in
    the dir and in its ``.devplug/`` bookkeeping subdir, and then either dir only if it did
    not exist when the session began and is empty. /run is a tmpfs: a killed session's files
    go at the next boot at the latest.
    """

    def __init__(self, path: Path = HOST_CDI_DIR) -> None:
        self.path = path
        self.token = f"test-{secrets.token_hex(6)}"
        self.vendor = f"{self.token}.devplug.io"
        self._created: list[Path] = []

    def kind(self, device_class: str) -> str:
        return f"{self.vendor}/{device_class}"

    def __enter__(self) -> HostCdiDir:
        # Dirs that did not exist when the session began: removed at the end if left empty.
        self._created = [d for d in (self.path / ".devplug", self.path) if not d.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove_ours()
        for directory in self._created:
            with contextlib.suppress(OSError):  # not empty (someone else's files) or gone
                directory.rmdir()

    def remove_ours(self) -> list[str]:
        """Delete every file of this session's kinds (and their bookkeeping); their names."""
        removed = []
        for directory in (self.path, self.path / ".devplug"):
            with contextlib.suppress(FileNotFoundError):
                for entry in directory.iterdir():
                    if self.token in entry.name and not entry.is_dir():
                        entry.unlink(missing_ok=True)
                        removed.append(str(entry))
        return removed

    def install(self, spec_file: Path) -> Path:
        """Copy one of this session's spec files in, atomically: podman never reads half of
        one (the temp name does not end in .json, so the library skips it)."""
        if not spec_file.name.startswith(self.vendor):
            raise ValueError(f"{spec_file.name} is not a spec of this session's vendor")
        target = self.path / spec_file.name
        temp = self.path / f".{self.token}-installing"
        shutil.copyfile(spec_file, temp)
        os.replace(temp, target)
        return target
