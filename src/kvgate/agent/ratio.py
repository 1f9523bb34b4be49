"""The share of a node's KV its agent grants against, steered by the engine's preemption counter.

Pure: time is passed in. A fixed share (0.90) either wastes KV the engine could hold or, where
estimates run short, lets the engine preempt. The engine says which: its preemption counter (vLLM's
`vllm:num_preemptions_total`, SGLang's `sglang:num_retracted_requests_total`, kvgate.agent.sources.engines).
So the share starts at --safety-ratio and moves within [floor, ceiling]:
- It rises by `step_up` (0.005) at the end of each `window_s` (10 s) in which a request waited for room
  on this node (a Reserve refused for room, or granted to a waiter that held its place here) and the
  engine showed no new preemption. With nobody waiting there is nothing to gain, and nothing is
  learnt. A grant to a try that merely names the time it waits since is no wait: a gate names its
  request's arrival on every try, the first included (kvgate.agent.node).
- It falls by `step_down` (0.05) at once on any new preemption and stays put for `freeze_s` (60 s).
- The level that preempted is not reached again soon: the ceiling drops one `step_up` below it and
  comes back one `step_up` per `relax_s` (600 s) without a preemption. So a node that preempted at
  0.97 settles at 0.965 instead of preempting every (freeze + climb) = 160 s.
- The engine's KV usage leads: a window whose peak usage went past `rise_below_usage` (0.92 of the
  pool) teaches no rise, and usage at `fall_above_usage` (0.97) counts as a preemption about to happen
  (the step down and the freeze, before the engine has to preempt). A preemption counter alone learns
  the limit by crossing it once per node: on the Mooncake replay (docs/benchmarks.md) each long node
  preempted once at ~0.93 and fell back; with the usage guard none did.
- An engine that publishes no preemption counter keeps the starting share (a share that had fallen
  stays where it is: nothing says it may rise again).
- A counter that goes back is an engine restart, not a preemption: it is the new baseline. A counter
  that first appears above 0 on an engine seen before without it (a labelled counter is written from
  its first increment on) counts as preemptions.
This is SGLang's own loop for its new_token_ratio, applied to the node's admissible share: decay while
decode runs without running out of KV, reset when it has to retract (sgl-project/sglang
python/sglang/srt/managers/scheduler.py, update_running_batch: `new_token_ratio - new_token_ratio_decay`
down to min_new_token_ratio, and `retract_decode` on a full pool; v0.4-v0.5). The bound on the harm:
one preemption burst costs `step_down` of admission for `freeze_s`, and the ceiling then keeps the
share under the level that preempted.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# The research's proposal (shared/research/admission-efficiency.md, section 4 "C"): +0.005 per 10 s
# with requests waiting and no preemption, up to 0.98; -0.05 and 60 s still on a preemption.
STEP_UP = 0.005
WINDOW_S = 10.0
STEP_DOWN = 0.05
FREEZE_S = 60.0
RELAX_S = 600.0
CEILING = 0.98
# Engine KV usage over which a window teaches no rise, and at which the share falls at once. At a fixed
# 0.90 the Mooncake replay's long nodes peaked at 0.94-0.95 of their pool (prompts written while the
# estimate runs short, prefill racing the ledger), so the share may rise only while the engine keeps
# that much margin; vLLM V1 preempts only when a block cannot be allocated (100 %).
RISE_BELOW_USAGE = 0.92
FALL_ABOVE_USAGE = 0.97
# How far under its starting share a node's share may fall: 0.90 -> 0.80, about twice the worst
# fast-estimate error on held-out text (11.5 %, docs/benchmarks.md) on top of the start's own margin.
FLOOR_BELOW_START = 0.10


class Step(StrEnum):
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class RatioSettings:
    start: float = 0.9
    floor: float = 0.8
    ceiling: float = CEILING
    step_up: float = STEP_UP
    window_s: float = WINDOW_S
    step_down: float = STEP_DOWN
    freeze_s: float = FREEZE_S
    relax_s: float = RELAX_S
    rise_below_usage: float = RISE_BELOW_USAGE
    fall_above_usage: float = FALL_ABOVE_USAGE

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.start <= self.ceiling <= 1:
            raise ValueError(
                f"ratio bounds must satisfy 0 < floor <= start <= ceiling <= 1, got "
                f"{self.floor} <= {self.start} <= {self.ceiling}"
            )
        if min(self.step_up, self.step_down, self.window_s, self.relax_s) <= 0 or self.freeze_s < 0:
            raise ValueError("ratio steps, window and relax time must be > 0, the freeze >= 0")
        if not 0 < self.rise_below_usage <= self.fall_above_usage <= 1:
            raise ValueError(
                f"usage guards must satisfy 0 < rise_below_usage <= fall_above_usage <= 1, got "
                f"{self.rise_below_usage} and {self.fall_above_usage}"
            )

    @classmethod
    def around(
        cls,
        start: float,
        floor: float | None = None,
        ceiling: float | None = None,
        freeze_s: float = FREEZE_S,
    ) -> RatioSettings:
        """The defaults for a node that starts at `start`: floor start - 0.10, ceiling 0.98 (or the
        start, when it is higher). Bounds equal to the start fix the share."""
        low = round(max(0.01, start - FLOOR_BELOW_START), 6) if floor is None else floor
        high = max(CEILING, start) if ceiling is None else ceiling
        return cls(start, low, high, freeze_s=freeze_s)

    @property
    def fixed(self) -> bool:
        return self.floor == self.start == self.ceiling


class SteeredRatio:
    def __init__(self, settings: RatioSettings, now: float) -> None:
        self.settings = settings
        self._value = settings.start
        self._ceiling = settings.ceiling  # lowered under a level that preempted, relaxed back slowly
        self._counter: int | None = None  # the engine's preemption counter, last seen
        self._seen_without = False  # a reading came without the counter
        self._window_start = now
        self._waited = False  # a request waited for room in the current window
        self._peak_usage = 0.0  # the engine's highest KV usage (a fraction of its pool) in the window
        self._frozen_until = float("-inf")
        self._relaxed_at = now
        self.steps: dict[str, int] = {Step.UP: 0, Step.DOWN: 0}  # steps taken, by direction

    @property
    def value(self) -> float:
        return self._value

    @property
    def ceiling(self) -> float:
        """The highest share it may rise to now (under the level that last preempted)."""
        return self._ceiling

    def waited(self) -> None:
        """A request waited for room on this node (refused for room, or waiting in the one order)."""
        self._waited = True

    def observe(
        self, now: float, preemptions_total: int | None, kv_usage: float | None = None
    ) -> Step | None:
        """One engine reading's preemption counter (None: the page has none) and KV usage (a fraction
        of its pool; None: unknown); the step taken, if any."""
        if self.settings.fixed:
            return None
        if kv_usage is not None:
            self._peak_usage = max(self._peak_usage, kv_usage)
        if preemptions_total is None:
            self._counter = None
            self._seen_without = True
            self._value = min(self._value, self.settings.start)
            return None
        before, self._counter = self._counter, preemptions_total
        if before is None:
            preempted = self._seen_without and preemptions_total > 0
        else:
            preempted = preemptions_total > before  # lower: the engine restarted, a new baseline
        # The first reading is a baseline for usage as for the counter: what the engine held before the
        # agent started is not admission's overshoot.
        near = before is not None and kv_usage is not None and kv_usage >= self.settings.fall_above_usage
        if preempted or (near and now >= self._frozen_until):
            return self._preempted(now)
        return self._rise(now)

    def _preempted(self, now: float) -> Step:
        s = self.settings
        self._ceiling = max(s.floor, min(self._ceiling, round(self._value - s.step_up, 6)))
        self._value = max(s.floor, round(self._value - s.step_down, 6))
        self._frozen_until = now + s.freeze_s
        self._relaxed_at = now
        self._restart_window(now)
        self.steps[Step.DOWN] += 1
        return Step.DOWN

    def _rise(self, now: float) -> Step | None:
        s = self.settings
        if now < self._frozen_until:
            self._restart_window(self._frozen_until)  # the freeze's own waits teach nothing
            return None
        if now - self._relaxed_at >= s.relax_s:
            self._ceiling = min(s.ceiling, round(self._ceiling + s.step_up, 6))
            self._relaxed_at = now
        if now - self._window_start < s.window_s:
            return None
        waited, crowded = self._waited, self._peak_usage > s.rise_below_usage
        self._restart_window(now)
        if not waited or crowded or self._value >= self._ceiling:
            return None
        self._value = min(self._ceiling, round(self._value + s.step_up, 6))
        self.steps[Step.UP] += 1
        return Step.UP

    def _restart_window(self, at: float) -> None:
        self._window_start = at
        self._waited = False
        self._peak_usage = 0.0
