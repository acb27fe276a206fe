"""Building the shipped Dockerfile here, where no registry and no PyPI are reachable from a build.

The Dockerfile's two inputs from the network are replaced, the Dockerfile itself is not:

- ``BASE``, debian:bookworm-slim from a registry, by the same Debian release made with
  ``debootstrap --variant=minbase`` and slimmed as the official image is (debuerreotype's
  slimify and minimizing config: no docs, man pages or locales, apt's caches cleaned after
  every install, its lists removed), imported with podman. apt inside the build works.
- the ``wheels`` stage, which builds wheels with pip from PyPI, by a named build context (it
  replaces the stage of that name): wheels built on the host by this Python's pip from a copy
  of pyproject.toml, README.md and src/, the files that stage copies.

The debootstrapped base is kept as a tar in the cache dir and made again after a week;
podman's storage (vfs: plain directories, no mounts) is kept there too, so a warm run reuses
the base and the build's apt layer. The cache dir is ``~/.cache/devplug-tests/image`` (under
``XDG_CACHE_HOME`` if set), or ``DEVPLUG_IMAGE_CACHE``; one run at a time uses it (a lock).
Deleting it is always safe: the next run makes it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from cdi_library import real_machine_env

from devplug import __version__

ROOT = Path(__file__).resolve().parent.parent
# Outside the checkout: the checkout is the build context, and a cache inside it (podman's
# storage among it) would be copied into the context should .dockerignore ever let it in.
CACHE = Path(
    os.environ.get("DEVPLUG_IMAGE_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "devplug-tests" / "image"
)
BASE_TAR = CACHE / "debian-bookworm-slim.tar"
BASE_IMAGE = "localhost/devplug-test/debian:bookworm-slim"
IMAGE = f"localhost/devplug:{__version__}"
MIRROR = os.environ.get("DEVPLUG_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Debian's point releases and security fixes reach the base when it is made again.
BASE_MAX_AGE_S = 7 * 24 * 3600
# What the official image's config sets (debian:bookworm-slim has these and nothing else).
BASE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    'CMD ["bash"]',
)
# runc, not crun: crun refuses these machines' hybrid cgroup layout. The limits: podman's
# defaults exceed the sandbox's hard limits, and raising one needs CAP_SYS_RESOURCE.
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
APT_PACKAGES = "podman runc debootstrap"

# debuerreotype's slimify: these trees go (the official slim image's dpkg config keeps them
# out of later installs too), except the copyright files and locale.alias.
SLIM_EXCLUDES = (
    "/usr/share/doc/*",
    "/usr/share/groff/*",
    "/usr/share/info/*",
    "/usr/share/linda/*",
    "/usr/share/lintian/overrides/*",
    "/usr/share/locale/*",
    "/usr/share/man/*",
)
SLIM_INCLUDES = ("/usr/share/doc/*/copyright", "/usr/share/locale/locale.alias")
# debuerreotype's minimizing config for apt: caches cleaned after every install, no
# translations. With it, a RUN that installs packages and removes the lists leaves no cache.
APT_CONFIG = {
    "docker-clean": (
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n'
    ),
    "docker-no-languages": 'Acquire::Languages "none";\n',
    "docker-gzip-indexes": 'Acquire::GzipIndexes "true";\n',
}
SOURCES = (
    "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n"
    "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
    "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n"
    "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
)


def why_it_cannot_build() -> str | None:
    """A reason this machine cannot build the image, or None. Cheap checks only."""
    if os.geteuid() != 0:
        return "building the image needs root (rootful podman; debootstrap makes device nodes)"
    for tool in ("podman", "runc", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: apt-get install {APT_PACKAGES}"
    if sys.version_info[:2] != (3, 11):
        # The host builds the wheels; the image runs Debian 12's Python 3.11.
        return f"the host's wheels must be for Python 3.11 (the image's); this is {sys.version}"
    return None


def run(command: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Runs a command on the real machine (not umockdev's); its stdout, or an error with both."""
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env or real_machine_env(),
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited {result.returncode}:\n"
            f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    return result.stdout


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _slim(rootfs: Path) -> None:
    """What debuerreotype does to make the official slim image, in short."""
    for pattern in SLIM_EXCLUDES:
        top = rootfs / pattern.strip("/").removesuffix("/*")
        if not top.is_dir():
            continue
        for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            inside = "/" + path.relative_to(rootfs).as_posix()
            if path.is_dir() and not path.is_symlink():
                with contextlib.suppress(OSError):  # keeps the dirs of what is kept
                    path.rmdir()
            elif not any(fnmatch.fnmatchcase(inside, keep) for keep in SLIM_INCLUDES):
                path.unlink()
    dpkg_config = ["# The slim variant: these stay out of every later install."]
    dpkg_config += [f"path-exclude {pattern}" for pattern in SLIM_EXCLUDES]
    dpkg_config += [f"path-include {pattern}" for pattern in SLIM_INCLUDES]
    (rootfs / "etc/dpkg/dpkg.cfg.d/docker").write_text("\n".join(dpkg_config) + "\n")
    for name, text in APT_CONFIG.items():
        (rootfs / "etc/apt/apt.conf.d" / name).write_text(text)
    (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
    (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(SOURCES)
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb"):
        for path in rootfs.glob(pattern):
            if path.is_file() and path.name != "lock":
                path.unlink()


def _make_base_tar() -> None:
    """debootstrap a bookworm minbase, slim it, and keep it as a tar (written atomically)."""
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="rootfs-") as work:
        rootfs = Path(work) / "rootfs"
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], timeout=900)
        _slim(rootfs)
        partial = Path(work) / "base.tar"
        run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], timeout=300)
        partial.replace(BASE_TAR)


def base_is_stale() -> bool:
    return not BASE_TAR.exists() or time.time() - BASE_TAR.stat().st_mtime > BASE_MAX_AGE_S


class Podman:
    """podman with its own config and storage in the cache dir (the machine's are untouched)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        storage = home / "storage.conf"
        storage.write_text(
            "[storage]\n"
            'driver = "vfs"\n'  # plain directories: nothing mounted to leak, any file system
            f'graphroot = "{home / "root"}"\n'
            f'runroot = "{home / "runroot"}"\n'
        )
        engine = home / "containers.conf"
        engine.write_text(
            "[engine]\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'  # no systemd or D-Bus needed
            'events_logger = "file"\n'  # no journald needed
            f'tmp_dir = "{home / "tmp"}"\n'
        )
        self.env = real_machine_env(
            CONTAINERS_CONF=str(engine), CONTAINERS_STORAGE_CONF=str(storage)
        )

    def __call__(self, *args: str, timeout: float = 120) -> str:
        return run(["podman", *args], timeout=timeout, env=self.env)

    def exists(self, image: str) -> bool:
        result = subprocess.run(
            ["podman", "image", "exists", image], env=self.env, timeout=60, check=False
        )
        return result.returncode == 0


def _import_base(podman: Podman) -> None:
    """Imports the base tar unless this very tar is already the base image: a new import
    would be a new image, and the build's cached layers on it would be lost."""
    stamp = str(BASE_TAR.stat().st_mtime_ns)
    label = '{{index .Labels "devplug.test.base-tar"}}'
    imported = podman.exists(BASE_IMAGE)
    if imported and podman("image", "inspect", "--format", label, BASE_IMAGE).strip() == stamp:
        return
    changes = [
        f"--change={change}" for change in (*BASE_CHANGES, f"LABEL devplug.test.base-tar={stamp}")
    ]
    podman("import", *changes, str(BASE_TAR), BASE_IMAGE, timeout=300)


def prepare() -> Podman:
    """The podman of the cache dir, with the base image in it (made first if it is stale)."""
    if base_is_stale():
        _make_base_tar()
    podman = Podman(CACHE / "podman")
    _import_base(podman)
    return podman


def host_wheels(into: Path) -> None:
    """What the Dockerfile's wheels stage makes, made by this Python's pip: wheels of devplug
    (from the files that stage copies), of its dependencies and of pip, and their SHA256SUMS
    (as the stage writes it, naming /wheels/...), in ``into/wheels``."""
    source = into / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    wheels = into / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir"]
    run([*command, str(wheels), str(source), "pip"], timeout=600)
    shutil.rmtree(source)
    sums = (
        f"{hashlib.sha256(wheel.read_bytes()).hexdigest()}  /wheels/{wheel.name}\n"
        for wheel in sorted(wheels.glob("*.whl"))
    )
    (wheels / "SHA256SUMS").write_text("".join(sums))


def build(podman: Podman, wheels: Path) -> None:
    """The shipped Dockerfile built as IMAGE, on the local base, with ``wheels`` standing in
    for its wheels stage (a named build context replaces the stage of that name)."""
    podman(
        "build",
        "--pull=never",
        "--runtime",
        "runc",
        *ULIMITS,
        "--network",
        "host",
        "--build-arg",
        f"BASE={BASE_IMAGE}",
        "--build-context",
        f"wheels={wheels}",
        "--tag",
        IMAGE,
        "--file",
        str(ROOT / "Dockerfile"),
        str(ROOT),
        timeout=1200,
    )
    podman("image", "prune", "--force")  # the last build's image, now untagged
