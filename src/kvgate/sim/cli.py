"""`kvgate sim`: run one simulated GPU node (an OpenAI-compatible server with vLLM's or SGLang's
/metrics)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from kvgate.addresses import split_host_port
from kvgate.errors import ConfigError
from kvgate.listening import cannot_listen
from kvgate.sim.engine import EngineConfig
from kvgate.sim.layout import Layout
from kvgate.sim.tokens import ByteQuads, SimTokenizer, load_tokenizer

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="run a simulated GPU inference node",
        description=(
            "Serve /v1/chat/completions, /v1/completions (streaming and not), /v1/models, /health and "
            "/metrics from a model of one GPU node: KV blocks allocated chunk by chunk during prefill and a "
            "block at a time during decode, batched prefill and decode throughput, and on exhaustion either "
            "vLLM V1's preemption or a CUDA-OOM crash that fails every in-flight request and keeps the node "
            "down for --restart-s. /metrics is rendered by prometheus_client as vLLM or SGLang (--engine) "
            "render theirs, with their labels for data-parallel engines and TP/PP ranks. Prompt tokens are "
            "counted with --tokenizer, else as ceil(UTF-8 bytes / 4) of the text parts. Automatic prefix "
            "caching as vLLM's: full prompt blocks cached under chained hashes, shared by every request "
            "with that prefix, free ones evicted least recently used first; cached tokens skip prefill. "
            "It answers what the engine it plays answers about itself and its tokens, so routers treat "
            "it as that engine: as vLLM /version, /tokenize, /v1/chat/completions/render, "
            "/v1/completions/render, /server_info, /get_server_info and /kv_event_sources; as SGLang "
            "/tokenize, /server_info, /get_server_info, /model_info and /get_load. Token ids come from "
            "the same rule as the counts, so /tokenize agrees with what a request is charged."
        ),
    )
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to serve on")
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        required=True,
        metavar="N",
        help="KV-cache size in tokens of each engine (each data-parallel rank)",
    )
    parser.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default="vllm",
        help="whose /metrics page to serve (default vllm)",
    )
    parser.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="N",
        help="engines behind this endpoint, each of --kv-capacity-tokens (default 1)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="TP ranks per engine: one shared pool; SGLang's page shows every rank (default 1)",
    )
    parser.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="N",
        help="PP stages per engine: one shared pool; SGLang's page shows every stage (default 1)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="count prompt tokens with this tokenizer (sentencepiece .model or tokenizer.json)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=32768,
        metavar="N",
        help="longest prompt + max_tokens accepted; longer requests get vLLM's 400 (default 32768)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=20000.0,
        metavar="R",
        help="prefill throughput of the node (default 20000)",
    )
    parser.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=50.0,
        metavar="R",
        help="decode speed of one sequence on an idle node; batching slows it (default 50)",
    )
    parser.add_argument(
        "--on-exhaustion",
        choices=["crash", "preempt"],
        default="preempt",
        help="what a full KV cache does: preempt the newest request (vLLM V1) or crash (CUDA OOM)",
    )
    parser.add_argument(
        "--restart-s",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a crashed node refuses connections (default 10)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cache prompt blocks and reuse them across requests, as vLLM does by default (default on)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="requests without max_tokens run to max-model-len, as with vLLM's ignore_eos "
        "(a request can ask for it with the field of that name); with max_tokens the node always "
        "generates exactly max_tokens",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        metavar="tcp://HOST:PORT",
        help="publish the prefix cache's changes as vLLM's KV events on a ZMQ PUB socket bound here "
        "(each data-parallel rank on PORT + rank; port 0 picks free ports); /kv_event_sources "
        "reports where (default: off)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="a stream sends its first token at once, then a chunk every N tokens and the last, as "
        "vLLM's and SGLang's --stream-interval (default 1: every token)",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed for output lengths and text")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="KV block size in tokens")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="token budget of one engine step (the prefill chunk size)",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        metavar="N",
        help="as vLLM's flag: no request computes more than N tokens in a step while others run or "
        "wait, so a long prompt leaves budget to the requests behind it (default 0: no cap)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, metavar="N", help="most sequences in one batch"
    )
    parser.add_argument(
        "--model-name", default="kvgate-sim", help="model name served and reported in metrics"
    )
    parser.add_argument(
        "--node-name", default=None, help="name in the x-kvgate-sim-node header (default: --listen)"
    )
    parser.set_defaults(func=run)


def parse_listen(value: str) -> tuple[str, int]:
    return split_host_port(value, "--listen", allow_port_zero=True)


def run(args: argparse.Namespace) -> int:
    host, port = parse_listen(args.listen)
    config = EngineConfig(
        kv_capacity_tokens=args.kv_capacity_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        on_exhaustion=args.on_exhaustion,
        restart_s=args.restart_s,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        ignore_eos=args.ignore_eos,
    )
    layout = Layout(args.engine, args.data_parallel, args.tensor_parallel, args.pipeline_parallel)
    tokenizer = ByteQuads() if args.tokenizer is None else load_tokenizer(args.tokenizer)
    if args.kv_events_endpoint is not None and not args.kv_events_endpoint.startswith("tcp://"):
        raise ConfigError(f"--kv-events-endpoint must be tcp://HOST:PORT, got {args.kv_events_endpoint!r}")
    server = _Served(
        config,
        layout,
        tokenizer,
        args.model_name,
        args.node_name or args.listen,
        args.kv_events_endpoint,
        args.stream_interval,
    )
    asyncio.run(_serve(server, (host, port)))
    return 0


@dataclass(frozen=True, slots=True)
class _Served:
    config: EngineConfig
    layout: Layout
    tokenizer: SimTokenizer
    model_name: str
    node_name: str
    kv_events_endpoint: str | None
    stream_interval: int = 1


async def _serve(served: _Served, address: tuple[str, int]) -> None:
    # Imported here so that `kvgate --help` does not load the HTTP stack.
    from aiohttp import web

    from kvgate.sim.server import SimServer

    server = SimServer(
        served.config,
        model_name=served.model_name,
        node_name=served.node_name,
        layout=served.layout,
        tokenizer=served.tokenizer,
        kv_events_endpoint=served.kv_events_endpoint,
        stream_interval=served.stream_interval,
    )
    host, port = address
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    # Handlers first: a SIGTERM that arrives as soon as the port opens still stops it cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise cannot_listen(host, port, "--listen", exc) from None
        log.info("simulated node %s serving on http://%s:%d", server.node_name, host, port)
        await stop.wait()
    finally:
        await runner.cleanup()
