"""The Kubernetes manifests validate strictly and keep the least-privilege settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in KUBE.glob("*/kustomization.yaml") if p.parent.name != "base")
# The oldest Kubernetes the manifests are meant for (device plugin CDI fields: 1.29+ GA 1.31).
VERSION = "1.31"


def objects() -> list[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object in the manifests (not kustomizations or devplug configs)."""
    found = []
    for path in sorted(KUBE.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "config.yaml"):
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
    assert len(stages) == 2 and stages[0].endswith(" AS build")
    assert "libudev1" in text and 'ENTRYPOINT ["devplug"]' in text
