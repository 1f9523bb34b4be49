"""The engine model of a simulated node: KV blocks, a vLLM-V1-like scheduler step, OOM and restart.

It is pure: no I/O, no asyncio. The caller alternates `schedule()` (pick the batch of the next step
and allocate its KV blocks) and `complete(step)` (after the step's duration, commit the computed
tokens and sample one token for every sequence whose known tokens are all computed).

How a step is built, as in vLLM V1:
- Running sequences first, oldest first: a decoding sequence computes 1 token, a prefilling one
  (or one recomputing after preemption) a chunk of up to the remaining token budget.
- Then waiting sequences, first come first served, while budget and `max_num_seqs` allow. A
  running prefill takes the budget before new arrivals, which is how a long prompt delays the first
  token of every short request behind it.
- With `long_prefill_token_threshold` (vLLM's --long-prefill-token-threshold), no request computes more
  than that many tokens in one step while another request runs or waits, so a long prompt leaves the
  rest of the budget to the requests behind it; alone, a request takes the whole budget
  (vllm 0.32.0 `vllm/v1/core/sched/scheduler.py`, `schedule`: the threshold is 0 when
  `num_running + num_waiting` is 1, and caps `num_new_tokens` of running and of waiting requests).
- KV is allocated in blocks for the tokens computed in this step; a decoding sequence needs a new
  block every `block_size` tokens.
- With prefix caching (on by default, as in vLLM), a new request first takes the longest cached
  prefix of its prompt (kvgate.sim.blocks: shared blocks, LRU eviction of free cached ones) and
  computes only the rest; vLLM recomputes at least the prompt's last token, so a hit never covers it
  (vllm/v1/core/kv_cache_manager.py, get_computed_blocks @ 003df29).
- A request names its output budget (max_tokens) and gets exactly that many tokens, as a model that
  never ends early, unless it says where the simulated answer ends (`eos_after`, a replay's real
  answer length under an over-declared budget); without one it stops at a seeded end-of-sequence
  within `default_output_tokens`, unless end-of-sequence is ignored (vLLM's `ignore_eos`, per request
  or `EngineConfig.ignore_eos`): then it runs to max-model-len, vLLM's default budget.
- With `kv_events`, every change to the prefix cache is recorded as vLLM's scheduler reports it
  (kvgate.sim.kv_events): BlockStored when a request's full prompt blocks are registered (with their
  token ids), BlockRemoved when a cached block is reallocated, AllBlocksCleared when a crash empties
  the cache; `take_kv_events` hands over those of the latest steps.
- When blocks run out, `preempt` mode frees the newest running sequence and queues it for
  recomputation (latency collapses, nothing fails); a waiting sequence just waits. `crash` mode
  models an engine without that guard, a CUDA OOM: every sequence fails and the node is down for
  `restart_s`.
Step time: (1 + batch/`batch_knee`) / `decode_tokens_per_s` + prefill tokens / `prefill_tokens_per_s`,
so inter-token latency grows with the batch and with prefill work sharing the step; cached tokens cost
no prefill time.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvgate.errors import ConfigError
from kvgate.sim.blocks import BlockPool
from kvgate.sim.kv_events import AllBlocksCleared, BlockRemoved, KvEvent, stored_events

Exhaustion = Literal["crash", "preempt"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kv_capacity_tokens: int
    block_size: int = 16
    max_model_len: int = 32768
    prefill_tokens_per_s: float = 20000.0
    decode_tokens_per_s: float = 50.0
    batch_knee: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no cap (vLLM's default)
    on_exhaustion: Exhaustion = "preempt"
    restart_s: float = 10.0
    seed: int = 0
    # Output length when a request names no max_tokens (a real engine stops at end-of-sequence).
    default_output_tokens: tuple[int, int] = (32, 256)
    enable_prefix_caching: bool = True
    # Requests without max_tokens run to max-model-len instead of a sampled end (vLLM's ignore_eos).
    ignore_eos: bool = False
    # Record the prefix cache's changes as vLLM's KV events (needs prompt token ids from the caller).
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_capacity_tokens < self.block_size:
            raise ConfigError(
                f"kv capacity ({self.kv_capacity_tokens} tokens) must hold at least one block of "
                f"{self.block_size} tokens"
            )
        if self.max_model_len > self.num_gpu_blocks * self.block_size:
            # vLLM refuses to start in this case too: one request could never fit.
            raise ConfigError(
                f"max-model-len {self.max_model_len} is larger than the KV cache "
                f"({self.num_gpu_blocks * self.block_size} tokens)"
            )
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s) <= 0 or self.restart_s < 0:
            raise ConfigError("throughputs must be > 0 and the restart time >= 0")
        if min(self.batch_knee, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ConfigError("batch_knee, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 <= self.long_prefill_token_threshold <= self.max_model_len:
            # vLLM's SchedulerConfig refuses a threshold past max-model-len too.
            raise ConfigError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be in "
                f"[0, max-model-len {self.max_model_len}]"
            )

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


@dataclass(slots=True)
class _Sequence:
    request_id: str
    prompt_tokens: int
    output_target: int
    # "length" when the client's max_tokens ended the output, "stop" when the engine chose to stop.
    finish_reason: Literal["stop", "length"]
    output_tokens: int = 0
    computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: tuple[int, ...] = ()  # of the prompt's full blocks (kvgate.sim.blocks.prompt_block_hashes)
    token_ids: tuple[int, ...] = ()  # of the prompt, for the KV events of its blocks
    registered: int = 0  # leading blocks already in the prefix cache
    preempted: bool = False

    @property
    def known_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: the tokens computed per request, and how long the step takes.

    `crashed` lists every request that failed because the node ran out of memory in this step; the
    batch of a crashed step is empty.
    """

    batch: tuple[tuple[str, int], ...]
    duration_s: float
    crashed: tuple[str, ...] = ()
    prefill_tokens: int = 0  # of the batch's tokens, those computed for prompts (or recomputed ones)
    # Requests that started in this step: their prompt tokens, and those found in the prefix cache.
    started_tokens: int = 0
    started_hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    output_tokens: int
    finished: bool
    finish_reason: Literal["stop", "length"] | None


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    used_blocks: int
    total_blocks: int
    block_size: int
    preemptions_total: int
    oom_crashes_total: int
    peak_kv_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    finished_total: int
    down: bool
    # Prefix cache, as vLLM counts it: prompt tokens of new requests looked up, and those found.
    prefix_queries_total: int = 0
    prefix_hits_total: int = 0
    waiting_tokens: int = 0  # known tokens of the waiting requests (SGLang counts them in its load)

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.total_blocks


_IDLE = Step(batch=(), duration_s=0.0)


class Engine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._rng = random.Random(config.seed)
        self._running: list[_Sequence] = []
        self._waiting: deque[_Sequence] = deque()
        self._by_id: dict[str, _Sequence] = {}
        self._pool = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching, config.kv_events)
        self._kv_events: list[KvEvent] = []
        self._down_until = float("-inf")
        self._preemptions = 0
        self._crashes = 0
        self._peak_tokens = 0
        self._prompt_total = 0
        self._generated_total = 0
        self._finished_total = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    def is_down(self) -> bool:
        return self._clock() < self._down_until

    def restart_in(self) -> float:
        """Seconds until a crashed node serves again (0 when it is up)."""
        return max(0.0, self._down_until - self._clock())

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def add(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int | None,
        block_hashes: tuple[int, ...] = (),
        *,
        token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        eos_after: int | None = None,
    ) -> int:
        """Queue a request the caller has validated; returns the number of tokens it will generate.
        `block_hashes` key its prompt's full blocks in the prefix cache; with KV events on, `token_ids`
        must cover those blocks."""
        assert not self.is_down(), "a down node accepts no requests"
        assert request_id not in self._by_id, f"duplicate request id {request_id}"
        if self.config.kv_events and len(token_ids) < len(block_hashes) * self.config.block_size:
            raise ValueError(f"KV events need the token ids of {request_id}'s {len(block_hashes)} blocks")
        room = self.config.max_model_len - prompt_tokens
        ends = max_tokens is None and not (ignore_eos or self.config.ignore_eos)
        if max_tokens is not None and eos_after is not None and eos_after < max_tokens:
            target, ends = eos_after, True  # the model ends its answer before the budget
        elif max_tokens is not None:
            target = max_tokens
        elif ends:
            low, high = self.config.default_output_tokens
            target = min(self._rng.randint(low, high), room)
        else:
            target = room
        assert 1 <= target <= room and prompt_tokens >= 1, "request exceeds max-model-len"
        sequence = _Sequence(request_id, prompt_tokens, target, "stop" if ends else "length")
        sequence.hashes = block_hashes
        sequence.token_ids = token_ids
        self._waiting.append(sequence)
        self._by_id[request_id] = sequence
        self._prompt_total += prompt_tokens
        return target

    def abort(self, request_id: str) -> None:
        """Drop a request whose client went away, freeing its blocks; unknown ids are ignored."""
        sequence = self._by_id.pop(request_id, None)
        if sequence is None:
            return
        self._free(sequence)
        if sequence in self._running:
            self._running.remove(sequence)
        else:
            self._waiting.remove(sequence)

    def schedule(self) -> Step:
        if self.is_down() or not self.has_work():
            return _IDLE
        budget = self.config.max_num_batched_tokens
        chunk_cap = self._chunk_cap()
        batch: list[tuple[_Sequence, int]] = []
        preempted = False
        index = 0
        while index < len(self._running) and budget > 0:
            sequence = self._running[index]
            count = min(sequence.known_tokens - sequence.computed_tokens, budget, chunk_cap)
            while not self._allocate(sequence, count):
                if self.config.on_exhaustion == "crash":
                    return self._crash()
                victim = self._running[-1]
                self._preempt(victim)
                preempted = True
                if victim is sequence:
                    break
            else:
                batch.append((sequence, count))
                budget -= count
                index += 1
        # vLLM admits no new request in a step that had to preempt.
        started = started_hits = 0
        while (
            self._waiting and not preempted and budget > 0 and len(self._running) < self.config.max_num_seqs
        ):
            sequence = self._waiting[0]
            hits = self._pool.cached_prefix(
                sequence.hashes, (sequence.known_tokens - 1) // self.config.block_size
            )
            computed = len(hits) * self.config.block_size
            count = min(sequence.known_tokens - computed, budget, chunk_cap)
            if not self._start(sequence, hits, count):
                if self.config.on_exhaustion == "crash":
                    return self._crash()
                break
            self._running.append(self._waiting.popleft())
            batch.append((sequence, count))
            budget -= count
            if not sequence.preempted:
                self._prefix_queries += sequence.known_tokens
                self._prefix_hits += computed
                started += sequence.known_tokens
                started_hits += computed
        prefill = self._prefill_tokens(batch)
        return Step(
            batch=tuple((s.request_id, n) for s, n in batch),
            duration_s=self._step_seconds(batch, prefill),
            prefill_tokens=prefill,
            started_tokens=started,
            started_hit_tokens=started_hits,
        )

    def _chunk_cap(self) -> int:
        """The most tokens one request computes this step: the threshold, unless it is alone."""
        threshold = self.config.long_prefill_token_threshold
        if threshold and len(self._running) + len(self._waiting) > 1:
            return threshold
        return self.config.max_num_batched_tokens

    def complete(self, step: Step) -> list[TokenEvent]:
        """Commit a scheduled step: every sequence whose known tokens are now computed samples one."""
        events: list[TokenEvent] = []
        for request_id, count in step.batch:
            sequence = self._by_id.get(request_id)
            if sequence is None:
                continue  # aborted while the step ran
            sequence.computed_tokens += count
            if sequence.computed_tokens < sequence.known_tokens:
                continue
            sequence.output_tokens += 1
            self._generated_total += 1
            finished = sequence.output_tokens >= sequence.output_target
            if finished:
                self._finish(sequence)
            reason = sequence.finish_reason if finished else None
            events.append(TokenEvent(request_id, sequence.output_tokens, finished, reason))
        return events

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's changes since the last call, in the order they happened."""
        events, self._kv_events = self._kv_events, []
        return events

    def stats(self) -> EngineStats:
        total = self.config.num_gpu_blocks
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            used_blocks=total - self._pool.free_blocks,
            total_blocks=total,
            block_size=self.config.block_size,
            preemptions_total=self._preemptions,
            oom_crashes_total=self._crashes,
            peak_kv_tokens=self._peak_tokens,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._generated_total,
            finished_total=self._finished_total,
            down=self.is_down(),
            prefix_queries_total=self._prefix_queries,
            prefix_hits_total=self._prefix_hits,
            waiting_tokens=sum(s.known_tokens for s in self._waiting),
        )

    def _start(self, sequence: _Sequence, hits: list[int], count: int) -> bool:
        """Take the cached blocks `hits` and allocate for `count` more tokens, or change nothing."""
        size = self.config.block_size
        computed = len(hits) * size
        needed = -(-(computed + count) // size) - len(hits)
        # Cached blocks that no request holds leave the free queue: they count against it too.
        taken = needed + self._pool.free_among(hits)
        if taken > self._pool.free_blocks:
            used = self.config.num_gpu_blocks - self._pool.free_blocks
            self._peak_tokens = max(self._peak_tokens, (used + taken) * size)
            return False
        self._pool.touch(hits)
        sequence.blocks = list(hits)
        sequence.registered = len(hits)
        sequence.computed_tokens = computed
        allocated = self._allocate(sequence, count)
        assert allocated, "the blocks were counted free"
        return True

    def _allocate(self, sequence: _Sequence, count: int) -> bool:
        size = self.config.block_size
        needed = -(-(sequence.computed_tokens + count) // size) - len(sequence.blocks)
        used = self.config.num_gpu_blocks - self._pool.free_blocks
        self._peak_tokens = max(self._peak_tokens, (used + max(needed, 0)) * size)
        if needed > 0:
            blocks = self._pool.allocate(needed)
            if blocks is None:
                return False
            sequence.blocks += blocks
            if self.config.kv_events and (evicted := self._pool.take_evicted()):
                self._kv_events.append(BlockRemoved(tuple(evicted)))
        # vLLM caches a block as soon as a step is scheduled to fill it (kv_cache_manager.allocate_slots).
        full = min(len(sequence.hashes), (sequence.computed_tokens + count) // size)
        stored = [
            index
            for index in range(sequence.registered, full)
            if self._pool.cache(sequence.blocks[index], sequence.hashes[index])
        ]
        sequence.registered = max(sequence.registered, full)
        if self.config.kv_events and stored:
            self._kv_events += stored_events(sequence.hashes, sequence.token_ids, stored, size)
        return True

    def _free(self, sequence: _Sequence) -> None:
        self._pool.free(sequence.blocks)
        sequence.blocks = []
        sequence.registered = 0

    def _preempt(self, sequence: _Sequence) -> None:
        self._running.remove(sequence)
        self._free(sequence)
        sequence.computed_tokens = 0
        sequence.preempted = True
        self._waiting.appendleft(sequence)
        self._preemptions += 1

    def _finish(self, sequence: _Sequence) -> None:
        self._running.remove(sequence)
        self._free(sequence)
        del self._by_id[sequence.request_id]
        self._finished_total += 1

    def _crash(self) -> Step:
        failed = tuple(self._by_id)
        self._running.clear()
        self._waiting.clear()
        self._by_id.clear()
        self._pool.reset()
        if self.config.kv_events and self.config.enable_prefix_caching:
            self._kv_events.append(AllBlocksCleared())
        self._crashes += 1
        self._down_until = self._clock() + self.config.restart_s
        return Step(batch=(), duration_s=0.0, crashed=failed)

    @staticmethod
    def _prefill_tokens(batch: list[tuple[_Sequence, int]]) -> int:
        return sum(n for s, n in batch if s.output_tokens == 0 or s.known_tokens - s.computed_tokens > 1)

    def _step_seconds(self, batch: list[tuple[_Sequence, int]], prefill: int) -> float:
        if not batch:
            return 0.0
        decode_s = (1 + len(batch) / self.config.batch_knee) / self.config.decode_tokens_per_s
        return decode_s + prefill / self.config.prefill_tokens_per_s
