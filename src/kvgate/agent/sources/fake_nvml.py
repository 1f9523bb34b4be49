"""A scriptable stand-in for the `pynvml` module, for machines without an NVIDIA GPU.

It answers the calls the NVML sampler makes with the real module's structs (`c_nvmlMemory_t`,
`c_nvmlMemory_v2_t`) and raises the real module's error classes (`pynvml.NVMLError` with the real
codes, so `except pynvml.NVMLError_GpuIsLost` matches), so the sampler runs the same code paths as on
a GPU node. Like the real library, every device call fails with Uninitialized before nvmlInit.

Script it through the `FakeGpu` objects and the switches on `FakeNvml`: lose a GPU, make memory
queries unsupported, remove the v2 call, fail init, or make every call hang until `unhang()`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pynvml

GiB = 1024**3


@dataclass(slots=True)
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total_bytes: int = 80 * GiB
    # Memory in use by processes (v2 `used`; v1 `used` adds the reserved part, as the driver does).
    used_bytes: int = 1 * GiB
    reserved_bytes: int = 512 * 1024**2
    lost: bool = False
    memory_not_supported: bool = False


@dataclass(frozen=True, slots=True)
class _Handle:
    index: int


def make_gpus(count: int, total_bytes: int = 80 * GiB) -> list[FakeGpu]:
    return [
        FakeGpu(uuid=f"GPU-fake-{i:04d}-0000-0000-0000-000000000000", total_bytes=total_bytes)
        for i in range(count)
    ]


@dataclass(slots=True)
class FakeNvml:
    gpus: list[FakeGpu] = field(default_factory=lambda: make_gpus(1))
    # False: the driver is older than nvmlDeviceGetMemoryInfo_v2 (pynvml raises FunctionNotFound).
    v2_supported: bool = True
    driver_loaded: bool = True
    # Upper bound on a hang, so a test that forgets unhang() still ends.
    max_hang_s: float = 10.0
    calls: dict[str, int] = field(default_factory=dict)
    _refcount: int = 0
    _running: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._running.set()

    def hang(self) -> None:
        """Every NVML call blocks from now until unhang() (a wedged driver)."""
        self._running.clear()

    def unhang(self) -> None:
        self._running.set()

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", initialised=False)
        if not self.driver_loaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetMemoryInfo(
        self, handle: _Handle, version: int | None = None
    ) -> pynvml.c_nvmlMemory_t | pynvml.c_nvmlMemory_v2_t:
        gpu = self._gpu("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo", handle)
        if gpu.memory_not_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        free = gpu.total_bytes - gpu.used_bytes - gpu.reserved_bytes
        if not version:
            return pynvml.c_nvmlMemory_t(gpu.total_bytes, free, gpu.used_bytes + gpu.reserved_bytes)
        if not self.v2_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if version != pynvml.nvmlMemory_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(version, gpu.total_bytes, gpu.reserved_bytes, free, gpu.used_bytes)

    def _gpu(self, call: str, handle: _Handle) -> FakeGpu:
        self._enter(call)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _enter(self, call: str, initialised: bool = True) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1
        self._running.wait(self.max_hang_s)
        if initialised and self._refcount <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
