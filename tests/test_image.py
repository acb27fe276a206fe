"""The container image: the shipped Dockerfile built here, run as the DaemonSet runs it, and
checked for its size and for what its layers keep.

No registry or PyPI is reachable from a build here, so its two network inputs are stood in
for, the Dockerfile is not (tests/image_build.py says how). ``devplug scan`` then runs inside
it against the machine's real /sys and /dev, read-only, with a read-only root filesystem, no
capabilities and no network, and must find what the host's devplug finds.

Marked ``image``: ``-m image`` runs only these, ``-m "not image"`` leaves them out. They need
root, podman, runc and debootstrap (.ci/run installs them) and skip with the reason without
them; with ``CI=true`` they fail instead. Cold (no cache) the build takes a couple of minutes,
most of it debootstrap and apt; warm, seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from cdi_library import in_ci
from image_build import (
    BASE_IMAGE,
    IMAGE,
    ROOT,
    ULIMITS,
    Podman,
    build,
    cache_lock,
    host_wheels,
    prepare,
    run,
    why_it_cannot_build,
)

from devplug import __version__

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]

DEVPLUG = Path(sys.executable).with_name("devplug")
CONFIG = ROOT / "examples" / "dry-run.yaml"
SITE_PACKAGES = "opt/devplug/lib/python3.11/site-packages"
# python3 and libudev1 on debian:bookworm-slim (78 MB here), devplug and its dependencies in a
# virtual environment (grpcio alone is about 20 MB): measured at 173 MB, uncompressed.
MAX_IMAGE_BYTES = 200_000_000
# As the DaemonSet runs it: a read-only root, no capabilities, no way to gain any, and the
# host's /sys, /dev and /run/udev read-only (deploy/kubernetes/base/daemonset.yaml); no network.
RESTRICTED = (
    "--rm",
    "--network",
    "none",
    *ULIMITS,
    "--read-only",
    "--cap-drop",
    "all",
    "--security-opt",
    "no-new-privileges",
    "--volume",
    "/sys:/sys:ro",
    "--volume",
    "/dev:/dev:ro",
    # udev's database, where the host has one (the properties matches and ids read).
    *(("--volume", "/run/udev:/run/udev:ro") if Path("/run/udev").is_dir() else ()),
)


def unavailable(reason: str) -> NoReturn:
    """Skip, or under CI=true fail: CI must build and run the image."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: the image must be built and run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    """The podman holding IMAGE, built once for this module."""
    reason = why_it_cannot_build()
    if reason is not None:
        unavailable(reason)
    with cache_lock():
        try:
            engine = prepare()
            wheels = tmp_path_factory.mktemp("wheels")
            host_wheels(wheels)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            # The base (debootstrap, Debian's mirror) or the wheels (PyPI): this machine's
            # network or tools, not the Dockerfile.
            unavailable(f"the build's inputs could not be made here: {error}")
        build(engine, wheels)  # a failure here is the Dockerfile's: it fails the tests
        yield engine


def layer_entries(archive: Path) -> Iterator[tuple[str, str, int | None]]:
    """(layer, path, size of a regular file or None) of every entry of every layer of a
    ``podman save`` docker-archive."""
    with tarfile.open(archive) as outer:
        manifest_file = outer.extractfile("manifest.json")
        assert manifest_file is not None
        (manifest,) = json.load(manifest_file)
        for layer in manifest["Layers"]:
            inner_file = outer.extractfile(layer)
            assert inner_file is not None
            with tarfile.open(fileobj=inner_file) as inner:
                for member in inner:
                    size = member.size if member.isreg() else None
                    yield layer, member.name.removeprefix("./"), size


def leftover(path: str) -> str | None:
    """What a file in a layer is left over from, or None if it belongs in the image."""
    parts = path.rstrip("/").split("/")
    if parts[-1].startswith(".wh."):
        return None  # a whiteout: the layer deletes that path, it holds nothing
    if path.endswith(".whl") or parts[0] == "wheels":
        return "the wheels"
    if "/.cache/" in f"/{path}":
        return "a cache (pip's)"
    if path.startswith("var/lib/apt/lists/") and parts[-1] not in ("lists", "lock", "partial"):
        return "apt's package lists"
    if path.startswith("var/cache/apt/") and path.endswith((".bin", ".deb")):
        return "apt's package cache"
    if ".git" in parts:
        return "git"
    if parts[0] in ("src", "tests", "source", "build") or parts[-1] in (
        "pyproject.toml",
        ".dockerignore",
        "Dockerfile",
    ):
        return "the build context"
    if path.startswith(f"{SITE_PACKAGES}/pip/"):
        return "pip (the image installs with pip's wheel and keeps no pip)"
    return None


def test_devplug_scan_in_the_image_finds_the_hosts_devices(podman: Podman) -> None:
    """As the DaemonSet runs it (read-only root, no capabilities), against the real /sys."""
    in_image = podman(
        "run",
        *RESTRICTED,
        "--volume",
        f"{CONFIG}:/etc/devplug/config.yaml:ro",
        IMAGE,
        "scan",
        "--config",
        "/etc/devplug/config.yaml",
        "--output",
        "json",
    )
    found: dict[str, Any] = json.loads(in_image)
    on_host = json.loads(run([str(DEVPLUG), "scan", "--config", str(CONFIG), "-o", "json"], 60))
    ids = {resource: [d["id"] for d in devices] for resource, devices in found["resources"].items()}
    assert {"null", "zero"} <= set(ids["example.com/mem"]), ids
    assert found == on_host


def test_the_image_is_small_and_says_what_it_is(podman: Podman) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE))
    print(f"image size: {size / 1e6:.1f} MB")
    assert size < MAX_IMAGE_BYTES, f"{size / 1e6:.1f} MB"
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", IMAGE))
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["org.opencontainers.image.base.name"] == BASE_IMAGE
    assert labels["org.opencontainers.image.title"] == "devplug"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"


def test_no_layer_keeps_wheels_caches_lists_or_the_build_context(
    podman: Podman, tmp_path: Path
) -> None:
    """Every layer, the base's too: a file removed in a later layer still ships in its own."""
    archive = tmp_path / "image.tar"
    podman("image", "save", "--format", "docker-archive", "--output", str(archive), IMAGE)
    entries = [(layer, path) for layer, path, _ in layer_entries(archive)]
    found = [(layer, path, why) for layer, path in entries if (why := leftover(path))]
    assert not found, "\n".join(f"{layer}: {path} ({why})" for layer, path, why in found[:40])
    # What is there: this devplug in the virtual environment, and the record of its wheels.
    paths = {path.rstrip("/") for _, path in entries}
    assert f"{SITE_PACKAGES}/devplug-{__version__}.dist-info/METADATA" in paths
    assert "opt/devplug/wheels.sha256" in paths


def test_the_build_context_is_only_what_the_build_reads(podman: Podman, tmp_path: Path) -> None:
    """.dockerignore lets in pyproject.toml, README.md and src/ (no bytecode or egg-info):
    what the COPY lines read, and nothing of .venv, .git, caches or bench output."""
    probe = tmp_path / "Containerfile"
    probe.write_text("FROM scratch\nCOPY . /context/\n")
    image = "localhost/devplug-test/context:probe"
    archive = tmp_path / "context.tar"
    podman("build", "--tag", image, "--file", str(probe), str(ROOT), timeout=600)
    try:
        podman("image", "save", "--format", "docker-archive", "--output", str(archive), image)
    finally:
        podman("image", "rm", "--force", image)
    sizes = {
        path.removeprefix("context/"): size
        for _, path, size in layer_entries(archive)
        if path.startswith("context/") and size is not None
    }
    total = sum(sizes.values())
    print(f"build context: {len(sizes)} files, {total / 1e6:.2f} MB")
    assert {path.split("/")[0] for path in sizes} == {"pyproject.toml", "README.md", "src"}
    stray = [p for p in sizes if "__pycache__" in p or ".egg-info" in p or p.endswith(".pyc")]
    assert not stray, stray[:20]
    assert total < 5_000_000
