"""The agent's metrics: what it last computed for its node, and what it did with reservations.

Capacity carries where it came from (`source`: manual, engine, static) and the engine read
(`engine`); usage carries what it is (`source`: engine KV figures, or reservations when the node is
reservation-only), so a dashboard never mistakes an estimate for a measurement. The prefix figures
say what reservations that carry a prefix chain expected to find cached, what sharing saved, and what
the agent believes its engine's prefix cache holds. Per class (`class`: chat, long; kvgate.agent.class_usage),
the KV token-seconds and prefill tokens each used, and the prefill in seconds at the node's prefill rate
(--prefill-tokens-per-s): what an operator sizes the soft pools' roles from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from kvgate.agent.class_usage import ClassFigures
from kvgate.headroom.snapshot import NodeHeadroom
from kvgate.telemetry import (
    AGENT_CAPACITY,
    AGENT_CHAT_RESERVE,
    AGENT_CLASS_KV,
    AGENT_CLASS_PREFILL,
    AGENT_CLASS_PREFILL_TOKENS,
    AGENT_ENGINE_SCRAPES,
    AGENT_HEADROOM,
    AGENT_HEALTHY,
    AGENT_HOLDER_TOKENS,
    AGENT_LEND,
    AGENT_PREFIX_CACHED,
    AGENT_PREFIX_FORGOTTEN,
    AGENT_PREFIX_INDEXED,
    AGENT_PREFIX_SAVED,
    AGENT_PREFIX_SHARED,
    AGENT_RESERVATIONS,
    AGENT_RESERVATIONS_LIVE,
    AGENT_RESERVED,
    AGENT_SAFETY_RATIO,
    AGENT_SAFETY_RATIO_STEPS,
    AGENT_STREAM_MESSAGES,
    AGENT_USED,
    GPU_MEMORY_LIMIT,
    GPU_MEMORY_USAGE,
    Tally,
    meter,
    observe,
)

Reading = list[tuple[float, dict[str, str]]]
# Holders shown by name: a bound on the series, since without mTLS a holder is whatever a caller claims.
HOLDERS_SHOWN = 10
ClassCallback = Callable[[CallbackOptions], list[Observation]]


class AgentMetrics:
    def __init__(
        self,
        latest: Callable[[], NodeHeadroom | None],
        prefix_forgotten: Callable[[], int] = lambda: 0,
        classes: Callable[[], ClassFigures] | None = None,
        prefill_tokens_per_s: float = 1.0,
        *,
        ratio_steps: Callable[[], Mapping[str, int]] = dict,
        holders: Callable[[int], Sequence[tuple[str, int]]] = lambda _limit: (),
        chat_reserve: Callable[[int], tuple[int, int]] | None = None,
    ) -> None:
        """`holders(n)`: the n holders whose live reservations are charged the most, with their tokens.
        `chat_reserve(capacity)`: an interactive node's chat reserve, (floor, measured) (None elsewhere)."""
        m = meter("kvgate.agent")
        self._messages = Tally(
            m,
            AGENT_STREAM_MESSAGES,
            "{message}",
            "Stream messages sent, one per subscriber sent to, by cause: first, change, heartbeat, or period "
            "(--heartbeat-ms 0)",
            ("cause",),
        )
        self._scrapes = Tally(m, AGENT_ENGINE_SCRAPES, "{scrape}", "Engine metrics scrapes", ())
        m.create_observable_counter(
            AGENT_SAFETY_RATIO_STEPS,
            callbacks=[lambda _options: [Observation(n, {"direction": d}) for d, n in ratio_steps().items()]],
            unit="{step}",
            description="Steps of the admissible ratio: up (requests waited, no preemption), down "
            "(the engine preempted)",
        )
        if classes is not None:
            _observe_classes(m, classes, prefill_tokens_per_s)
        self._reservations = Tally(
            m,
            AGENT_RESERVATIONS,
            "{reservation}",
            "Reservation events: granted, refused (by reason), released (reason answer: the releaser "
            "said what the request generated, and the node learnt its output length from that), expired, "
            "renewed, lapsed (a renewal of an id not held: its lease ended, or a Release overtook the "
            "renewal), first_token (its holder said the engine started answering it; reason unknown: no "
            "live reservation of that holder's awaited it)",
            ("event", "reason"),
        )
        self._prefix = Tally(
            m,
            AGENT_PREFIX_CACHED,
            "{token}",
            "Prompt tokens of granted reservations that the engine was expected to find in its prefix cache",
            (),
        )
        self._saved = Tally(
            m,
            AGENT_PREFIX_SAVED,
            "{token}",
            "Tokens granted reservations did not charge: prefix blocks live reservations already held",
            (),
        )

        def node_value(
            read: Callable[[NodeHeadroom], float | None],
            labels: Callable[[NodeHeadroom], dict[str, str]] = lambda _: {},
        ) -> Callable[[], Reading]:
            def gauge() -> Reading:
                headroom = latest()
                if headroom is None:
                    return []
                value = read(headroom)
                return [] if value is None else [(float(value), {"node": headroom.node, **labels(headroom)})]

            return gauge

        def gpus(read: Callable[[int | None, int | None], int | None]) -> Callable[[], Reading]:
            def gauge() -> Reading:
                headroom = latest()
                found: Reading = []
                for gpu in headroom.gpus if headroom is not None else ():
                    value = read(gpu.total_bytes, gpu.used_bytes)
                    # Unknown stays absent: a missing series, never a zero.
                    if value is not None:
                        found.append((float(value), {"hw.id": gpu.uuid, "hw.name": gpu.name}))
                return found

            return gauge

        observe(
            m,
            AGENT_CAPACITY,
            "{token}",
            "KV capacity in tokens, by where it came from and the engine read",
            node_value(
                lambda h: h.capacity_tokens,
                lambda h: {"source": h.capacity_source.value, "engine": h.engine_kind or "none"},
            ),
        )
        observe(
            m,
            AGENT_HEADROOM,
            "{token}",
            "capacity x safety - max(used, reserved)",
            node_value(lambda h: h.headroom_tokens),
        )
        observe(
            m,
            AGENT_USED,
            "{token}",
            "KV tokens in use: the engine's figure (source=engine) or, reservation-only, the live "
            "reservations plus an allowance for unreserved requests (source=reservations)",
            node_value(lambda h: h.used_tokens, lambda h: {"source": h.usage_source.value}),
        )
        observe(
            m,
            AGENT_RESERVED,
            "{token}",
            "Tokens held by live reservations",
            node_value(lambda h: h.reserved_tokens),
        )
        observe(
            m,
            AGENT_HOLDER_TOKENS,
            "{token}",
            f"Tokens charged to the live reservations of each of the {HOLDERS_SHOWN} largest holders (a gate "
            "process, the queue, or a client certificate): a dead holder holds this until its lease ends",
            lambda: [(float(tokens), {"holder": holder}) for holder, tokens in holders(HOLDERS_SHOWN)],
        )
        observe(
            m,
            AGENT_RESERVATIONS_LIVE,
            "{reservation}",
            "Live reservations",
            node_value(lambda h: h.reservations),
        )
        observe(
            m,
            AGENT_SAFETY_RATIO,
            "1",
            "The share of capacity granted against, steered by the engine's preemptions",
            node_value(lambda h: h.safety_ratio),
        )
        observe(
            m, AGENT_HEALTHY, "1", "1 when the node can take requests", node_value(lambda h: float(h.healthy))
        )
        observe(
            m,
            AGENT_LEND,
            "{token}",
            "What an interactive node lends long requests now: admissible - chat reserve - reserved, 0 "
            "while its prefill budget or lent prefills at once are spent",
            node_value(lambda h: h.lend_tokens),
        )
        if chat_reserve is not None:

            def reserve_parts(parts: Callable[[int], tuple[int, int]] = chat_reserve) -> Reading:
                headroom = latest()
                if headroom is None:
                    return []
                floor, measured = parts(headroom.capacity_tokens)
                node = headroom.node
                return [
                    (float(floor), {"node": node, "part": "floor"}),
                    (float(measured), {"node": node, "part": "measured"}),
                ]

            observe(
                m,
                AGENT_CHAT_RESERVE,
                "{token}",
                "An interactive node's chat reserve, which lent requests never take: the larger of its floor "
                "(--chat-reserve-min-share x capacity, part=floor) and --chat-reserve-factor x the p99 of "
                "chat's measured use (part=measured)",
                reserve_parts,
            )
        observe(
            m,
            AGENT_PREFIX_INDEXED,
            "{token}",
            "Tokens of prefix blocks the agent believes its engine holds, in use or cached",
            node_value(lambda h: h.prefix.indexed_tokens),
        )
        observe(
            m,
            AGENT_PREFIX_SHARED,
            "{token}",
            "Tokens live reservations share instead of reserving each",
            node_value(lambda h: h.prefix.saved_tokens),
        )
        m.create_observable_counter(
            AGENT_PREFIX_FORGOTTEN,
            callbacks=[lambda _options: [Observation(prefix_forgotten())]],
            unit="{token}",
            description="Idle prefix tokens forgotten because the engine's KV filled or its hits fell short",
        )
        observe(m, GPU_MEMORY_LIMIT, "By", "GPU memory size", gpus(lambda total, _used: total))
        observe(m, GPU_MEMORY_USAGE, "By", "GPU memory in use", gpus(lambda _total, used: used))

    def reserve(self, granted: bool, reason: str) -> None:
        self._reservations.add("granted" if granted else "refused", reason)

    def sent(self, cause: str) -> None:
        self._messages.add(cause)

    def scraped(self) -> None:
        self._scrapes.add()

    def released(self, *, told_generated: bool = False) -> None:
        self._reservations.add("released", "answer" if told_generated else "")

    def first_token(self, known: bool) -> None:
        self._reservations.add("first_token", "" if known else "unknown")

    def expired(self) -> None:
        self._reservations.add("expired", "")

    def renewed(self, renewed: int, lapsed: int) -> None:
        self._reservations.add("renewed", "", n=renewed)
        self._reservations.add("lapsed", "", n=lapsed)

    def prefix_granted(self, cached_tokens: int, saved_tokens: int) -> None:
        self._prefix.add(n=cached_tokens)
        self._saved.add(n=saved_tokens)


def _observe_classes(m: Meter, classes: Callable[[], ClassFigures], prefill_tokens_per_s: float) -> None:
    """Counters per class; a class whose figure is unknown (chat without engine figures) is absent."""

    def per_class(read: Callable[[ClassFigures], tuple[float | None, float | None]]) -> ClassCallback:
        def counter(_options: CallbackOptions) -> list[Observation]:
            chat, long = read(classes())
            found = [(chat, "chat"), (long, "long")]
            return [Observation(value, {"class": name}) for value, name in found if value is not None]

        return counter

    def prefill_s(tokens: int | None) -> float | None:
        return None if tokens is None else tokens / prefill_tokens_per_s

    m.create_observable_counter(
        AGENT_CLASS_KV,
        callbacks=[per_class(lambda f: (f.chat_kv_token_seconds, f.long_kv_token_seconds))],
        unit="{token_second}",
        description="KV token-seconds held per class: long = reservations, chat = the engine's other use",
    )
    m.create_observable_counter(
        AGENT_CLASS_PREFILL_TOKENS,
        callbacks=[per_class(lambda f: (f.chat_prefill_tokens, f.long_prefill_tokens))],
        unit="{token}",
        description="Prompt tokens prefilled per class (long: uncached prompts of grants)",
    )
    m.create_observable_counter(
        AGENT_CLASS_PREFILL,
        callbacks=[per_class(lambda f: (prefill_s(f.chat_prefill_tokens), prefill_s(f.long_prefill_tokens)))],
        unit="s",
        description="Prefill per class, in seconds at the node's prefill rate (--prefill-tokens-per-s)",
    )
