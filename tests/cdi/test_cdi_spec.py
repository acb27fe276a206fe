"""The CDI spec model: every validation rule, the minimum cdiVersion, the JSON runtimes read."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from devplug.cdi.spec import (
    CURRENT_VERSION,
    VERSIONS,
    ContainerEdits,
    DeviceNodeEdit,
    HookEdit,
    MountEdit,
    Spec,
    SpecDevice,
    minimum_version,
    spec_document,
    spec_json,
    spec_problems,
    validate_spec,
)
from devplug.errors import CdiSpecError

KIND = "example.com/gpu"
ENV = ContainerEdits(env=("A=1",))
DEV = "devices['gpu0']"
EDITS = f"{DEV}.containerEdits"


def device(
    name: str = "gpu0",
    edits: ContainerEdits = ENV,
    annotations: Mapping[str, str] | None = None,
) -> SpecDevice:
    return SpecDevice(name, edits, annotations or {})


def spec(
    *devices: SpecDevice,
    kind: str = KIND,
    edits: ContainerEdits | None = None,
    annotations: Mapping[str, str] | None = None,
) -> Spec:
    return Spec(kind, devices or (device(),), edits, annotations or {})


def one(edits: ContainerEdits) -> Spec:
    """A spec whose only device gets ``edits``."""
    return spec(device(edits=edits))


def node(path: str = "/dev/gpu0", /, **fields: object) -> ContainerEdits:
    return ContainerEdits(device_nodes=(DeviceNodeEdit(path, **fields),))  # type: ignore[arg-type]


def mount(
    host: str = "/usr/lib/x", container: str = "/usr/lib/x", **fields: object
) -> ContainerEdits:
    return ContainerEdits(mounts=(MountEdit(host, container, **fields),))  # type: ignore[arg-type]


def hook(
    name: str = "createContainer", path: str = "/usr/bin/hook", **fields: object
) -> ContainerEdits:
    return ContainerEdits(hooks=(HookEdit(name, path, **fields),))  # type: ignore[arg-type]


def assert_only_problem(s: Spec, *words: str) -> None:
    """``s`` breaks exactly one rule, and the message holds every one of ``words``."""
    problems = spec_problems(s)
    assert len(problems) == 1, problems
    for word in words:
        assert word in problems[0], (word, problems[0])
    with pytest.raises(CdiSpecError, match="invalid CDI spec for kind") as caught:
        validate_spec(s)
    assert problems[0] in str(caught.value)


def assert_valid(s: Spec) -> None:
    assert spec_problems(s) == []
    validate_spec(s)


# ------------------------------------------------------------------------- kind and devices


def test_minimal_spec_is_valid() -> None:
    assert_valid(spec())


@pytest.mark.parametrize("kind", ["example.com", "1example.com/gpu", "example.com/gp:u", "a/b/c"])
def test_kind_must_be_valid(kind: str) -> None:
    assert_only_problem(spec(kind=kind), "kind: invalid kind", repr(kind))


def test_spec_without_devices_is_refused() -> None:
    s = Spec(KIND, ())
    assert spec_problems(s) == ["devices: invalid spec, no devices"]
    with pytest.raises(CdiSpecError, match="no devices"):
        validate_spec(s)


@pytest.mark.parametrize("name", ["gpu0", "0", "0000:03:00.0", "a.b_c-d:e"])
def test_valid_device_names(name: str) -> None:
    assert_valid(spec(device(name)))


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("", "empty device name"),
        ("-gpu", "must start and end with a letter or digit"),
        ("gpu:", "must start and end with a letter or digit"),
        ("gpu/0", "must start and end with a letter or digit"),
    ],
)
def test_invalid_device_names(name: str, words: str) -> None:
    assert_only_problem(spec(device(name)), f"devices[{name!r}]", words)


def test_duplicate_device_names_are_refused() -> None:
    s = spec(device("gpu0"), device("gpu1"), device("gpu0", ContainerEdits(env=("B=2",))))
    assert_only_problem(s, DEV, "multiple device 'gpu0'")


def test_device_with_empty_edits_is_refused() -> None:
    s = spec(device("gpu0"), device("gpu1", ContainerEdits()))
    assert_only_problem(s, "devices['gpu1']", "empty device edits")


@pytest.mark.parametrize(
    "edits",
    [
        ContainerEdits(env=("A=1",)),
        node(),
        mount(),
        hook(),
        ContainerEdits(additional_gids=(44,)),
    ],
    ids=["env", "node", "mount", "hook", "gids"],
)
def test_any_one_edit_makes_a_device_non_empty(edits: ContainerEdits) -> None:
    assert not edits.empty
    assert_valid(one(edits))


def test_spec_level_edits_may_be_empty() -> None:
    assert_valid(spec(edits=ContainerEdits()))


# ------------------------------------------------------------------------- env


@pytest.mark.parametrize("entry", ["A=1", "A=", "A==b", "a.b-c=x y", "_=1"])
def test_valid_env_entries(entry: str) -> None:
    assert_valid(one(ContainerEdits(env=(entry,))))
    assert_valid(spec(edits=ContainerEdits(env=(entry,))))


@pytest.mark.parametrize("entry", ["", "A", "=A", "=", "A=\0"])
def test_invalid_env_entries(entry: str) -> None:
    assert_only_problem(
        one(ContainerEdits(env=(entry,))),
        f"{EDITS}.env: invalid environment variable {entry!r}",
    )


def test_invalid_spec_level_env_names_the_spec_edits() -> None:
    problems = spec_problems(spec(edits=ContainerEdits(env=("NOEQUALS",))))
    assert problems == [
        "containerEdits.env: invalid environment variable 'NOEQUALS' (want NAME=value)"
    ]


# ------------------------------------------------------------------------- device nodes


def test_fully_specified_device_node_is_valid() -> None:
    edits = node(
        "/dev/dri/card0",
        host_path="/dev/dri/card1",
        type="c",
        major=226,
        minor=0,
        file_mode=0o660,
        permissions="rwm",
        uid=0,
        gid=44,
    )
    assert_valid(one(edits))


def test_empty_device_path_is_refused() -> None:
    assert_only_problem(one(node("")), f"{EDITS}.deviceNodes: invalid (empty) device path")


@pytest.mark.parametrize("path", ["/", "/dev/x", "/dev/dri/by-path/pci-0000:03:00.0-card"])
def test_absolute_normalised_device_paths(path: str) -> None:
    assert_valid(one(node(path)))


@pytest.mark.parametrize(
    "path", ["dev/x", "x", "/dev/../x", "/dev/x/", "/dev/./x", "/dev//x", "/dev/x/..", "/dev/\0"]
)
def test_device_path_must_be_absolute_and_normalised(path: str) -> None:
    assert_only_problem(
        one(node(path)), f"{EDITS}.deviceNodes[{path!r}]: path must be absolute and normalised"
    )


@pytest.mark.parametrize("host_path", ["", "dev/x", "/dev/../x", "/dev/x/"])
def test_host_path_must_be_absolute_and_normalised(host_path: str) -> None:
    assert_only_problem(
        one(node("/dev/x", host_path=host_path)),
        f"{EDITS}.deviceNodes['/dev/x']: hostPath must be absolute and normalised",
        repr(host_path),
    )


@pytest.mark.parametrize("kind", ["b", "c", "u", "p", None])
def test_valid_device_types(kind: str | None) -> None:
    assert_valid(one(node(type=kind)))


@pytest.mark.parametrize("kind", ["x", "C", "cb", "block"])
def test_invalid_device_types(kind: str) -> None:
    assert_only_problem(one(node(type=kind)), "deviceNodes['/dev/gpu0']", f"invalid type {kind!r}")


@pytest.mark.parametrize("what", ["major", "minor"])
def test_device_numbers_must_not_be_negative(what: str) -> None:
    assert_valid(one(node(**{what: 0})))
    assert_valid(one(node(**{what: 4095})))
    assert_only_problem(
        one(node(**{what: -1})), "deviceNodes['/dev/gpu0']", f"invalid (negative) {what} number -1"
    )


@pytest.mark.parametrize("permissions", ["r", "w", "m", "rw", "rwm", "mwr", "rr", None])
def test_valid_permissions(permissions: str | None) -> None:
    assert_valid(one(node(permissions=permissions)))


@pytest.mark.parametrize("permissions", ["", "x", "rwx", "R", "r w", "rw-"])
def test_invalid_permissions(permissions: str) -> None:
    assert_only_problem(
        one(node(permissions=permissions)),
        "deviceNodes['/dev/gpu0']",
        f"invalid permissions {permissions!r}",
    )


@pytest.mark.parametrize("what", ["uid", "gid"])
def test_owner_ids_are_uint32(what: str) -> None:
    assert_valid(one(node(**{what: 0})))
    assert_valid(one(node(**{what: 2**32 - 1})))
    for bad in (-1, 2**32):
        assert_only_problem(
            one(node(**{what: bad})), "deviceNodes['/dev/gpu0']", f"{what} {bad} out of range"
        )


@pytest.mark.parametrize("file_mode", [0, 0o600, 0o644, 0o660, 0o777])
def test_file_modes_are_permission_bits(file_mode: int) -> None:
    assert_valid(one(node(file_mode=file_mode)))


@pytest.mark.parametrize(
    ("file_mode", "shown"),
    [(-1, "-0o1"), (0o1000, "0o1000"), (0o4755, "0o4755"), (0o20666, "0o20666")],
    ids=["negative", "sticky", "setuid", "type-bits"],
)
def test_file_mode_with_more_than_permission_bits_is_refused(file_mode: int, shown: str) -> None:
    # Go's os.FileMode does not read type or special bits as Unix does: refused, not guessed.
    assert_only_problem(
        one(node(file_mode=file_mode)),
        "deviceNodes['/dev/gpu0']",
        f"fileMode {shown} is not permission bits (0 to 0o777)",
    )


# ------------------------------------------------------------------------- mounts


@pytest.mark.parametrize(
    ("host", "container", "fields"),
    [
        ("/usr/lib/x", "/usr/lib/x", {}),
        ("/host/a", "/container/b", {"options": ("ro", "nosuid", "nodev", "bind")}),
        ("tmpfs", "/scratch", {"type": "tmpfs", "options": ("size=1m",)}),
    ],
)
def test_valid_mounts(host: str, container: str, fields: dict[str, object]) -> None:
    assert_valid(one(mount(host, container, **fields)))


def test_mount_needs_a_host_path() -> None:
    assert_only_problem(one(mount("", "/x")), f"{EDITS}.mounts: invalid mount, empty host path")


def test_mount_needs_a_container_path() -> None:
    assert_only_problem(
        one(mount("/x", "")), f"{EDITS}.mounts: invalid mount, empty container path"
    )


@pytest.mark.parametrize("container", ["x", "usr/lib", "/usr/../etc", "/usr/lib/"])
def test_mount_container_path_must_be_absolute(container: str) -> None:
    assert_only_problem(
        one(mount("/x", container)),
        f"{EDITS}.mounts[{container!r}]: containerPath must be absolute and normalised",
    )


@pytest.mark.parametrize("options", [("",), ("ro,nosuid",), ("ro", "")])
def test_mount_options_are_single_non_empty_words(options: tuple[str, ...]) -> None:
    assert_only_problem(one(mount(options=options)), "mounts['/usr/lib/x']", "invalid options")


# ------------------------------------------------------------------------- hooks


@pytest.mark.parametrize(
    "name",
    ["prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"],
)
def test_every_hook_name_the_library_knows(name: str) -> None:
    assert_valid(one(hook(name)))


@pytest.mark.parametrize("name", ["", "preStart", "CreateContainer", "poststop ", "prestop"])
def test_unknown_hook_names_are_refused(name: str) -> None:
    assert_only_problem(one(hook(name)), f"{EDITS}.hooks: invalid hook name {name!r}")


def test_fully_specified_hook_is_valid() -> None:
    edits = hook(args=("hook", "--x"), env=("A=1", "B="), timeout=1)
    assert_valid(one(edits))
    assert_valid(spec(edits=edits))


def test_hook_needs_a_path() -> None:
    assert_only_problem(
        one(hook(path="")), f"{EDITS}.hooks['createContainer']: invalid hook with empty path"
    )


@pytest.mark.parametrize("path", ["hook", "bin/hook", "/usr/bin/../hook"])
def test_hook_path_must_be_absolute(path: str) -> None:
    assert_only_problem(
        one(hook(path=path)), f"{EDITS}.hooks['createContainer']: path must be absolute"
    )


@pytest.mark.parametrize("entry", ["X", "=X", ""])
def test_hook_env_follows_the_env_rule(entry: str) -> None:
    assert_only_problem(
        one(hook(env=(entry,))),
        f"{EDITS}.hooks['createContainer'].env: invalid environment variable {entry!r}",
    )


@pytest.mark.parametrize("timeout", [1, 30, None])
def test_valid_hook_timeouts(timeout: int | None) -> None:
    assert_valid(one(hook(timeout=timeout)))


@pytest.mark.parametrize("timeout", [0, -1])
def test_hook_timeout_must_be_positive(timeout: int) -> None:
    assert_only_problem(
        one(hook(timeout=timeout)),
        "hooks['createContainer']: timeout must be a positive number",
        f"got {timeout}",
    )


# ------------------------------------------------------------------------- additional gids


def test_additional_gids_are_uint32() -> None:
    assert_valid(one(ContainerEdits(additional_gids=(0, 44, 2**32 - 1))))
    for bad in (-1, 2**32):
        assert_only_problem(
            one(ContainerEdits(additional_gids=(44, bad))),
            f"{EDITS}.additionalGids: {bad} out of range",
        )


# ------------------------------------------------------------------------- annotations


@pytest.mark.parametrize(
    "key",
    [
        "key",
        "k",
        "Key_1.x-Y",
        "devplug.io/managed-by",
        "Example.COM/Key",  # checked lower-cased
        "a-b.c/d",
        "a" * 253 + "/k",
        "example.com/" + "n" * 63,
        "n" * 63,
    ],
)
def test_valid_annotation_keys(key: str) -> None:
    assert_valid(spec(annotations={key: "v"}))
    assert_valid(spec(device(annotations={key: "v"})))


@pytest.mark.parametrize(
    "key",
    [
        "",
        "a/b/c",
        "/name",
        "example.com/",
        "-key",
        "key-",
        "_key",
        "key.",
        "ke y",
        "key:x",
        "exa_mple.com/key",
        "-example.com/key",
        "example.com./key",
        "a" * 254 + "/k",
        "example.com/" + "n" * 64,
        "n" * 64,
        "ké",
    ],
)
def test_invalid_annotation_keys(key: str) -> None:
    assert_only_problem(spec(annotations={key: "v"}), f"spec.annotations: invalid key {key!r}")
    assert_only_problem(
        spec(device(annotations={key: "v"})), f"{DEV}.annotations: invalid key {key!r}"
    )


def test_annotations_may_total_256_kib() -> None:
    limit = 256 * 1024
    fits = {"k": "v" * (limit - 1)}
    assert_valid(spec(annotations=fits))
    assert_valid(spec(device(annotations=fits)))
    two = {"a": "x" * 1000, "b": "y" * (limit - 1002)}
    assert_valid(spec(annotations=two))


def test_annotations_larger_than_256_kib_are_refused() -> None:
    limit = 256 * 1024
    too_big = {"a": "x" * 1000, "b": "y" * (limit - 1001)}  # one byte over
    assert_only_problem(
        spec(annotations=too_big), "spec.annotations: size 262145 is larger than the limit 262144"
    )
    assert_only_problem(spec(device(annotations=too_big)), f"{DEV}.annotations: size 262145")


def test_annotation_size_counts_utf8_bytes() -> None:
    value = "é" * (128 * 1024)  # 128 Ki characters, 256 KiB of UTF-8
    assert_only_problem(spec(annotations={"k": value}), "spec.annotations: size")


@pytest.mark.parametrize("key", ["key\n", "example.com\n/key"])
def test_annotation_key_with_a_trailing_newline_is_refused(key: str) -> None:
    assert_only_problem(spec(annotations={key: "v"}), "invalid key")


# ------------------------------------------------------------------------- validate_spec


def test_validate_spec_lists_the_first_five_problems() -> None:
    edits = ContainerEdits(env=("1", "2", "3", "4", "5", "6", "7"))
    with pytest.raises(CdiSpecError) as caught:
        validate_spec(one(edits))
    message = str(caught.value)
    assert message.startswith("invalid CDI spec for kind 'example.com/gpu': ")
    for shown in "12345":
        assert f"invalid environment variable {shown!r}" in message
    assert "'6'" not in message and "'7'" not in message
    assert message.endswith(" (and 2 more)")


def test_every_problem_is_reported() -> None:
    s = Spec(
        "bad",
        (
            SpecDevice("-x", ContainerEdits()),
            SpecDevice("gpu0", node("dev/x", permissions="q")),
        ),
        ContainerEdits(hooks=(HookEdit("nope", "/h"),)),
        {"bad key": "v"},
    )
    problems = spec_problems(s)
    assert len(problems) == 7, problems
    expected_starts = [
        "kind: invalid kind 'bad'",
        "devices['-x']: device name '-x'",
        "devices['-x']: invalid device, empty device edits",
        "devices['gpu0'].containerEdits.deviceNodes['dev/x']: path must be absolute",
        "devices['gpu0'].containerEdits.deviceNodes['dev/x']: invalid permissions 'q'",
        "containerEdits.hooks: invalid hook name 'nope'",
        "spec.annotations: invalid key 'bad key'",
    ]
    for start in expected_starts:  # in any order
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)


# ------------------------------------------------------------------------- minimum version


def test_known_versions() -> None:
    assert VERSIONS == ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
    assert CURRENT_VERSION == "1.1.0"


def test_plain_spec_needs_0_3_0() -> None:
    edits = ContainerEdits(
        env=("A=1",),
        device_nodes=(DeviceNodeEdit("/dev/x", type="c", major=1, minor=2, permissions="rw"),),
        mounts=(MountEdit("/a", "/b", ("ro",)),),
        hooks=(HookEdit("createContainer", "/h", timeout=5),),
    )
    assert minimum_version(spec(device(edits=edits), kind="vendor.example.com/gpu")) == "0.3.0"


@pytest.mark.parametrize(
    ("s", "version"),
    [
        (one(mount(type="tmpfs")), "0.4.0"),
        (spec(edits=mount(type="bind")), "0.4.0"),
        (one(mount(type="")), "0.3.0"),
        (one(node("/dev/x", host_path="/dev/y")), "0.5.0"),
        (one(node("/dev/x", host_path="/dev/x")), "0.5.0"),  # given is given
        (spec(edits=node("/dev/x", host_path="/dev/y")), "0.5.0"),
        (spec(device("0gpu")), "0.5.0"),
        (spec(device("gpu0"), device("0000:03:00.0")), "0.5.0"),
        (spec(annotations={"a": "b"}), "0.6.0"),
        (spec(device(annotations={"a": "b"})), "0.6.0"),
        (spec(kind="example.com/gpu.x"), "0.6.0"),
        (spec(kind="example.com/gpu"), "0.3.0"),  # a "." in the vendor is old
        (one(ContainerEdits(additional_gids=(44,))), "0.7.0"),
        (spec(edits=ContainerEdits(additional_gids=(44,))), "0.7.0"),
        # Fields of 0.3.0: neither library generation raises the version for them, and the
        # 0.5.x library (Debian 12's podman 4.3) refuses any version above 0.5.0.
        (one(node("/dev/x", file_mode=0o600, uid=0, gid=44)), "0.3.0"),
        (spec(edits=node("/dev/x", file_mode=0o644, gid=0)), "0.3.0"),
    ],
    ids=[
        "mount-type",
        "spec-mount-type",
        "empty-mount-type",
        "host-path",
        "host-path-equal",
        "spec-host-path",
        "digit-name",
        "one-digit-name",
        "spec-annotations",
        "device-annotations",
        "dot-in-class",
        "dot-in-vendor",
        "gids",
        "spec-gids",
        "file-mode-and-owner",
        "spec-file-mode-and-owner",
    ],
)
def test_each_trigger_alone(s: Spec, version: str) -> None:
    assert minimum_version(s) == version
    assert spec_document(s)["cdiVersion"] == version


def test_combined_triggers_take_the_highest() -> None:
    mount_type = mount(type="tmpfs").mounts
    host_path = node("/dev/x", host_path="/dev/y").device_nodes
    gids = (44,)

    assert minimum_version(one(ContainerEdits(mounts=mount_type, device_nodes=host_path))) == (
        "0.5.0"
    )
    assert minimum_version(spec(device("0gpu", mount(type="tmpfs")))) == "0.5.0"
    with_annotations = spec(
        device("0gpu", ContainerEdits(mounts=mount_type, device_nodes=host_path)),
        annotations={"a": "b"},
    )
    assert minimum_version(with_annotations) == "0.6.0"
    assert minimum_version(spec(device("0gpu"), kind="example.com/gpu.x")) == "0.6.0"
    everything = spec(
        device(
            "0gpu",
            ContainerEdits(mounts=mount_type, device_nodes=host_path, additional_gids=gids),
            {"a": "b"},
        ),
        kind="example.com/gpu.x",
        annotations={"c": "d"},
    )
    assert minimum_version(everything) == "0.7.0"
    # The order of the triggers does not matter: the highest wins.
    gids_first = spec(
        device("gpu0", ContainerEdits(additional_gids=gids)),
        device("0gpu", mount(type="tmpfs")),
    )
    assert minimum_version(gids_first) == "0.7.0"


# ------------------------------------------------------------------------- JSON


def test_spec_document_shape() -> None:
    s = Spec(
        kind="example.com/gpu",
        devices=(
            SpecDevice(
                "gpu0",
                ContainerEdits(
                    env=("A=1", "B=2"),
                    device_nodes=(
                        DeviceNodeEdit("/dev/gpu0"),
                        DeviceNodeEdit(
                            "/dev/dri/card0",
                            host_path="/dev/dri/card1",
                            type="c",
                            major=226,
                            minor=1,
                            permissions="rw",
                            uid=0,
                            gid=44,
                            file_mode=0o660,
                        ),
                    ),
                    mounts=(
                        MountEdit("/host/a", "/a"),
                        MountEdit("tmpfs", "/scratch", ("nosuid", "size=1m"), "tmpfs"),
                    ),
                    hooks=(
                        HookEdit("createContainer", "/usr/bin/hook"),
                        HookEdit("poststop", "/usr/bin/clean", ("clean", "-v"), ("X=1",), 10),
                    ),
                    additional_gids=(44, 107),
                ),
                {"example.com/device": "yes"},
            ),
            SpecDevice("gpu1", ContainerEdits(env=("A=2",))),
        ),
        edits=ContainerEdits(env=("SHARED=1",)),
        annotations={"example.com/spec": "yes"},
    )
    assert spec_document(s) == {
        "cdiVersion": "0.7.0",
        "kind": "example.com/gpu",
        "annotations": {"example.com/spec": "yes"},
        "devices": [
            {
                "name": "gpu0",
                "annotations": {"example.com/device": "yes"},
                "containerEdits": {
                    "env": ["A=1", "B=2"],
                    "deviceNodes": [
                        {"path": "/dev/gpu0"},
                        {
                            "path": "/dev/dri/card0",
                            "hostPath": "/dev/dri/card1",
                            "type": "c",
                            "major": 226,
                            "minor": 1,
                            "fileMode": 0o660,
                            "permissions": "rw",
                            "uid": 0,
                            "gid": 44,
                        },
                    ],
                    "mounts": [
                        {"hostPath": "/host/a", "containerPath": "/a"},
                        {
                            "hostPath": "tmpfs",
                            "containerPath": "/scratch",
                            "options": ["nosuid", "size=1m"],
                            "type": "tmpfs",
                        },
                    ],
                    "hooks": [
                        {"hookName": "createContainer", "path": "/usr/bin/hook"},
                        {
                            "hookName": "poststop",
                            "path": "/usr/bin/clean",
                            "args": ["clean", "-v"],
                            "env": ["X=1"],
                            "timeout": 10,
                        },
                    ],
                    "additionalGids": [44, 107],
                },
            },
            {"name": "gpu1", "containerEdits": {"env": ["A=2"]}},
        ],
        "containerEdits": {"env": ["SHARED=1"]},
    }


def test_spec_document_leaves_empty_fields_out() -> None:
    s = Spec(
        "example.com/gpu",
        (SpecDevice("gpu0", node("/dev/gpu0")),),
        edits=ContainerEdits(),
    )
    document = spec_document(s)
    assert document == {
        "cdiVersion": "0.3.0",
        "kind": "example.com/gpu",
        "devices": [{"name": "gpu0", "containerEdits": {"deviceNodes": [{"path": "/dev/gpu0"}]}}],
    }
    assert list(document) == ["cdiVersion", "kind", "devices"]


def test_spec_document_keeps_zero_numbers() -> None:
    s = one(node("/dev/x", major=0, minor=0, uid=0, gid=0, file_mode=0))
    nodes = spec_document(s)["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes == [{"path": "/dev/x", "major": 0, "minor": 0, "fileMode": 0, "uid": 0, "gid": 0}]


def test_spec_json_is_compact_and_ends_in_a_newline() -> None:
    s = spec(device("gpu0", node("/dev/gpu0", permissions="rw")), annotations={"a": "b"})
    assert spec_json(s) == (
        b'{"cdiVersion":"0.6.0","kind":"example.com/gpu","annotations":{"a":"b"},'
        b'"devices":[{"name":"gpu0","containerEdits":'
        b'{"deviceNodes":[{"path":"/dev/gpu0","permissions":"rw"}]}}]}\n'
    )


def test_spec_json_matches_the_document() -> None:
    s = spec(device("0000:03:00.0", mount("/a", "/b", options=("ro",))), device("gpu1"))
    text = spec_json(s)
    assert text.endswith(b"}\n") and text.count(b"\n") == 1
    assert b": " not in text and b", " not in text
    assert json.loads(text) == spec_document(s)


@pytest.mark.parametrize(
    "s",
    [
        Spec(KIND, ()),
        spec(kind="nokind"),
        one(ContainerEdits()),
        one(node("dev/x")),
        spec(annotations={"bad key": "v"}),
    ],
    ids=["no-devices", "kind", "empty-edits", "relative-node", "annotation"],
)
def test_spec_json_refuses_invalid_specs(s: Spec) -> None:
    with pytest.raises(CdiSpecError, match="invalid CDI spec"):
        spec_json(s)
