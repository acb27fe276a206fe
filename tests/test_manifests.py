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
DRA = KUBE / "dra"
DRA_PATCH = "daemonset-dra.yaml"
ON_DELETE = "on-delete.yaml"  # the DRA overlay's commented patch, for moving nodes one by one
# The DRA overlay serves resource.k8s.io/v1, Kubernetes 1.34+.
DRA_VERSIONS = ("1.34", "1.35", "1.36", "1.37")
SCANNER_OVERLAYS = [p for p in OVERLAYS if p != DRA]


def objects() -> list[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object in the manifests (not kustomizations, devplug configs or
    patches)."""
    found = []
    for path in sorted(KUBE.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "config.yaml", PATCH, DRA_PATCH, ON_DELETE):
            continue
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path, document))
    return found


def test_there_is_a_base_and_an_overlay_per_scanner() -> None:
    assert {p.name for p in OVERLAYS} == {"dra", "generic", "intel-gpu", "vfio"}
    for overlay in SCANNER_OVERLAYS:
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
        "/var/lib/kubelet/pod-resources": True,
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


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize directory``'s objects; the test skips where kubectl is missing."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its kustomize) is not installed; the merge is checked above")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@pytest.mark.parametrize("overlay", ["intel-gpu", "vfio"])
def test_kustomize_applies_the_node_selector_once_uncommented(overlay: str, tmp_path: Path) -> None:
    """The same through kustomize itself (kubectl's), where this machine has it."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree)
    kustomization = tree / overlay / "kustomization.yaml"
    text = kustomization.read_text()
    kustomization.write_text(text.replace("# patches:\n#   - path:", "patches:\n  - path:"))
    (daemonset,) = [d for d in kustomize(tree / overlay) if d["kind"] == "DaemonSet"]
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


# ------------------------------------------------------------------ the DRA overlay


def dra_documents(name: str) -> dict[str, dict[str, Any]]:
    """The objects of one of the DRA overlay's files, by kind."""
    return {d["kind"]: d for d in yaml.safe_load_all((DRA / name).read_text()) if d}


def strategic_merged(base: Any, patch: Any) -> Any:
    """:func:`merged`, with lists of objects merged by their merge key (containers, volumes
    and env by name, volumeMounts by mountPath), as kustomize merges a DaemonSet patch."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {
            key: strategic_merged(base.get(key), patch.get(key, base.get(key)))
            for key in {*base, *patch}
        }
    items = [*base, *patch] if isinstance(base, list) and isinstance(patch, list) else []
    if items and all(isinstance(item, dict) for item in items):
        key = next((k for k in ("mountPath", "name") if all(k in i for i in items)), None)
        if key is not None:
            patched = {item[key]: item for item in patch}
            kept = [strategic_merged(i, patched.pop(i[key], i)) for i in base]
            return list(patched.values()) + kept  # kustomize puts the new ones first
    return patch


def dra_daemonset() -> dict[str, Any]:
    patch = yaml.safe_load((DRA / DRA_PATCH).read_text())
    daemonset: dict[str, Any] = strategic_merged(base_daemonset(), patch)
    return daemonset


def test_the_dra_overlay_is_the_base_with_rbac_the_admission_policy_and_a_patch() -> None:
    kustomization = yaml.safe_load((DRA / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../base", "rbac.yaml", "admission-policy.yaml"]
    assert kustomization["patches"] == [{"path": DRA_PATCH}]
    (generator,) = kustomization["configMapGenerator"]
    assert generator["behavior"] == "replace" and generator["files"] == ["config.yaml"]
    patch = yaml.safe_load((DRA / DRA_PATCH).read_text())
    base = base_daemonset()
    assert (patch["kind"], patch["metadata"]["name"]) == (base["kind"], base["metadata"]["name"])


@pytest.mark.parametrize("version", DRA_VERSIONS)
def test_the_dra_objects_validate_strictly(version: str) -> None:
    for name in ("rbac.yaml", "admission-policy.yaml"):
        for document in dra_documents(name).values():
            kubernetes_validate.validate(document, version, strict=True)
    kubernetes_validate.validate(dra_daemonset(), version, strict=True)


def test_the_dra_daemonset_mounts_its_configs_kubelet_plugin_dirs_at_the_same_paths() -> None:
    """The kubelet dials the DRA socket at the path GetInfo gives: the one inside the pod."""
    dra = yaml.safe_load((DRA / "config.yaml").read_text())["dra"]
    root = dra["kubelet_root"]
    registry, plugin = f"{root}/plugins_registry", f"{root}/plugins/{dra['driver']}"
    pod = dra_daemonset()["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: host_paths.get(m["name"]) for m in container["volumeMounts"]}
    assert mounts[registry] == registry and mounts[plugin] == plugin
    types = {
        v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod["volumes"] if "hostPath" in v
    }
    assert types[registry] == "Directory"  # the kubelet's: a wrong root must not go unnoticed
    assert types[plugin] == "DirectoryOrCreate"  # devplug's own
    (node_name,) = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # Everything the base hardened is still there, the base's mounts included.
    (base,) = base_daemonset()["spec"]["template"]["spec"]["containers"]
    for field in ("image", "args", "securityContext", "livenessProbe", "readinessProbe"):
        assert container[field] == base[field], field
    assert {m["mountPath"] for m in base["volumeMounts"]} < set(mounts)


def test_the_dra_daemonset_runs_as_the_bound_service_account_one_pod_per_node() -> None:
    daemonset = dra_daemonset()
    pod = daemonset["spec"]["template"]["spec"]
    account = dra_documents("rbac.yaml")["ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    binding = dra_documents("rbac.yaml")["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    role = dra_documents("rbac.yaml")["ClusterRole"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }


def test_the_dra_role_is_the_narrowest_that_works() -> None:
    """The verbs the DRA front's API client uses (tests/dra/test_dra_rbac.py watches it call
    exactly these against the stand-in API server), and not one more."""
    role = dra_documents("rbac.yaml")["ClusterRole"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        ("resource.k8s.io", "resourceslices", "list"),
        ("resource.k8s.io", "resourceslices", "watch"),
        ("resource.k8s.io", "resourceslices", "create"),
        ("resource.k8s.io", "resourceslices", "update"),
        ("resource.k8s.io", "resourceslices", "delete"),
        ("resource.k8s.io", "resourceclaims", "get"),
        ("", "nodes", "get"),
    }
    assert not any("resourceNames" in rule or "nonResourceURLs" in rule for rule in role["rules"])


def test_the_admission_policy_pins_the_service_account_to_its_own_nodes_slices() -> None:
    documents = dra_documents("admission-policy.yaml")
    policy, binding = (
        documents["ValidatingAdmissionPolicy"],
        documents["ValidatingAdmissionPolicyBinding"],
    )
    account = dra_documents("rbac.yaml")["ServiceAccount"]["metadata"]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    assert spec["matchConstraints"].get("matchPolicy", "Equivalent") == "Equivalent"
    (condition,) = spec["matchConditions"]
    username = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    assert condition["expression"] == f"request.userInfo.username == '{username}'"
    variables = {v["name"]: " ".join(v["expression"].split()) for v in spec["variables"]}
    assert (
        "request.userInfo.extra['authentication.kubernetes.io/node-name'][0]"
        in (variables["callerNode"])
    )
    for side in ("oldObject", "object"):  # a DELETE has only the old object
        assert f"{side}.spec.nodeName" in variables["sliceNode"]
    for side in ("oldObject", "object"):
        assert f"{side}.spec.driver" in variables["sliceDriver"]
    driver = yaml.safe_load((DRA / "config.yaml").read_text())["dra"]["driver"]
    expressions = [v["expression"] for v in spec["validations"]]
    assert expressions == [
        "variables.callerNode != ''",
        "variables.sliceNode == variables.callerNode",
        f"variables.sliceDriver == '{driver}'",  # in step with the config's dra.driver
    ]
    # A denial is a 403, which devplug retries with back-off; without a reason the API server
    # answers 422 Invalid, the answer for a body that can never be stored.
    assert [v.get("reason") for v in spec["validations"]] == ["Forbidden"] * 3
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }


def test_kustomize_builds_the_dra_overlay(tmp_path: Path) -> None:
    """The overlay through kustomize itself (kubectl's), where this machine has it."""
    built = {d["kind"]: d for d in kustomize(DRA)}
    assert set(built) == {
        "ConfigMap",
        "DaemonSet",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    for document in built.values():
        for version in DRA_VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)
    # kustomize's merge is the one the tests above check (its ConfigMap name has a hash).
    daemonset = built["DaemonSet"]
    for volume in daemonset["spec"]["template"]["spec"]["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] == built["ConfigMap"]["metadata"]["name"]
            volume["configMap"]["name"] = "devplug-config"
    assert daemonset["spec"] == dra_daemonset()["spec"]
    namespace = built["DaemonSet"]["metadata"]["namespace"]
    assert built["ServiceAccount"]["metadata"]["namespace"] == namespace
    assert built["ClusterRoleBinding"]["subjects"][0]["namespace"] == namespace
    config = yaml.safe_load(built["ConfigMap"]["data"]["config.yaml"])
    assert config["dra"]["resources"] == ["gpu.intel.com/i915"]


def test_kustomize_applies_the_on_delete_patch_once_uncommented(tmp_path: Path) -> None:
    """Moving nodes to DRA one at a time: the DaemonSet replaces a pod only when it is deleted."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree)
    kustomization = tree / "dra" / "kustomization.yaml"
    text = kustomization.read_text()
    commented = f"  # - path: {ON_DELETE}\n"
    assert commented in text
    kustomization.write_text(text.replace(commented, f"  - path: {ON_DELETE}\n"))
    (daemonset,) = [d for d in kustomize(tree / "dra") if d["kind"] == "DaemonSet"]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    for version in DRA_VERSIONS:
        kubernetes_validate.validate(daemonset, version, strict=True)
