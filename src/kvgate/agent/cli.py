"""`kvgate agent`: run the per-node headroom agent until SIGTERM or SIGINT; `kvgate status`: what a
running agent sees, read from its Subscribe stream (rendered by kvgate.agent.status)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from kvgate.addresses import join_host_port, listen_or_off, split_host_port
from kvgate.agent.cadence import KV_LEVEL, RECENT_S
from kvgate.agent.capacity import DTYPE_BYTES, ModelShape
from kvgate.agent.kv_events import check_endpoint
from kvgate.agent.lending import LendLimits
from kvgate.agent.node import MAX_HOLDER_TOKENS, MAX_LEASE_S, NodeSettings
from kvgate.agent.ratio import CEILING, FLOOR_BELOW_START, FREEZE_S, STEP_DOWN, STEP_UP, WINDOW_S
from kvgate.agent.sources.scrape import metrics_url
from kvgate.errors import ConfigError, HeadroomError
from kvgate.headroom.snapshot import NodeRole
from kvgate.listening import check_listen
from kvgate.telemetry import start_prometheus
from kvgate.tls import ClientTls, ServerTls

if TYPE_CHECKING:
    from kvgate.agent.server import Agent
    from kvgate.headroom.snapshot import NodeHeadroom

log = logging.getLogger(__name__)

DESCRIPTION = """\
Per-node headroom agent. Samples the local engine's Prometheus metrics and NVML every period,
computes KV headroom in tokens (capacity x safety ratio - max(used, reserved)), streams it to every
subscribed gate, and grants or refuses reservations atomically: the single authority for this node.
Capacity comes from --capacity-tokens, else the engine's KV pool, else the model shape
(--kv-layers ...) over NVML free memory.
vLLM and SGLang pages are read as those engines write them (data-parallel engines, TP/PP/DP ranks).
Engines that publish no KV figures (TGI, llama.cpp), or no --engine-metrics, make the node
reservation-only: with --capacity-tokens, usage is the live reservations plus
--unreserved-request-tokens for each request the engine runs or queues beyond them.
With --engine-kv-events, the agent follows vLLM's KV-cache events, so the prompt prefixes it tells
gates about are the ones the engine says it holds. Pair it with vLLM's
  --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                       "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}'
and --engine-kv-events tcp://127.0.0.1:5557 --engine-kv-events-replay tcp://127.0.0.1:5558 (vLLM
connects to an endpoint without '*'; the agent binds it). The gate sends X-Session-ID: <reservation
id> with each request it reserved for (replacing any the client sent), which tells the agent whose
blocks the engine stored (docs/engines.md).

Callers. Each reservation belongs to its holder: only it renews or releases it, and a Reserve of a
live id from another holder is refused (request_id_conflict). With --tls-client-ca the holder is the
caller's certificate identity (first subject alternative name, else common name); without it, the
name the caller sends, which anyone who reaches the port can claim: keep the port to the gate and
queue pods (NetworkPolicy) or turn on mTLS (docs/tls.md). One holder's live reservations are charged
at most --max-holder-tokens (holder_cap), and none outlives --max-lease-s. Ids and holders over 256
bytes, subscriber names over 128 and messages over 64 KiB are refused.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_agent(subparsers)
    _register_status(subparsers)


def _register_agent(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="run the per-node headroom agent",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--listen", required=True, help="host:port to serve gRPC on (port 0 picks one)")
    parser.add_argument(
        "--endpoint",
        required=True,
        help="host:port of this node's engine, where gates pin requests; a gate takes it only on this "
        "agent's own host or where its headroom.allowed_endpoints says",
    )
    parser.add_argument(
        "--engine-metrics",
        metavar="URL",
        help="the engine's Prometheus URL (http://), e.g. http://127.0.0.1:8000/metrics",
    )
    parser.add_argument(
        "--nvml", choices=["on", "off", "fake"], default="on", help="GPU sampling; fake simulates GPUs"
    )
    parser.add_argument(
        "--fake-gpus", type=int, default=8, help="GPUs simulated with --nvml fake (default 8)"
    )
    parser.add_argument(
        "--nvml-hung-after-s",
        type=float,
        default=5.0,
        help="an NVML call running this long makes the node unhealthy (default 5)",
    )
    parser.add_argument(
        "--period-ms",
        type=int,
        default=100,
        help="sampling period: the stream sends at most one message, and scrapes the engine at most "
        "once, per period (default 100)",
    )
    parser.add_argument("--capacity-tokens", type=int, help="KV capacity in tokens, set by hand")
    parser.add_argument(
        "--safety-ratio",
        type=float,
        default=0.9,
        help="fraction of capacity to admit against at start; the engine's preemption counter then steers "
        "it between --safety-ratio-min and --safety-ratio-max (default 0.9)",
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="name in the stream (default $NODE_NAME or the host name)",
    )
    parser.add_argument("--default-lease-s", type=float, default=300.0, help="lease when a gate names none")
    parser.add_argument(
        "--max-lease-s",
        type=float,
        default=MAX_LEASE_S,
        help=f"longest lease granted: what a reservation whose holder never releases it holds the node "
        f"for (default {MAX_LEASE_S:g}; keep it above the gate's headroom.lease_s, 600)",
    )
    parser.add_argument(
        "--max-holder-tokens",
        type=int,
        default=MAX_HOLDER_TOKENS,
        metavar="N",
        help=f"most tokens one holder's live reservations are charged together on this node; past it a "
        f"Reserve is refused with holder_cap (default {MAX_HOLDER_TOKENS}; lower it to keep one gate "
        f"or queue from taking the node whole)",
    )
    parser.add_argument(
        "--engine-stale-after-s",
        type=float,
        default=1.0,
        help="engine figures older than this make the node unhealthy (default 1.0)",
    )
    parser.add_argument(
        "--unreserved-request-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="reservation-only: tokens charged per engine request holding no reservation (default 4096)",
    )
    parser.add_argument(
        "--prefix-index-blocks",
        type=int,
        default=16384,
        metavar="N",
        help="prompt prefix blocks remembered, in use or cached, for prefix-aware placement; the least "
        "recently used idle ones are forgotten first (default 16384)",
    )
    parser.add_argument(
        "--prefix-summary-blocks",
        type=int,
        default=1024,
        metavar="N",
        help="prefix blocks the stream shows the gates, most recently used first (default 1024: 8 KiB)",
    )
    _register_roles(parser)
    _register_control(parser)
    events = parser.add_argument_group("the engine's KV-cache events (vLLM --kv-events-config)")
    where = events.add_mutually_exclusive_group()
    where.add_argument(
        "--engine-kv-events",
        metavar="ENDPOINT",
        help="bind a ZeroMQ SUB socket here (tcp://HOST:PORT) for vLLM's publisher to connect to: vLLM "
        "connects when its endpoint has no '*'",
    )
    where.add_argument(
        "--engine-kv-events-connect",
        metavar="ENDPOINT",
        help="connect to a publisher that binds instead (vLLM with tcp://*:PORT, kvgate sim)",
    )
    events.add_argument(
        "--engine-kv-events-replay",
        metavar="ENDPOINT",
        help="vLLM's replay_endpoint: batches missed are asked for there (it keeps the last 10,000)",
    )
    events.add_argument(
        "--engine-kv-events-max-blocks",
        type=int,
        default=262_144,
        metavar="N",
        help="engine blocks followed at most (the engine's pool holds no more); default 262144",
    )
    parser.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9465",
        help="HOST:PORT of the Prometheus /metrics endpoint; 'off' disables it (default 127.0.0.1:9465)",
    )
    tls = parser.add_argument_group(
        "TLS (files are read again when they change; see docs/tls.md)",
        "With --tls-client-ca, every RPC (Subscribe, Reserve, Release, health) needs a gate certificate "
        "signed by that CA, checked at the handshake.",
    )
    tls.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain)")
    tls.add_argument("--tls-key", metavar="PEM", help="the certificate's private key (unencrypted)")
    tls.add_argument(
        "--tls-client-ca", metavar="PEM", help="accept only clients with a certificate from this CA (mTLS)"
    )
    shape = parser.add_argument_group("static capacity from the model's shape (needs --nvml on or fake)")
    shape.add_argument("--kv-layers", type=int, help="attention layers")
    shape.add_argument("--kv-heads", type=int, default=0, help="KV heads (standard attention)")
    shape.add_argument("--head-dim", type=int, default=0, help="head dimension (standard attention)")
    shape.add_argument("--kv-lora-rank", type=int, default=0, help="MLA latent rank (DeepSeek)")
    shape.add_argument("--qk-rope-head-dim", type=int, default=0, help="MLA rotary key dimension")
    shape.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="KV cache dtype")
    shape.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="cap on GPU memory use")
    parser.set_defaults(func=run)


def _register_roles(parser: argparse.ArgumentParser) -> None:
    limits = LendLimits()
    roles = parser.add_argument_group(
        'soft pools (docs/operations.md, "Soft pools")',
        "An interactive node serves chat and lends what chat leaves to long requests: every Reserve on it "
        "is a long request borrowing, and takes at most capacity x safety ratio - the chat reserve - what "
        "reservations hold, refused with lend_limit past that or past the prompt cap or prefill budget.",
    )
    roles.add_argument(
        "--role",
        choices=[role.value for role in NodeRole],
        default=NodeRole.LONG.value,
        help="long: the node takes long requests only; interactive: it serves chat and lends (default long)",
    )
    roles.add_argument(
        "--chat-reserve-min-share",
        type=float,
        default=limits.min_share,
        metavar="F",
        help=f"interactive: the chat reserve's floor, a share of capacity (default {limits.min_share:g})",
    )
    roles.add_argument(
        "--chat-reserve-factor",
        type=float,
        default=limits.factor,
        metavar="X",
        help=f"interactive: the chat reserve is X x the p99 of chat's per-second peak use over the window, "
        f"when above the floor (default {limits.factor:g})",
    )
    roles.add_argument(
        "--chat-reserve-window-s",
        type=float,
        default=limits.window_s,
        metavar="S",
        help=f"interactive: the window chat's use is measured over (default {limits.window_s:g})",
    )
    roles.add_argument(
        "--lend-max-prompt-tokens",
        type=int,
        default=limits.max_prompt_tokens,
        metavar="N",
        help=f"interactive: the largest uncached prompt of one lent request "
        f"(default {limits.max_prompt_tokens})",
    )
    roles.add_argument(
        "--lend-prefill-budget-tokens",
        type=int,
        default=limits.prefill_budget_tokens,
        metavar="N",
        help=f"interactive: uncached prompt tokens of lent requests still to prefill, at most (default "
        f"{limits.prefill_budget_tokens}; at least --lend-max-prompt-tokens)",
    )
    roles.add_argument(
        "--lend-max-prefills",
        type=int,
        default=limits.max_prefills,
        metavar="N",
        help="interactive: lent prompts being prefilled at once, at most (0: no limit; default 0). For vLLM "
        "with --long-prefill-token-threshold T and --max-num-batched-tokens B: floor((B - your largest chat "
        "prompt) / T), so that every engine step keeps room for a chat prompt",
    )
    roles.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=limits.prefill_tokens_per_s,
        metavar="R",
        help=f"the engine's prefill rate, any role: how fast granted prompts drain from the prefill backlog "
        f"gates place long requests by (and the lent prefill budget), and what turns prefill tokens into "
        f"the per-class prefill seconds (default {limits.prefill_tokens_per_s:g})",
    )


def _lend_limits(args: argparse.Namespace) -> LendLimits:
    try:
        return LendLimits(
            min_share=args.chat_reserve_min_share,
            factor=args.chat_reserve_factor,
            window_s=args.chat_reserve_window_s,
            max_prompt_tokens=args.lend_max_prompt_tokens,
            prefill_budget_tokens=args.lend_prefill_budget_tokens,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            max_prefills=args.lend_max_prefills,
        )
    except ValueError as exc:
        flags = (
            "--chat-reserve-min-share, --chat-reserve-factor, --chat-reserve-window-s, "
            "--lend-max-prompt-tokens, --lend-prefill-budget-tokens, --lend-max-prefills, "
            "--prefill-tokens-per-s"
        )
        raise ConfigError(f"{flags}: {exc}") from exc


def _register_control(parser: argparse.ArgumentParser) -> None:
    ratio = parser.add_argument_group(
        'the admissible ratio (docs/operations.md, "Steered admissible ratio")',
        f"The share of capacity granted against starts at --safety-ratio. It rises by {STEP_UP:g} at the "
        f"end of each {WINDOW_S:g} s in which a request waited for room here (refused for room, or sent "
        f"by a waiter) and the engine preempted nothing (vllm:num_preemptions_total, "
        f"sglang:num_retracted_requests_total); on a preemption it falls by {STEP_DOWN:g} at once, stays "
        f"put for --safety-ratio-freeze-s, and stays under the level that preempted for a while. An engine "
        f"without a preemption counter keeps --safety-ratio; bounds equal to it fix the ratio.",
    )
    ratio.add_argument(
        "--safety-ratio-min",
        type=float,
        metavar="F",
        help=f"the lowest it falls to (default --safety-ratio - {FLOOR_BELOW_START:g})",
    )
    ratio.add_argument(
        "--safety-ratio-max",
        type=float,
        metavar="F",
        help=f"the highest it rises to (default {CEILING:g}, or --safety-ratio when higher)",
    )
    ratio.add_argument(
        "--safety-ratio-freeze-s",
        type=float,
        default=FREEZE_S,
        metavar="S",
        help=f"after a preemption, how long it stays put before it may rise again (default {FREEZE_S:g})",
    )
    stream = parser.add_argument_group(
        'the stream and the engine scrape (docs/operations.md, "Agent stream: on change, with a heartbeat")'
    )
    stream.add_argument(
        "--heartbeat-ms",
        type=int,
        default=1000,
        metavar="MS",
        help="send a message when something a gate uses changed (at most once a period) and at least "
        "this often; gates judge the node stale after 3 heartbeats without one. 0: send every period, "
        "as agents before it did (default 1000)",
    )
    stream.add_argument(
        "--idle-scrape-ms",
        type=int,
        default=500,
        metavar="MS",
        help=f"scrape the engine this often when the node is not under pressure; every period while KV is "
        f"above {KV_LEVEL:g} of admissible, the engine queues, a request was refused room in the last "
        f"{RECENT_S:g} s or holds its place here, or the node is unhealthy (default 500; at least a "
        f"period: 0 scrapes every period). With a scrape's timeout it must stay under "
        f"--engine-stale-after-s",
    )


def _check_control(args: argparse.Namespace) -> None:
    """The steered ratio's and the stream's flags, each against the flags it depends on."""
    start = args.safety_ratio
    low, high = args.safety_ratio_min, args.safety_ratio_max
    if low is not None and not 0 < low <= start:
        raise ConfigError(f"--safety-ratio-min must be in (0, --safety-ratio {start:g}], got {low:g}")
    if high is not None and not start <= high <= 1:
        raise ConfigError(f"--safety-ratio-max must be in [--safety-ratio {start:g}, 1], got {high:g}")
    if args.safety_ratio_freeze_s < 0:
        raise ConfigError(f"--safety-ratio-freeze-s must be >= 0, got {args.safety_ratio_freeze_s:g}")
    if args.heartbeat_ms < 0 or 0 < args.heartbeat_ms < args.period_ms:
        raise ConfigError(
            f"--heartbeat-ms must be 0 (every period) or at least --period-ms ({args.period_ms}), "
            f"got {args.heartbeat_ms}"
        )
    if args.idle_scrape_ms < 0:
        raise ConfigError(f"--idle-scrape-ms must be >= 0, got {args.idle_scrape_ms}")
    # The oldest figures a quiet node holds: the slow interval, plus a scrape's timeout (half a period).
    oldest_s = (_idle_scrape_ms(args) + args.period_ms / 2) / 1000
    if args.engine_metrics is not None and args.engine_stale_after_s <= oldest_s:
        raise ConfigError(
            f"--engine-stale-after-s ({args.engine_stale_after_s:g}) must exceed --idle-scrape-ms "
            f"({args.idle_scrape_ms}) plus a scrape's timeout (half of --period-ms {args.period_ms}): "
            f"{oldest_s:g} s, or a quiet node flaps unhealthy; raise it or lower --idle-scrape-ms"
        )


def _idle_scrape_ms(args: argparse.Namespace) -> int:
    return int(max(args.idle_scrape_ms, args.period_ms))


def settings_from_args(args: argparse.Namespace) -> NodeSettings:
    split_host_port(args.listen, "--listen", allow_port_zero=True)
    listen_or_off(args.metrics_listen, "--metrics-listen")
    split_host_port(args.endpoint, "--endpoint")
    if args.engine_metrics is not None:
        metrics_url(args.engine_metrics, "--engine-metrics")
    if args.period_ms < 10:
        raise ConfigError(f"--period-ms must be >= 10, got {args.period_ms}")
    if not 0 < args.safety_ratio <= 1:
        raise ConfigError(f"--safety-ratio must be in (0, 1], got {args.safety_ratio}")
    if args.capacity_tokens is not None and args.capacity_tokens <= 0:
        raise ConfigError(f"--capacity-tokens must be > 0, got {args.capacity_tokens}")
    _check_reservation_bounds(args)
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.unreserved_request_tokens < 0:
        raise ConfigError(f"--unreserved-request-tokens must be >= 0, got {args.unreserved_request_tokens}")
    if min(args.prefix_index_blocks, args.prefix_summary_blocks) < 1:
        raise ConfigError("--prefix-index-blocks and --prefix-summary-blocks must be >= 1")
    if args.engine_stale_after_s <= 0 or args.nvml_hung_after_s <= 0 or args.fake_gpus < 0:
        raise ConfigError("--engine-stale-after-s and --nvml-hung-after-s must be > 0, --fake-gpus >= 0")
    _check_control(args)
    kv_events = _kv_events_endpoint(args)
    shape = None
    if args.kv_layers is not None:
        if args.nvml == "off":
            raise ConfigError(
                "static capacity (--kv-layers ...) reads free GPU memory: it needs --nvml on or fake"
            )
        shape = ModelShape(
            args.kv_layers,
            DTYPE_BYTES[args.kv_dtype],
            args.kv_heads,
            args.head_dim,
            args.kv_lora_rank,
            args.qk_rope_head_dim,
        )
    if args.capacity_tokens is None and args.engine_metrics is None and shape is None:
        raise ConfigError(
            "the agent needs a capacity: --capacity-tokens, --engine-metrics, or --kv-layers etc."
        )
    return NodeSettings(
        node=args.node_name,
        endpoint=args.endpoint,
        period_s=args.period_ms / 1000,
        safety_ratio=args.safety_ratio,
        capacity_tokens=args.capacity_tokens,
        model_shape=shape,
        gpu_memory_utilization=args.gpu_memory_utilization,
        default_lease_s=args.default_lease_s,
        max_lease_s=args.max_lease_s,
        max_holder_tokens=args.max_holder_tokens,
        engine_stale_after_s=args.engine_stale_after_s,
        unreserved_request_tokens=args.unreserved_request_tokens,
        prefix_index_blocks=args.prefix_index_blocks,
        prefix_summary_blocks=args.prefix_summary_blocks,
        kv_events=kv_events,
        kv_events_max_blocks=args.engine_kv_events_max_blocks,
        role=NodeRole(args.role),
        lending=_lend_limits(args),
        safety_ratio_min=args.safety_ratio_min,
        safety_ratio_max=args.safety_ratio_max,
        safety_ratio_freeze_s=args.safety_ratio_freeze_s,
        heartbeat_s=args.heartbeat_ms / 1000,
        # Without engine metrics there is nothing to scrape.
        idle_scrape_s=_idle_scrape_ms(args) / 1000 if args.engine_metrics else None,
    )


def _check_reservation_bounds(args: argparse.Namespace) -> None:
    if not 0 < args.default_lease_s <= args.max_lease_s:
        raise ConfigError("leases must satisfy 0 < --default-lease-s <= --max-lease-s")
    if args.max_holder_tokens <= 0:
        raise ConfigError(f"--max-holder-tokens must be > 0, got {args.max_holder_tokens}")


def _kv_events_endpoint(args: argparse.Namespace) -> str:
    """The KV-event endpoint followed ("" for none), its flags checked."""
    endpoint: str | None = args.engine_kv_events or args.engine_kv_events_connect
    if endpoint is None:
        if args.engine_kv_events_replay is not None:
            raise ConfigError(
                "--engine-kv-events-replay needs --engine-kv-events or --engine-kv-events-connect"
            )
        return ""
    flag = "--engine-kv-events" if args.engine_kv_events else "--engine-kv-events-connect"
    check_endpoint(endpoint, flag)
    if args.engine_kv_events_replay is not None:
        check_endpoint(args.engine_kv_events_replay, "--engine-kv-events-replay")
    if args.engine_metrics is None:
        raise ConfigError(f"{flag} needs --engine-metrics: the page says whether the engine caches prefixes")
    if args.engine_kv_events_max_blocks < 1:
        raise ConfigError("--engine-kv-events-max-blocks must be >= 1")
    return endpoint


def tls_from_args(args: argparse.Namespace) -> ServerTls:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    return ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)


def build_agent(args: argparse.Namespace) -> Agent:
    # Imported here, not at the top: `kvgate --help` registers every subcommand and should stay light.
    from kvgate.agent.server import Agent
    from kvgate.agent.sources.nvml import NvmlModule, NvmlPoller, NvmlSampler
    from kvgate.agent.sources.scrape import EngineScraper

    settings = settings_from_args(args)
    half_period = settings.period_s / 2
    engine = EngineScraper(args.engine_metrics, half_period) if args.engine_metrics else None
    nvml = None
    if args.nvml != "off":
        module: NvmlModule
        if args.nvml == "fake":
            from kvgate.agent.sources.fake_nvml import FakeNvml, make_gpus

            module = FakeNvml(make_gpus(args.fake_gpus))
        else:
            import pynvml

            module = pynvml
        nvml = NvmlPoller(NvmlSampler(module, time.monotonic), settings.period_s, args.nvml_hung_after_s)
    kv_events = None
    if settings.kv_events:
        from kvgate.agent.sources.kv_events import KvEventFeed

        bind = args.engine_kv_events is not None
        kv_events = KvEventFeed(settings.kv_events, bind=bind, replay=args.engine_kv_events_replay)
    return Agent(settings, engine, nvml, kv_events=kv_events)


def run(args: argparse.Namespace) -> int:
    import uvloop

    # Flag and certificate file errors, and a port another agent holds, surface before anything starts.
    settings_from_args(args)
    tls = tls_from_args(args)
    if tls.enabled:
        tls.open_files("agent TLS")
    check_listen(*split_host_port(args.listen, "--listen", allow_port_zero=True), "--listen")
    uvloop.run(_serve(args))
    return 0


async def _serve(args: argparse.Namespace) -> None:
    start_prometheus(listen_or_off(args.metrics_listen, "--metrics-listen"))
    agent = build_agent(args)
    listen: str = args.listen
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await agent.start(listen, tls_from_args(args))
    host, _ = split_host_port(listen, "--listen", allow_port_zero=True)
    # On stdout, for whoever started the agent with port 0 (tests, the demo).
    print(f"kvgate agent listening on {join_host_port(host, port)}", flush=True)
    await stop.wait()
    log.info("stopping: draining subscribers")
    await agent.stop(grace_s=1.0)


STATUS_DESCRIPTION = """\
What a running agent sees: the engine it reads (kind, engines and ranks), capacity and where it comes
from, used tokens and where they come from (the engine's KV figures, or reservations on a
reservation-only node), reserved tokens, headroom, health and its reason, and how old all that is.
Read from the agent's gRPC Subscribe stream, as a gate reads it. Exit status 0 when the node is
healthy, 1 when it is not, 2 when the agent cannot be read.
"""


def _register_status(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show what a running agent sees",
        description=STATUS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--agent", required=True, metavar="HOST:PORT", help="the agent's gRPC address")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument(
        "--timeout-s", type=float, default=5.0, help="give up when no message arrives this soon (default 5)"
    )
    tls = parser.add_argument_group("TLS to an agent started with --tls-cert (see docs/tls.md)")
    tls.add_argument("--tls-ca", metavar="PEM", help="CA that signed the agent's certificate")
    tls.add_argument("--tls-cert", metavar="PEM", help="client certificate, for agents with --tls-client-ca")
    tls.add_argument("--tls-key", metavar="PEM", help="the client certificate's private key")
    tls.add_argument("--tls-server-name", metavar="NAME", help="name the agent's certificate carries")
    parser.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    from kvgate.agent.status import status_json, status_text, tls_hint
    from kvgate.headroom.credentials import speaks_tls

    host, port = split_host_port(args.agent, "--agent")
    if args.timeout_s <= 0:
        raise ConfigError(f"--timeout-s must be > 0, got {args.timeout_s}")
    tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    try:
        headroom, age_s = asyncio.run(_first_message(args.agent, tls, args.timeout_s))
    except HeadroomError as exc:
        print(f"kvgate status: {exc}", file=sys.stderr)
        hint = tls_hint(speaks_tls(host, port, args.timeout_s), tls.enabled, tls.cert is not None)
        if hint is not None:
            print(f"kvgate status: {hint}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status_json(headroom, args.agent, age_s), indent=2))
    else:
        print(status_text(headroom, args.agent, age_s))
    return 0 if headroom.healthy else 1


async def _first_message(agent: str, tls: ClientTls, timeout_s: float) -> tuple[NodeHeadroom, float]:
    """The agent's next streamed message, and its age by this machine's wall clock."""
    from kvgate.headroom.client import AgentClient
    from kvgate.headroom.credentials import ChannelSecurity

    security = ChannelSecurity(tls, "kvgate status TLS") if tls.enabled else None
    client = AgentClient(agent, 0.1, 1.0, security)
    stream = client.subscribe(f"kvgate status on {socket.gethostname()} pid {os.getpid()}")
    try:
        async with asyncio.timeout(timeout_s):
            message = await stream.next()
    except TimeoutError as exc:
        raise HeadroomError(f"agent {agent}: no message within {timeout_s:g} s") from exc
    finally:
        stream.cancel()
        await client.close()
    if message is None:
        raise HeadroomError(f"agent {agent}: the stream ended before its first message")
    return message, max(0.0, (time.time_ns() - message.sample_time_unix_ns) / 1e9)
