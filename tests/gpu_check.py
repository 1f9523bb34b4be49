"""Hand-run check on a machine with an NVIDIA GPU: real NVML through kvgate's sampler and agent.

    .venv/bin/python tests/gpu_check.py

1. Reads every GPU through NvmlSampler over the real pynvml and prints it (v2 memory call expected).
2. Starts an in-process agent (static capacity from the Llama-3.1-8B shape over NVML free memory)
   and a gate-side HeadroomView subscribed to it on 127.0.0.1.
3. Allocates ~2 GiB on the GPU (torch, else cupy, else cudaMalloc via libcudart, else cuMemAlloc via
   libcuda) and checks that NVML's free memory and the headroom the view receives both drop by about
   that much, then frees it and checks the headroom comes back.
Prints what it saw; exits 1 on the first failed check. Not collected by pytest; finishes in < 60 s.
`--fake` runs the same steps against kvgate's fake NVML (allocation simulated), to check the script
itself on a machine without a GPU (tests/test_nvml_gpu_check.py does).
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from collections.abc import Callable

import pynvml

from kvgate.agent.capacity import ModelShape, kv_bytes_per_token
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.agent.sources.fake_nvml import FakeNvml, make_gpus
from kvgate.agent.sources.nvml import NvmlModule, NvmlPoller, NvmlSampler
from kvgate.config.headroom import HeadroomSettings
from kvgate.headroom.snapshot import NodeHeadroom, NvmlReading
from kvgate.headroom.view import HeadroomView

GiB = 1024**3
ALLOC_BYTES = 2 * GiB
LLAMA_8B = ModelShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)


class CheckFailed(Exception):
    pass


def check(ok: bool, message: str) -> None:
    print(("ok   " if ok else "FAIL ") + message, flush=True)
    if not ok:
        raise CheckFailed(message)


def show(reading: NvmlReading) -> None:
    for gpu in reading.gpus:
        fields = {
            "total": gpu.total_bytes,
            "used": gpu.used_bytes,
            "free": gpu.free_bytes,
            "reserved": gpu.reserved_bytes,
        }
        text = " ".join(f"{k}={'unknown' if v is None else f'{v / GiB:.2f}GiB'}" for k, v in fields.items())
        print(f"     GPU {gpu.index} {gpu.uuid} {gpu.name}: {text} healthy={gpu.healthy} {gpu.reason}")


def free_bytes(node: NodeHeadroom) -> int:
    return sum(g.free_bytes or 0 for g in node.gpus)


def allocate(size: int, nvml: NvmlModule) -> tuple[str, Callable[[], None]]:
    """Hold `size` bytes of device memory; returns how, and a function that frees them."""
    if isinstance(nvml, FakeNvml):
        gpu = nvml.gpus[0]
        gpu.used_bytes += size

        def free_fake() -> None:
            gpu.used_bytes -= size

        return "fake NVML", free_fake
    try:
        import torch

        block = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

        def free_torch() -> None:
            nonlocal block
            del block
            torch.cuda.empty_cache()

        return "torch", free_torch
    except ImportError:
        pass
    try:
        import cupy

        memory = cupy.cuda.Memory(size)
        return "cupy", lambda: memory.free() if hasattr(memory, "free") else None
    except ImportError:
        pass
    for name in ("libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"):
        try:
            cudart = ctypes.CDLL(name)
        except OSError:
            continue
        pointer = ctypes.c_void_p()
        status = cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size))
        check(status == 0, f"cudaMalloc({size}) via {name} returned {status}")
        return name, lambda lib=cudart, block=pointer: lib.cudaFree(block)
    cuda = ctypes.CDLL("libcuda.so.1")
    device, context, device_pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for call, args in (
        ("cuInit", (0,)),
        ("cuDeviceGet", (ctypes.byref(device), 0)),
        ("cuDevicePrimaryCtxRetain", (ctypes.byref(context), device)),
        ("cuCtxSetCurrent", (context,)),
        ("cuMemAlloc_v2", (ctypes.byref(device_pointer), ctypes.c_size_t(size))),
    ):
        status = getattr(cuda, call)(*args)
        check(status == 0, f"{call} via libcuda.so.1 returned {status}")

    def free_driver() -> None:
        cuda.cuMemFree_v2(device_pointer)
        cuda.cuDevicePrimaryCtxRelease_v2(device)

    return "libcuda.so.1 (driver API)", free_driver


async def latest(
    view: HeadroomView, accept: Callable[[NodeHeadroom], bool], timeout_s: float
) -> NodeHeadroom:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await view.wait_update(0.5)
        node = view.snapshot()[0].headroom
        if node is not None and accept(node):
            return node
    node = view.snapshot()[0].headroom
    check(False, f"no matching headroom within {timeout_s}s (last: {node})")
    raise AssertionError("unreachable")


def read_directly(nvml: NvmlModule) -> NvmlReading:
    sampler = NvmlSampler(nvml, time.monotonic)
    start = time.perf_counter()
    reading = sampler.read()
    first_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    for _ in range(20):
        sampler.read()
    per_read_ms = (time.perf_counter() - start) / 20 * 1000
    sampler.close()
    show(reading)
    check(
        reading.healthy and bool(reading.gpus),
        f"NVML reads {len(reading.gpus)} healthy GPU(s): {reading.reason}",
    )
    check(all(g.reserved_bytes is not None for g in reading.gpus), "v2 memory info (reserved memory known)")
    print(
        f"     first read (with nvmlInit) {first_ms:.1f} ms, then {per_read_ms:.2f} ms per read of all GPUs"
    )
    return reading


async def through_the_agent(nvml: NvmlModule) -> None:
    agent = Agent(
        NodeSettings("gpu-check", "127.0.0.1:8000", period_s=0.1, model_shape=LLAMA_8B),
        nvml=NvmlPoller(NvmlSampler(nvml, time.monotonic), 0.1),
    )
    port = await agent.start("127.0.0.1:0")
    view = HeadroomView(HeadroomSettings(agents=(f"127.0.0.1:{port}",)))
    await view.start()
    try:
        before = await latest(view, lambda n: n.healthy, 10.0)
        print(
            f"     before: capacity {before.capacity_tokens} tokens ({before.capacity_source}), "
            f"headroom {before.headroom_tokens}, free {free_bytes(before) / GiB:.2f} GiB"
        )
        how, release = allocate(ALLOC_BYTES, nvml)
        expected = int(ALLOC_BYTES / kv_bytes_per_token(LLAMA_8B))
        try:
            during = await latest(
                view, lambda n: before.capacity_tokens - n.capacity_tokens >= 0.9 * expected, 5.0
            )
            drop_free = free_bytes(before) - free_bytes(during)
            check(
                drop_free >= 0.9 * ALLOC_BYTES, f"{how}: NVML free memory dropped {drop_free / GiB:.2f} GiB"
            )
            check(
                True,
                f"capacity dropped {before.capacity_tokens - during.capacity_tokens} tokens "
                f"(2 GiB / 128 KiB per token = {expected}); headroom dropped "
                f"{before.headroom_tokens - during.headroom_tokens} (x safety ratio {during.safety_ratio})",
            )
        finally:
            release()
        # The CUDA context itself stays allocated; the freed 2 GiB must come back.
        after = await latest(
            view, lambda n: n.capacity_tokens >= during.capacity_tokens + 0.8 * expected, 5.0
        )
        check(True, f"capacity back up to {after.capacity_tokens} tokens after freeing")
    finally:
        await view.stop()
        await agent.stop(grace_s=0.1)


def main(argv: list[str]) -> int:
    nvml: NvmlModule = FakeNvml(make_gpus(1)) if "--fake" in argv else pynvml
    started = time.monotonic()
    try:
        read_directly(nvml)
        asyncio.run(through_the_agent(nvml))
    except CheckFailed:
        return 1
    print(f"gpu_check passed in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
