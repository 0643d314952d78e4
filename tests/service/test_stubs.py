"""The committed stubs in service/gen are what service/gen_stubs.py makes of the .proto today."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from service import gen_stubs

# The generator's version stamps (protoc's and grpcio-tools') change with the installed tools,
# not with the .proto: a newer grpcio-tools on another machine must not fail this test.
_STAMPS = [
    re.compile(r"# Protobuf Python Version: .*"),
    re.compile(r"ValidateProtobufRuntimeVersion\([^)]*\)"),
    re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"),
]


def _normalized(text: str) -> str:
    for stamp in _STAMPS:
        text = stamp.sub("<version>", text)
    return text


def test_committed_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = {p.relative_to(tmp_path) for p in gen_stubs.generate(tmp_path)}
    committed_dir = gen_stubs.ROOT / "gen"
    committed = {
        p.relative_to(committed_dir)
        for p in committed_dir.rglob("*")
        if p.is_file() and p.suffix in (".py", ".pyi")
    }
    assert committed == fresh, "run `python -m service.gen_stubs` and commit service/gen"
    for rel in sorted(fresh):
        got = _normalized((committed_dir / rel).read_text())
        want = _normalized((tmp_path / rel).read_text())
        assert got == want, f"service/gen/{rel} is stale: run `python -m service.gen_stubs`"


def test_stubs_import_from_anywhere_without_shadowing_jaxserve(tmp_path):
    """protoc writes `from jaxserve.v1 import ...`, which would look inside our own `jaxserve`
    package; the generator rewrites it. Run from elsewhere, as an installed package is used."""
    code = (
        "import sys; from service.gen.jaxserve.v1 import jaxserve_pb2, jaxserve_pb2_grpc; "
        "import jaxserve; assert 'jaxserve.v1' not in sys.modules; "
        "assert jaxserve_pb2_grpc.JaxServeStub and jaxserve_pb2.GenerateRequest"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
