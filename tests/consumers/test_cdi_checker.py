"""The CDI checker is a real check: it refuses what podman 4.3's CDI library (0.5.x) refuses.

Each case is a hand-written spec dir. Together they pin down the 0.5.2 behaviour devplug's
writer depends on: no spec-level annotations, no cdiVersion above 0.5.0, no unknown fields,
one bad file costing only its own devices, and which files in a spec dir the library reads at
all (subdirectories and files not ending in .json/.yaml are never read; hidden .json files
are).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cdi_library import (
    CHECKER_SOURCE,
    CheckResult,
    check_spec_dir,
    real_machine_env,
    require_checker,
)


@pytest.fixture(scope="module", autouse=True)
def _checker() -> Path:
    """Build once (or skip/fail, naming what to install) before any test here runs."""
    return require_checker()


def spec(kind: str, *devices: str, version: str = "0.5.0", **extra: Any) -> dict[str, Any]:
    """A spec whose devices each give the container one host node (``/dev/<name>``)."""
    return {
        "cdiVersion": version,
        "kind": kind,
        **extra,
        "devices": [
            {"name": name, "containerEdits": {"deviceNodes": [{"path": f"/dev/{name}"}]}}
            for name in devices
        ],
    }


def write(directory: Path, name: str, content: dict[str, Any] | str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def host_numbers(path: str) -> tuple[int, int]:
    rdev = os.stat(path).st_rdev
    return os.major(rdev), os.minor(rdev)


def only_error(result: CheckResult, path: Path) -> str:
    assert list(result.errors) == [str(path)], result
    (error,) = result.errors[str(path)]
    return error


def test_a_valid_0_5_0_spec_loads_resolves_and_injects_host_nodes(tmp_path: Path) -> None:
    path = write(tmp_path, "example.com-mem.json", spec("example.com/mem", "null", "zero"))
    result = check_spec_dir(tmp_path, ["example.com/mem=null", "example.com/mem=zero"])
    assert result.ok, result
    assert result.errors == {}
    assert result.devices == ("example.com/mem=null", "example.com/mem=zero")
    loaded = result.specs[str(path)]
    assert (loaded.kind, loaded.cdi_version, loaded.devices) == (
        "example.com/mem",
        "0.5.0",
        ("null", "zero"),
    )
    # The spec gives neither type nor numbers: the library takes them from the host node, as
    # it does for podman.
    assert [(n.path, n.type, n.major, n.minor) for n in result.injected] == [
        ("/dev/null", "c", *host_numbers("/dev/null")),
        ("/dev/zero", "c", *host_numbers("/dev/zero")),
    ]


def test_spec_level_annotations_are_refused_at_0_5_0(tmp_path: Path) -> None:
    # The CDI spec added annotations in 0.6.0; 0.5.x's strict decoding has no such field.
    annotated = spec("example.com/mem", "null", annotations={"devplug.io/managed-by": "devplug"})
    path = write(tmp_path, "example.com-mem.json", annotated)
    result = check_spec_dir(tmp_path, ["example.com/mem=null"])
    assert not result.ok
    assert 'unknown field "annotations"' in only_error(result, path)
    # The whole file is lost: this is podman's "unresolvable CDI devices".
    assert result.devices == ()
    assert result.unresolved == ("example.com/mem=null",)
    assert "unresolvable CDI devices example.com/mem=null" in result.inject_error


def test_cdi_version_0_6_0_is_unknown_to_0_5_2(tmp_path: Path) -> None:
    # Even without any 0.6.0 feature in it: 0.5.2 knows versions 0.1.0 to 0.5.0 only.
    path = write(tmp_path, "example.com-mem.json", spec("example.com/mem", "null", version="0.6.0"))
    result = check_spec_dir(tmp_path, ["example.com/mem=null"])
    assert not result.ok
    assert 'invalid version "0.6.0"' in only_error(result, path)
    assert result.unresolved == ("example.com/mem=null",)


def test_an_unknown_field_is_refused(tmp_path: Path) -> None:
    document = spec("example.com/mem", "null")
    document["devices"][0]["containerEdits"]["deviceNodes"][0]["owner"] = "devplug"
    path = write(tmp_path, "example.com-mem.json", document)
    result = check_spec_dir(tmp_path)
    assert not result.ok
    assert 'unknown field "owner"' in only_error(result, path)
    assert result.devices == ()


def test_file_mode_and_owner_are_0_3_0_fields_handed_to_the_runtime(tmp_path: Path) -> None:
    # A node's fileMode, uid and gid: known fields at the lowest version (strict decoding
    # takes them), given to the runtime as they are. A node without them gets none: the
    # library fills in only type and numbers, and runc makes such a node 0666, root's.
    document = spec("example.com/mem", "null", "zero", version="0.3.0")
    document["devices"][0]["containerEdits"]["deviceNodes"][0].update(fileMode=0o600, uid=7, gid=5)
    path = write(tmp_path, "example.com-mem.json", document)
    result = check_spec_dir(tmp_path, ["example.com/mem=null", "example.com/mem=zero"])
    assert result.ok, result
    assert result.specs[str(path)].cdi_version == "0.3.0"
    assert [(n.path, n.file_mode, n.uid, n.gid) for n in result.injected] == [
        ("/dev/null", 0o600, 7, 5),
        ("/dev/zero", None, None, None),
    ]


def test_an_unresolvable_name_is_reported(tmp_path: Path) -> None:
    write(tmp_path, "example.com-mem.json", spec("example.com/mem", "null"))
    result = check_spec_dir(tmp_path, ["example.com/mem=null", "example.com/mem=missing"])
    assert not result.ok
    assert result.errors == {}  # every file loads; only the name is wrong
    assert result.unresolved == ("example.com/mem=missing",)
    assert "unresolvable CDI devices" in result.inject_error
    assert result.injected == ()  # nothing is injected when one name fails


def test_a_bad_file_costs_only_its_own_devices(tmp_path: Path) -> None:
    bad = write(tmp_path, "other.example-x.json", spec("other.example/x", "a", version="0.6.0"))
    write(tmp_path, "example.com-mem.json", spec("example.com/mem", "null"))
    result = check_spec_dir(tmp_path, ["example.com/mem=null"])
    assert list(result.errors) == [str(bad)]
    assert result.devices == ("example.com/mem=null",)
    assert result.unresolved == ()
    assert not result.ok  # the dir has a rejected file, so the check as a whole fails


def test_two_files_defining_one_device_lose_it(tmp_path: Path) -> None:
    # The same kind and device in two files of one dir is a conflict: neither file's copy is
    # used. A writer must never leave an old and a new spec of one kind side by side.
    first = write(tmp_path, "example.com-mem.json", spec("example.com/mem", "null"))
    second = write(tmp_path, "old-example.com-mem.json", spec("example.com/mem", "null"))
    result = check_spec_dir(tmp_path, ["example.com/mem=null"])
    assert set(result.errors) == {str(first), str(second)}
    assert all("conflicting device" in e for errs in result.errors.values() for e in errs)
    assert result.unresolved == ("example.com/mem=null",)


def test_subdirectories_and_non_spec_names_are_never_read(tmp_path: Path) -> None:
    # 0.5.2's scanSpecDirs (pkg/cdi/spec-dirs.go) returns filepath.SkipDir for every directory
    # below the spec dir and ignores names not ending in .json or .yaml: devplug's .devplug/
    # bookkeeping and its temp files are invisible to podman, even when they are not specs.
    write(tmp_path, "example.com-mem.json", spec("example.com/mem", "null"))
    write(tmp_path, ".devplug/example.com-mem.json", "not a spec")
    write(tmp_path, ".devplug/deeper/x.yaml", "not: [a spec")
    write(tmp_path, ".devplug-tmp-1234", "half a spec")
    write(tmp_path, "example.com-mem.json.tmp", "{")
    write(tmp_path, "README", "hello")
    result = check_spec_dir(tmp_path, ["example.com/mem=null"])
    assert result.ok, result
    assert list(result.specs) == [str(tmp_path / "example.com-mem.json")]


def test_hidden_json_files_are_read(tmp_path: Path) -> None:
    # Only the suffix counts: a leading dot does not hide a file from the library, so a
    # writer's temp or bookkeeping files in the spec dir itself must not end in .json/.yaml.
    write(tmp_path, "example.com-mem.json", spec("example.com/mem", "null"))
    hidden = write(tmp_path, ".devplug-state.json", {"owner": "devplug"})
    result = check_spec_dir(tmp_path)
    assert list(result.errors) == [str(hidden)]
    assert result.devices == ("example.com/mem=null",)


def test_yaml_specs_are_read_too(tmp_path: Path) -> None:
    write(
        tmp_path,
        "example.com-mem.yaml",
        "cdiVersion: 0.5.0\nkind: example.com/mem\ndevices:\n"
        "- name: zero\n  containerEdits:\n    deviceNodes: [{path: /dev/zero}]\n",
    )
    result = check_spec_dir(tmp_path, ["example.com/mem=zero"])
    assert result.ok, result
    assert [n.path for n in result.injected] == ["/dev/zero"]


def test_a_missing_dir_is_an_error_not_an_empty_pass(tmp_path: Path) -> None:
    # The library skips a missing spec dir silently; the checker must not pass a check of
    # nothing.
    with pytest.raises(RuntimeError, match="is not a directory"):
        check_spec_dir(tmp_path / "absent")


def test_the_checker_source_is_gofmt_clean() -> None:
    gofmt = shutil.which("gofmt")
    assert gofmt is not None  # installed with go, which _checker required
    result = subprocess.run(
        [gofmt, "-l", "-d", str(CHECKER_SOURCE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=real_machine_env(),
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
