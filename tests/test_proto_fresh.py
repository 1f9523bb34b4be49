"""The checked-in generated gRPC code matches proto/ (regenerate with `make proto`)."""

from __future__ import annotations

from pathlib import Path

from kvgate.headroom import protogen


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    expected = protogen.generate(tmp_path)
    actual = protogen.checked_in()
    assert sorted(actual) == sorted(expected), "generated files differ: run `make proto`"
    stale = [str(rel) for rel, content in expected.items() if actual[rel] != content]
    assert not stale, f"stale generated code in src/kvgate/_proto: {stale}; run `make proto`"


def test_generated_code_imports_from_its_own_package() -> None:
    from kvgate._proto.headroom.v1 import headroom_pb2, headroom_pb2_grpc

    assert headroom_pb2_grpc.kvgate_dot_headroom_dot_v1_dot_headroom__pb2 is headroom_pb2
    methods = headroom_pb2.DESCRIPTOR.services_by_name["Agent"].methods_by_name
    assert set(methods) == {"Subscribe", "Reserve", "FirstToken", "Release", "Renew", "Ledger"}
