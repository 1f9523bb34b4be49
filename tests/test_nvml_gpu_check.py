"""tests/gpu_check.py (run by hand on a GPU machine) works end to end against the fake NVML."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.mark.slow
def test_gpu_check_passes_on_the_fake_nvml(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).with_name("gpu_check.py"))
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--fake"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "capacity dropped 16384 tokens" in out
