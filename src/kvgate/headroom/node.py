"""One node's headroom state: the latest samples plus the reservation ledger, turned into NodeHeadroom.

Pure: the agent's adapter feeds it samples and asks it for snapshots and reservations. Capacity
comes from the first source that knows it: the operator's --capacity-tokens, the engine's own KV pool
(vLLM cache_config_info, SGLang max_total_num_tokens), or the model shape over NVML free memory.
Engine figures older than `engine_stale_after_s` no longer count and make the node unhealthy: a
node whose usage is unknown must not look empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvgate.headroom.capacity import ModelShape, kv_bytes_per_token, static_capacity_tokens
from kvgate.headroom.engine_metrics import EngineStats
from kvgate.headroom.ledger import Budget, ReservationLedger, ReserveResult
from kvgate.headroom.snapshot import CapacitySource, NodeHeadroom, NvmlReading


@dataclass(frozen=True, slots=True)
class NodeSettings:
    node: str
    endpoint: str
    period_s: float = 0.1
    safety_ratio: float = 0.9
    capacity_tokens: int | None = None
    model_shape: ModelShape | None = None
    gpu_memory_utilization: float = 0.9
    default_lease_s: float = 300.0
    max_lease_s: float = 3600.0
    engine_stale_after_s: float = 1.0


@dataclass(frozen=True, slots=True)
class _EngineSample:
    stats: EngineStats | None
    taken_at: float
    error: str


class NodeState:
    def __init__(
        self, settings: NodeSettings, clock: Callable[[], float], uses_engine: bool, uses_nvml: bool
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._uses_engine = uses_engine
        self._uses_nvml = uses_nvml
        self.ledger = ReservationLedger(clock, settings.default_lease_s, settings.max_lease_s)
        self._engine = _EngineSample(None, float("-inf"), "engine metrics: no sample yet")
        self._nvml: NvmlReading | None = None
        self._seq = 0
        self._bytes_per_token = kv_bytes_per_token(settings.model_shape) if settings.model_shape else None

    def observe_engine(self, stats: EngineStats) -> None:
        self._engine = _EngineSample(stats, self._clock(), "")

    def engine_failed(self, error: str) -> None:
        self._engine = _EngineSample(self._engine.stats, self._engine.taken_at, error)

    def observe_nvml(self, reading: NvmlReading) -> None:
        self._nvml = reading

    def budget(self) -> Budget:
        return self._assess()[0]

    def reserve(self, request_id: str, tokens: int, lease_s: float, holder: str = "") -> ReserveResult:
        return self.ledger.reserve(request_id, tokens, lease_s, self.budget(), holder)

    def release(self, request_id: str) -> bool:
        return self.ledger.release(request_id)

    def snapshot(self, sample_time_unix_ns: int) -> NodeHeadroom:
        """The next message of the stream (its seq is one more than the last one's)."""
        self._seq += 1
        budget, source, engine = self._assess()
        return NodeHeadroom(
            node=self.settings.node,
            endpoint=self.settings.endpoint,
            seq=self._seq,
            sample_time_unix_ns=sample_time_unix_ns,
            capacity_tokens=budget.capacity_tokens,
            safety_ratio=self.settings.safety_ratio,
            used_tokens=budget.observed_tokens,
            reserved_tokens=self.ledger.reserved_tokens,
            reservations=self.ledger.count,
            headroom_tokens=self.ledger.headroom(budget),
            healthy=budget.healthy,
            reason=budget.reason,
            capacity_source=source,
            kv_usage=engine.kv_usage if engine else None,
            running=engine.running if engine else None,
            waiting=engine.waiting if engine else None,
            preemptions_total=engine.preemptions_total if engine else None,
            gpus=self._nvml.gpus if self._nvml else (),
            period_ms=round(self.settings.period_s * 1000),
        )

    def _assess(self) -> tuple[Budget, CapacitySource, EngineStats | None]:
        engine = self._fresh_engine()
        capacity, source = self._capacity(engine)
        healthy, reason = self._health(engine, capacity)
        observed = engine.used_tokens if engine else None
        return Budget(capacity, self.settings.safety_ratio, observed, healthy, reason), source, engine

    def _fresh_engine(self) -> EngineStats | None:
        if self._clock() - self._engine.taken_at > self.settings.engine_stale_after_s:
            return None
        return self._engine.stats

    def _capacity(self, engine: EngineStats | None) -> tuple[int, CapacitySource]:
        if self.settings.capacity_tokens is not None:
            return self.settings.capacity_tokens, CapacitySource.MANUAL
        if engine is not None and engine.capacity_tokens is not None:
            return engine.capacity_tokens, CapacitySource.ENGINE
        if self._bytes_per_token is not None and self._nvml is not None:
            static = static_capacity_tokens(
                self._nvml.gpus, self._bytes_per_token, self.settings.gpu_memory_utilization
            )
            if static is not None:
                return static, CapacitySource.STATIC
        return 0, CapacitySource.NONE

    def _health(self, engine: EngineStats | None, capacity: int) -> tuple[bool, str]:
        if self._uses_nvml and (self._nvml is None or not self._nvml.healthy):
            return False, self._nvml.reason if self._nvml else "nvml: no reading yet"
        if self._uses_engine and engine is None:
            return False, f"engine_metrics_stale: {self._engine.error or 'no recent sample'}"
        if capacity <= 0:
            return False, "no_capacity"
        return True, ""
