"""The NVML sampler against the fake NVML: v2/v1, lost GPUs, unsupported queries, re-init, hangs."""

from __future__ import annotations

import time

import pynvml
import pytest
from waiting import PATIENCE_S, until

from kvgate.agent.sources.fake_nvml import FakeNvml, GiB, make_gpus
from kvgate.agent.sources.nvml import NvmlPoller, NvmlSampler


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fake_raises_the_real_pynvml_error_classes() -> None:
    fake = FakeNvml()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    fake.gpus[0].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        FakeNvml(make_gpus(1), _refcount=1).nvmlDeviceGetMemoryInfo(handle, version=1)


def test_reads_every_gpu_by_uuid_with_the_v2_call() -> None:
    fake = FakeNvml(make_gpus(2))
    fake.gpus[1].used_bytes = 30 * GiB
    reading = NvmlSampler(fake, Clock()).read()
    assert reading.healthy and reading.reason == ""
    assert [g.uuid for g in reading.gpus] == [g.uuid for g in fake.gpus]
    second = reading.gpus[1]
    assert (second.total_bytes, second.used_bytes, second.reserved_bytes) == (
        80 * GiB,
        30 * GiB,
        512 * 1024**2,
    )
    assert second.free_bytes == 80 * GiB - 30 * GiB - 512 * 1024**2
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 2
    assert "nvmlDeviceGetMemoryInfo" not in fake.calls


def test_an_unchanged_node_gives_back_the_same_reading() -> None:
    clock = Clock()
    fake = FakeNvml(make_gpus(2))
    sampler = NvmlSampler(fake, clock, initial_backoff_s=1.0)
    first = sampler.read()
    assert sampler.read() is first  # the agent encodes the GPU list again only when this changes
    fake.gpus[1].used_bytes = 30 * GiB
    changed = sampler.read()
    assert changed is not first and changed.gpus[1].used_bytes == 30 * GiB
    assert changed.gpus[0] is first.gpus[0]
    fake.gpus[1].lost = True
    assert not sampler.read().healthy
    fake.gpus[1].lost = False
    clock.now += 1.0
    recovered = sampler.read()  # re-initialised: a fresh healthy reading, not the failed one again
    assert recovered.healthy and recovered.gpus[1].used_bytes == 30 * GiB
    assert sampler.read() is recovered


def test_falls_back_to_v1_once_when_the_driver_lacks_v2() -> None:
    fake = FakeNvml(make_gpus(1), v2_supported=False)
    sampler = NvmlSampler(fake, Clock())
    first, second = sampler.read(), sampler.read()
    assert first.healthy and second.healthy
    gpu = second.gpus[0]
    assert gpu.reserved_bytes is None  # v1 has no reserved field: unknown, not zero
    assert gpu.used_bytes == 1 * GiB + 512 * 1024**2  # v1 counts the driver's reservation as used
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1  # not retried every period
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 2


def test_not_supported_is_unknown_not_zero() -> None:
    fake = FakeNvml(make_gpus(2))
    fake.gpus[0].memory_not_supported = True
    reading = NvmlSampler(fake, Clock()).read()
    gpu = reading.gpus[0]
    assert (gpu.total_bytes, gpu.used_bytes, gpu.free_bytes) == (None, None, None)
    assert gpu.healthy and gpu.reason == "memory_not_supported"
    assert reading.healthy


def test_lost_gpu_makes_the_node_unhealthy_and_reinitialises_after_backoff() -> None:
    clock = Clock()
    fake = FakeNvml(make_gpus(2))
    sampler = NvmlSampler(fake, clock, initial_backoff_s=1.0, max_backoff_s=4.0)
    assert sampler.read().healthy
    fake.gpus[1].lost = True
    lost = sampler.read()
    assert not lost.healthy and lost.reason.startswith("gpu_lost")
    assert lost.gpus[1].reason == "gpu_lost" and lost.gpus[1].free_bytes is None
    assert fake.calls["nvmlShutdown"] == 1
    clock.now += 0.5
    assert not sampler.read().healthy  # still backing off: no re-init yet
    assert fake.calls["nvmlInit"] == 1
    clock.now += 0.6
    assert not sampler.read().healthy  # re-initialised, GPU still lost; backoff doubles
    assert fake.calls["nvmlInit"] == 2
    fake.gpus[1].lost = False
    clock.now += 1.5
    assert not sampler.read().healthy  # 1.5 s < the doubled 2 s backoff
    clock.now += 0.6
    recovered = sampler.read()
    assert recovered.healthy and len(recovered.gpus) == 2


def test_driver_not_loaded_is_retried_with_growing_backoff() -> None:
    clock = Clock()
    fake = FakeNvml(make_gpus(1), driver_loaded=False)
    sampler = NvmlSampler(fake, clock, initial_backoff_s=1.0, max_backoff_s=2.0)
    for _ in range(5):
        reading = sampler.read()
        assert not reading.healthy and "Driver Not Loaded" in reading.reason
        assert "run the agent with --nvml off" in reading.reason, "what to do about it"
        clock.now += 2.0
    assert fake.calls["nvmlInit"] == 5
    fake.driver_loaded = True
    assert sampler.read().healthy


def test_no_gpus_is_unhealthy() -> None:
    reading = NvmlSampler(FakeNvml([]), Clock()).read()
    assert not reading.healthy and reading.reason == "nvml: no GPUs"


def _calls(fake: FakeNvml) -> int:
    return sum(fake.calls.values())


def test_poller_samples_every_period_and_a_hung_call_only_marks_the_node() -> None:
    # A hang lasts until unhang() (the bound only ends a test that fails before it gets there).
    fake = FakeNvml(make_gpus(1), max_hang_s=PATIENCE_S * 3)
    clock = Clock()
    poller = NvmlPoller(NvmlSampler(fake, time.monotonic), period_s=0.01, hung_after_s=2.0, clock=clock)
    try:
        assert poller.wait_first(PATIENCE_S)
        good = poller.latest()
        assert good.healthy
        until(lambda: fake.calls["nvmlDeviceGetMemoryInfo_v2"] >= 5, "a read every period")
        fake.hang()
        hung_from = _calls(fake)
        # A call that starts after hang() blocks: from then on the poller's thread is stuck in it.
        until(lambda: _calls(fake) > hung_from, "the poller's next NVML call")
        stuck = _calls(fake)
        slow = poller.latest()  # a call stuck for less than hung_after_s: the last reading stands
        clock.now += 2.5
        hung = poller.latest()  # stuck past hung_after_s (the injected clock): a wedged driver
        # latest() made no NVML call (it would have blocked on the hang): it never waits for NVML.
        assert _calls(fake) == stuck
        assert slow == good
        assert not hung.healthy and hung.reason.startswith("nvml_hung")
        time.sleep(0.05)  # five periods: no other read starts beside the stuck one
        assert _calls(fake) == stuck
        fake.unhang()
        until(lambda: poller.latest().healthy, "a healthy reading once NVML answers again")
    finally:
        fake.unhang()
        poller.close()


def test_poller_shuts_nvml_down_when_closed() -> None:
    fake = FakeNvml(make_gpus(1))
    poller = NvmlPoller(NvmlSampler(fake, time.monotonic), period_s=0.01)
    assert poller.wait_first(PATIENCE_S)
    poller.close()
    until(lambda: fake.calls.get("nvmlShutdown", 0) == 1, "nvmlShutdown once the poller is closed")


def test_real_pynvml_without_a_gpu_reports_unhealthy_instead_of_raising() -> None:
    reading = NvmlSampler(pynvml, Clock()).read()
    if reading.healthy:
        pytest.skip("this machine has a working NVIDIA driver")
    assert reading.reason.startswith("nvml: init failed")
    assert "--nvml off" in reading.reason
