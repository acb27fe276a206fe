"""Regenerate the Python stubs in src/devplug/_proto from the .proto files in proto/.

Run from anywhere: ``python scripts/gen_proto.py`` (needs the ``test`` extra: grpcio-tools and
mypy-protobuf). The generated gRPC modules import their message module as a top-level module;
that import is rewritten to a package-relative import so the stubs live inside ``devplug._proto``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "src" / "devplug" / "_proto"
# The device plugin API; the DRA plugin API, v1 and v1beta1; the plugin registration API;
# the pod resources API.
PROTO_NAMES = (
    "deviceplugin_v1beta1",
    "dra_v1",
    "dra_v1beta1",
    "pluginregistration_v1",
    "podresources_v1",
)


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={Path(sys.executable).parent / 'protoc-gen-mypy'}",
        f"--mypy_out={out_dir}",
        f"--plugin=protoc-gen-mypy_grpc={Path(sys.executable).parent / 'protoc-gen-mypy_grpc'}",
        f"--mypy_grpc_out={out_dir}",
        *(str(PROTO_DIR / f"{name}.proto") for name in PROTO_NAMES),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for name in PROTO_NAMES:
        for suffix in (".py", ".pyi"):
            grpc_module = out_dir / f"{name}_pb2_grpc{suffix}"
            text = grpc_module.read_text()
            text = text.replace(
                f"import {name}_pb2 as", f"from devplug._proto import {name}_pb2 as"
            )
            grpc_module.write_text(text)
    init = out_dir / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC stubs: see scripts/gen_proto.py."""\n')


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR)
