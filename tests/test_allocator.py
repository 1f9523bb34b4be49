"""kvgate.allocator: glibc takes the thresholds that keep big bodies' memory in the heap."""

from __future__ import annotations

import platform

import pytest

from kvgate.allocator import keep_big_buffers


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds() -> None:
    assert keep_big_buffers()
