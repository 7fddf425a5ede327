"""The committed gRPC stubs must match protos/spyglass.proto: regenerate into a temporary directory and compare."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATED = ("spyglass_pb2.py", "spyglass_pb2_grpc.py", "spyglass_pb2.pyi")


def test_generated_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    (tmp_path / "protos").mkdir()
    shutil.copy(REPO / "protos" / "spyglass.proto", tmp_path / "protos" / "spyglass.proto")
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=."]
    out = subprocess.run([*cmd, "protos/spyglass.proto"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (REPO / "protos" / name).read_text()
        assert committed == fresh, (
            f"protos/{name} is stale: regenerate from the repo root with "
            "`python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/spyglass.proto`"
        )


def test_stubs_import_as_a_package():
    from protos import spyglass_pb2, spyglass_pb2_grpc

    assert spyglass_pb2.DESCRIPTOR.package == "spyglass.v1"
    assert hasattr(spyglass_pb2_grpc, "add_SpyglassServicer_to_server")
    names = {m.name for m in spyglass_pb2.DESCRIPTOR.services_by_name["Spyglass"].methods}
    assert names == {"Generate", "GenerateOnce", "Abort", "Health", "GetModelInfo"}
