"""The Kubernetes manifests validate strictly and keep the least-privilege settings."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from devplug import __version__

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in KUBE.glob("*/kustomization.yaml") if p.parent.name != "base")
# The oldest Kubernetes the manifests are meant for (device plugin CDI fields: 1.29+ GA 1.31).
VERSION = "1.31"


# Partial objects that kustomize merges into the base, checked merged (below).
PATCH = "node-selector.yaml"


def objects() -> list[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object in the manifests (not kustomizations, devplug configs or
    patches)."""
    found = []
    for path in sorted(KUBE.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "config.yaml", PATCH):
            continue
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path, document))
    return found


def test_there_is_a_base_and_an_overlay_per_scanner() -> None:
    assert {p.name for p in OVERLAYS} == {"generic", "intel-gpu", "vfio"}
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
        assert kustomization["resources"] == ["../base"]
        (generator,) = kustomization["configMapGenerator"]
        assert generator["behavior"] == "replace" and generator["files"] == ["config.yaml"]
        assert (overlay / "config.yaml").exists()


@pytest.mark.parametrize(("path", "document"), objects(), ids=lambda v: getattr(v, "name", ""))
def test_every_object_validates_strictly(path: Path, document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, VERSION, strict=True)


@pytest.mark.parametrize("directory", [KUBE / "base", *OVERLAYS], ids=lambda p: p.name)
def test_the_generated_configmaps_validate(directory: Path) -> None:
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "devplug-config", "namespace": "kube-system"},
        "data": {"config.yaml": (directory / "config.yaml").read_text()},
    }
    kubernetes_validate.validate(config_map, VERSION, strict=True)


def test_the_daemonset_runs_with_least_privilege() -> None:
    daemonset = yaml.safe_load((KUBE / "base" / "daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}
    assert mounts == {
        "/var/lib/kubelet/device-plugins": False,
        "/var/run/cdi": False,
        "/sys": True,
        "/dev": True,
        "/run/udev": True,
        "/etc/devplug": True,
    }
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "--metrics-address=:9400" in container["args"]
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]


def test_the_dockerfile_is_clean_under_hadolint_at_warning_level() -> None:
    import shutil
    import subprocess
    import sys

    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_is_multi_stage_and_runs_devplug() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == ["FROM ${BASE} AS wheels", "FROM ${BASE}"]
    assert "libudev1" in text and 'ENTRYPOINT ["devplug"]' in text


def dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def test_the_image_base_is_pinned_by_digest_and_its_version_is_devplugs() -> None:
    """A tag alone (python:3.11-slim-bookworm) gives whatever the registry holds that day."""
    args = dockerfile_args()
    assert re.fullmatch(
        r"docker\.io/library/debian:bookworm-slim@sha256:[0-9a-f]{64}", args["BASE"]
    ), args["BASE"]
    assert args["VERSION"] == __version__
    text = (ROOT / "Dockerfile").read_text()
    for label in ("title", "description", "version", "licenses", "base.name"):
        assert f"org.opencontainers.image.{label}=" in text, label


def test_the_final_stage_reads_the_wheels_through_a_mount_and_copies_none() -> None:
    """COPY --from=wheels /wheels puts them in a layer, whatever a later RUN removes (the
    image test checks the layers of a real build; this is the cheap check)."""
    text = (ROOT / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM ") :]
    assert "--mount=type=bind,from=wheels,source=/wheels,target=/wheels" in final
    copies = [line for line in final.splitlines() if line.startswith("COPY")]
    assert copies == ["COPY --from=wheels /wheels/SHA256SUMS /opt/devplug/wheels.sha256"]


def test_the_build_context_is_an_allowlist() -> None:
    """Everything out, then what the COPY lines read back in (the image test measures it)."""
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    assert {line for line in lines if line.startswith("!")} == {
        "!pyproject.toml",
        "!README.md",
        "!src/",
    }
    text = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.MULTILINE)
    assert sorted(" ".join(copied).split()) == ["README.md", "pyproject.toml", "src"]


def base_daemonset() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((KUBE / "base" / "daemonset.yaml").read_text())
    return document


def merged(base: Any, patch: Any) -> Any:
    """A strategic merge patch of plain fields (maps merge, anything else is replaced)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {
            key: merged(base.get(key), patch.get(key, base.get(key))) for key in {*base, *patch}
        }
    return patch


def commented_patches(overlay: Path) -> list[dict[str, str]]:
    """The ``patches:`` an overlay's kustomization offers in comments, as they read uncommented."""
    text = (overlay / "kustomization.yaml").read_text()
    block = re.search(r"^# patches:\n(?:^#   .*\n?)+", text, flags=re.MULTILINE)
    assert block is not None, f"{overlay.name}: no commented patches: block"
    uncommented = "\n".join(line[2:] for line in block.group(0).splitlines())
    patches: list[dict[str, str]] = yaml.safe_load(uncommented)["patches"]
    return patches


@pytest.mark.parametrize("overlay", ["intel-gpu", "vfio"])
def test_the_node_selector_example_patches_the_daemonset_into_a_valid_one(overlay: str) -> None:
    """The GPU and VFIO overlays offer a nodeSelector: a patch of the base's DaemonSet (same kind
    and name, so kustomize applies it) that leaves a strictly valid DaemonSet selecting nodes by
    a label."""
    directory = KUBE / overlay
    assert commented_patches(directory) == [{"path": PATCH}]
    patch = yaml.safe_load((directory / PATCH).read_text())
    base = base_daemonset()
    assert (patch["kind"], patch["metadata"]["name"]) == (base["kind"], base["metadata"]["name"])
    daemonset = merged(base, patch)
    kubernetes_validate.validate(daemonset, VERSION, strict=True)
    selector = daemonset["spec"]["template"]["spec"]["nodeSelector"]
    assert selector and all(value == "true" for value in selector.values())
    assert (
        daemonset["spec"]["template"]["spec"]["containers"]
        == (base["spec"]["template"]["spec"]["containers"])
    )


@pytest.mark.parametrize("overlay", ["intel-gpu", "vfio"])
def test_kustomize_applies_the_node_selector_once_uncommented(overlay: str, tmp_path: Path) -> None:
    """The same through kustomize itself (kubectl's), where this machine has it."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its kustomize) is not installed; the merge is checked above")
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree)
    kustomization = tree / overlay / "kustomization.yaml"
    text = kustomization.read_text()
    kustomization.write_text(text.replace("# patches:\n#   - path:", "patches:\n  - path:"))
    result = subprocess.run(
        [kubectl, "kustomize", str(tree / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (daemonset,) = [d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "DaemonSet"]
    patch = yaml.safe_load((KUBE / overlay / PATCH).read_text())
    expected = patch["spec"]["template"]["spec"]["nodeSelector"]
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == expected
    kubernetes_validate.validate(daemonset, VERSION, strict=True)


def test_the_image_is_the_version_this_tree_builds() -> None:
    """``image: devplug:latest`` runs whatever a node last pulled; the tag is devplug's version,
    and the docs' build and import commands name the same one."""
    (container,) = base_daemonset()["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"devplug:{__version__}"
    for doc in (ROOT / "README.md", ROOT / "docs" / "deployment.md"):
        text = doc.read_text()
        tags = set(re.findall(r"\bdevplug:([0-9A-Za-z][\w.-]*)", text))
        tags |= set(re.findall(r'newTag: "([^"]*)"', text))
        assert tags == {__version__}, f"{doc.name} names devplug images {sorted(tags)}"


def test_every_shipped_generic_entry_takes_stable_ids() -> None:
    """Ids from node names (ttyUSB0) move when devices renumber; the shipped generic entries
    take theirs from ID_PATH, unique per port and interface."""
    entries = [
        (path.parent.name, entry)
        for path in sorted(KUBE.glob("*/config.yaml"))
        for entry in (yaml.safe_load(path.read_text())["scanners"].get("generic") or [])
    ]
    assert {name for name, _ in entries} >= {"base", "generic"}
    for name, entry in entries:
        assert entry.get("id_property") == "ID_PATH", f"{name}: {entry['resource']}"
