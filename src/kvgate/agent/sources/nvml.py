"""The NVML sampler: per-GPU memory and health through nvidia-ml-py, keyed by UUID.

NVML stays the truth for device health and for memory outside the engine's KV pool (vLLM pre-allocates
its KV pool, so NVML's used memory stays flat under load; the engine's own gauges tell KV occupancy).
Rules: the v2 memory call (it separates the driver's reserved memory) with a v1 fallback when the
driver lacks it; GpuIsLost makes the node unhealthy and re-initialises NVML after a backoff;
NotSupported leaves the value unknown, never zero. `read` blocks (NVML is a C library); the agent runs
it on `NvmlPoller`'s thread so a hung driver call cannot stall the stream.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from kvgate.headroom.snapshot import GpuReading, NvmlReading

log = logging.getLogger(__name__)

# Errors after which the library itself, not one device, is unusable until re-initialised.
_LIBRARY_ERRORS = (
    pynvml.NVMLError_Uninitialized,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_LibRmVersionMismatch,
)
# Raised by the v2 memory call on drivers that predate it.
_NO_V2 = (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch)


class NvmlModule(Protocol):
    """The part of `pynvml` the sampler calls; `kvgate.agent.sources.fake_nvml.FakeNvml` provides it too."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any: ...


@dataclass(slots=True)
class _Device:
    index: int
    uuid: str
    name: str
    handle: Any
    # The latest healthy reading, handed out again while the device's memory figures stay the same.
    last: GpuReading | None = None


class NvmlSampler:
    def __init__(
        self,
        nvml: NvmlModule,
        clock: Callable[[], float],
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = initial_backoff_s
        self._next_init_at = 0.0
        self._devices: tuple[_Device, ...] | None = None
        self._v1_only: set[str] = set()
        self._last = NvmlReading((), False, "nvml: not initialised yet")

    def read(self) -> NvmlReading:
        """One reading of every GPU. Blocking; never raises NVMLError."""
        if self._devices is None and not self._initialise():
            return self._last
        assert self._devices is not None
        try:
            gpus = tuple(self._read_device(device) for device in self._devices)
        except _LIBRARY_ERRORS as exc:
            return self._fail(f"nvml: {exc}", ())
        last = self._last
        # An engine preallocates its memory, so most readings repeat the last one exactly: hand back
        # the same object, which the agent then encodes only once (a failed reading is never healthy).
        if last.healthy and len(gpus) == len(last.gpus) and all(map(operator.is_, gpus, last.gpus)):
            return last
        lost = [gpu for gpu in gpus if gpu.reason == "gpu_lost"]
        if lost:
            return self._fail(f"gpu_lost: {', '.join(g.uuid or str(g.index) for g in lost)}", gpus)
        self._backoff_s = self._initial_backoff_s
        sick = [gpu for gpu in gpus if not gpu.healthy]
        reason = "; ".join(f"{g.uuid}: {g.reason}" for g in sick)
        self._last = NvmlReading(gpus, not sick and bool(gpus), reason if gpus else "nvml: no GPUs")
        return self._last

    def close(self) -> None:
        if self._devices is not None:
            self._devices = None
            self._shutdown()

    def _initialise(self) -> bool:
        if self._clock() < self._next_init_at:
            return False
        try:
            self._nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            # What a host without an NVIDIA GPU answers: say what to do about it, not only what failed.
            no_gpu = isinstance(exc, (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded))
            hint = " (no NVIDIA driver here? run the agent with --nvml off)" if no_gpu else ""
            self._fail(f"nvml: init failed: {exc}{hint}", self._last.gpus, shutdown=False)
            return False
        try:
            self._devices = tuple(self._enumerate())
        except pynvml.NVMLError as exc:
            self._shutdown()
            self._fail(f"nvml: cannot enumerate GPUs: {exc}", self._last.gpus, shutdown=False)
            return False
        log.info("NVML initialised: %d GPU(s) %s", len(self._devices), [d.uuid for d in self._devices])
        return True

    def _enumerate(self) -> list[_Device]:
        devices = []
        for index in range(self._nvml.nvmlDeviceGetCount()):
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = self._nvml.nvmlDeviceGetUUID(handle)
            devices.append(_Device(index, uuid, self._nvml.nvmlDeviceGetName(handle), handle))
        return devices

    def _read_device(self, device: _Device) -> GpuReading:
        try:
            total, used, free, reserved = self._memory(device)
        except pynvml.NVMLError_GpuIsLost:
            return _unknown(device, healthy=False, reason="gpu_lost")
        except pynvml.NVMLError_NotSupported:
            return _unknown(device, healthy=True, reason="memory_not_supported")
        except _LIBRARY_ERRORS:
            raise
        except pynvml.NVMLError as exc:
            return _unknown(device, healthy=False, reason=f"nvml: {exc}")
        last = device.last
        if (
            last is not None
            and last.used_bytes == used
            and last.free_bytes == free
            and last.total_bytes == total
            and last.reserved_bytes == reserved
        ):
            return last
        device.last = GpuReading(
            uuid=device.uuid,
            index=device.index,
            name=device.name,
            total_bytes=total,
            used_bytes=used,
            free_bytes=free,
            reserved_bytes=reserved,
            healthy=True,
        )
        return device.last

    def _memory(self, device: _Device) -> tuple[int, int, int, int | None]:
        """Total, used, free and the driver's reserved bytes (None from the v1 call)."""
        if device.uuid not in self._v1_only:
            try:
                v2 = self._nvml.nvmlDeviceGetMemoryInfo(device.handle, version=pynvml.nvmlMemory_v2)
            except _NO_V2:
                log.info("GPU %s: no v2 memory info in this driver, using v1", device.uuid)
                self._v1_only.add(device.uuid)
            else:
                return int(v2.total), int(v2.used), int(v2.free), int(v2.reserved)
        v1 = self._nvml.nvmlDeviceGetMemoryInfo(device.handle)
        return int(v1.total), int(v1.used), int(v1.free), None

    def _fail(self, reason: str, gpus: tuple[GpuReading, ...], shutdown: bool = True) -> NvmlReading:
        """Mark NVML unusable until the backoff passes; the next read re-initialises it."""
        log.warning("%s; re-initialising NVML in %.1fs", reason, self._backoff_s)
        if shutdown and self._devices is not None:
            self._shutdown()
        self._devices = None
        self._next_init_at = self._clock() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
        self._last = NvmlReading(gpus, False, reason)
        return self._last

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)


def _unknown(device: _Device, healthy: bool, reason: str) -> GpuReading:
    return GpuReading(device.uuid, device.index, device.name, None, None, None, None, healthy, reason)


class NvmlPoller:
    """The sampler on a daemon thread of its own, reading every period; the agent takes the latest.

    NVML is a blocking C library, and a wedged driver call never returns and cannot be cancelled.
    Here it only stalls this thread: the agent's loop never waits for NVML, and a call that has
    not returned for `hung_after_s` makes `latest()` unhealthy ("nvml_hung"). Readings are at most
    one period old. A daemon thread, so a stuck call cannot keep the process from exiting.
    """

    def __init__(
        self,
        sampler: NvmlSampler,
        period_s: float,
        hung_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sampler = sampler
        self._period_s = period_s
        self._hung_after_s = hung_after_s
        self._clock = clock
        self._latest = NvmlReading((), False, "nvml: no reading yet")
        self._call_started: float | None = None
        self._read_once = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgate-nvml", daemon=True)
        self._thread.start()

    def latest(self) -> NvmlReading:
        started = self._call_started
        if started is not None and (stuck_for := self._clock() - started) > self._hung_after_s:
            return NvmlReading((), False, f"nvml_hung: a call has not returned for {stuck_for:.1f}s")
        return self._latest

    def wait_first(self, timeout_s: float) -> bool:
        """Block until the first reading is in (NVML init can take seconds on a big node)."""
        return self._read_once.wait(timeout_s)

    def close(self) -> None:
        self._stopping.set()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stopping.is_set():
            self._call_started = self._clock()
            reading = self._sampler.read()
            self._call_started = None
            # One reference assignment: the loop thread sees the old or the new reading, never half.
            self._latest = reading
            self._read_once.set()
            next_at = max(next_at + self._period_s, time.monotonic())
            self._stopping.wait(next_at - time.monotonic())
        self._sampler.close()
