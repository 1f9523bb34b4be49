"""Waiting for what a test expects instead of sleeping and hoping it happened.

A test polls the condition it expects until it holds. The timeout only bounds a failure, so it is
generous: CI runs on two cores next to other work, where a step that takes milliseconds here can take
seconds. How fast something happens is a benchmark's figure (bench/), never a test's assertion.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
PATIENCE_S = 20.0


def until(check: Callable[[], T], what: str, timeout_s: float = PATIENCE_S, interval_s: float = 0.01) -> T:
    """The first true value `check()` returns; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, (
            f"still waiting for {what} after {timeout_s:g} s (last: {value!r})"
        )
        time.sleep(interval_s)
    return value


async def until_async(
    check: Callable[[], T | Awaitable[T]], what: str, timeout_s: float = PATIENCE_S, interval_s: float = 0.01
) -> T:
    """`until` on an event loop: `check` may be a plain function or a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        assert time.monotonic() < deadline, (
            f"still waiting for {what} after {timeout_s:g} s (last: {value!r})"
        )
        await asyncio.sleep(interval_s)
