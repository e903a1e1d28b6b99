"""The checked-in stubs are exactly what `python -m pdserve.protos.generate` produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys

from pdserve.protos.generate import ROOT


def test_generated_stubs_are_current(tmp_path):
    # in a fresh interpreter: protoc and NIXL (loaded by earlier tests) each bundle protobuf's C++ runtime, and the
    # two cannot share one process
    subprocess.run([sys.executable, "-m", "pdserve.protos.generate", str(tmp_path)], check=True, timeout=300)
    fresh = sorted((tmp_path / "pdserve" / "protos").glob("*_pb2*.py*"))
    assert fresh, "protoc wrote nothing"
    for path in fresh:
        checked_in = ROOT / "protos" / path.name
        assert checked_in.is_file(), f"{path.name} missing: run python -m pdserve.protos.generate"
        assert checked_in.read_text() == path.read_text(), (
            f"{path.name} is stale: run python -m pdserve.protos.generate"
        )
    stale = {p.name for p in (ROOT / "protos").glob("*_pb2*.py*")} - {p.name for p in fresh}
    assert not stale, f"stubs without a .proto: {stale}"


def test_stubs_import_as_protos_package():
    from pdserve.protos import generation_pb2_grpc, worker_pb2

    assert worker_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert hasattr(generation_pb2_grpc, "GenerationStub")
