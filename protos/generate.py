"""Regenerate the Python stubs from the .proto files: `python -m pdserve.protos.generate`.

The sources sit in `protos/` but install as `pdserve.protos`, so protoc sees them under the virtual path
`pdserve/protos/` (its `-Ivirtual=disk` form) and the stubs import each other as `pdserve.protos.*`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(f"pdserve/protos/{p.name}" for p in (ROOT / "protos").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under out_dir/pdserve/protos/."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-Ipdserve={ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        generate(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            for stub in (Path(tmp) / "pdserve" / "protos").iterdir():
                shutil.copyfile(stub, ROOT / "protos" / stub.name)
