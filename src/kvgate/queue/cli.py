"""`kvgate queue`: the async pool's upstream, a durable queue that runs jobs as nodes free up.

The store's URL may hold a secret (PostgreSQL's password), so it is read from an environment
variable (KVGATE_QUEUE_STORE, or the one `--store-env` names) or a file (`--store-file`, e.g. a
mounted Secret), and shown only redacted. `--store` takes it on the command line only without a
password: argv is anyone's to read on the machine (/proc/PID/cmdline is world-readable, and the
container runtime keeps it in the container's config), where a process's environment is readable
only by its own user and root (/proc/PID/environ, mode 0400).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
from collections.abc import Mapping
from pathlib import Path

from kvgate.config import Config, load_config
from kvgate.errors import ConfigError

log = logging.getLogger(__name__)

STORE_ENV = "KVGATE_QUEUE_STORE"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "queue",
        help="run the async pool's durable, headroom-aware queue",
        description=(
            "Serve the requests the gate routes to the async pool, and the OpenAI Batch API. Each request "
            "is committed to the store before it is answered; a job runs only on a long-pool node whose "
            "agent reserved its KV cache, in priority, tenant-fair, then age order. Held requests are "
            "answered on their connection (up to queue.max_hold_s); `Prefer: respond-async` gets 202 and "
            "a job URL (/v1/kvgate/jobs/{id}). kill -9 loses no acknowledged job: jobs that were running "
            "run again. SIGTERM puts running jobs back in the queue and exits."
        ),
    )
    parser.add_argument("--listen", default="127.0.0.1:8003", help="HOST:PORT to serve HTTP on")
    store = parser.add_mutually_exclusive_group()
    store.add_argument(
        "--store",
        metavar="URL",
        help="sqlite:///PATH (one replica) or postgresql://USER@HOST:PORT/DB (several replicas); a URL "
        "with a password is refused here: use the environment or --store-file",
    )
    store.add_argument(
        "--store-env",
        metavar="NAME",
        help=f"the environment variable holding the store URL (default: {STORE_ENV}, read when no "
        "other --store* flag is given)",
    )
    store.add_argument("--store-file", type=Path, metavar="PATH", help="a file holding the store URL")
    parser.add_argument("--config", type=Path, help="the kvgate YAML file: headroom agents, models, queue")
    parser.add_argument(
        "--tokenizer", type=Path, help="tokenizer of the default model entry (estimates batch lines)"
    )
    parser.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9466",
        help="HOST:PORT of the Prometheus /metrics endpoint; 'off' disables it (default 127.0.0.1:9466)",
    )
    parser.add_argument(
        "--replica-id",
        default=None,
        help="this replica's name in the store (default: host name, pid and a random suffix)",
    )
    parser.set_defaults(func=run)


def resolve_config(args: argparse.Namespace) -> Config:
    from kvgate.gate.cli import with_default_tokenizer

    config = load_config(args.config) if args.config else Config()
    if args.tokenizer:
        config = with_default_tokenizer(config, str(args.tokenizer))
    if not config.headroom.agents and not config.headroom.dns:
        raise ConfigError(
            f"{config.source}: kvgate queue needs headroom.agents or headroom.dns: it runs a job only on a "
            "node whose agent reserved room for it"
        )
    return config


def store_url(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The store URL from the one place the flags name; ConfigError (never showing the URL's
    password) when it is missing, or is given in argv with a password."""
    from kvgate.queue.stores import holds_password

    if args.store is not None:
        if holds_password(args.store):
            raise ConfigError(
                f"--store: the URL holds a password, and argv is readable by every user of the machine; "
                f"put the URL in the environment ({STORE_ENV}, or --store-env NAME) or a file (--store-file)"
            )
        return str(args.store)
    if args.store_file is not None:
        try:
            url = args.store_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--store-file {args.store_file}: {exc.strerror}") from None
        if not url:
            raise ConfigError(f"--store-file {args.store_file} is empty")
        return str(url)
    name = args.store_env or STORE_ENV
    url = environ.get(name, "").strip()
    if not url:
        raise ConfigError(
            f"no store: set {name} to sqlite:///PATH or postgresql://…, or pass --store-file PATH or "
            "--store URL"
        )
    return url


def run(args: argparse.Namespace) -> int:
    import uvloop

    from kvgate.addresses import listen_or_off, split_host_port
    from kvgate.listening import check_listen

    config = resolve_config(args)
    store = store_url(args, os.environ)
    host, port = split_host_port(args.listen, "--listen")
    check_listen(host, port, "--listen")
    replica = args.replica_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    metrics_listen = listen_or_off(args.metrics_listen, "--metrics-listen")
    return uvloop.run(_serve(config, store, replica, (host, port), metrics_listen))


async def _serve(
    config: Config, store: str, replica: str, address: tuple[str, int], metrics_listen: str | None
) -> int:
    from aiohttp import web

    from kvgate.errors import StoreError
    from kvgate.listening import cannot_listen
    from kvgate.queue.service import QueueService
    from kvgate.queue.stores import redacted, shown
    from kvgate.telemetry import start_prometheus

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    start_prometheus(metrics_listen)
    service = QueueService(config, store, replica)
    log.info("queue %s opening its store %s", replica, shown(store))
    try:
        await service.start()
    except StoreError as error:
        log.error("%s", error)
        return 1
    # runner.cleanup() stops listening, then waits this long for the requests in flight: the clients
    # the queue holds are answered while the service still runs jobs (a graceful SIGTERM loses none).
    drain_s = config.queue.drain_s
    runner = web.AppRunner(service.app(), access_log=None, shutdown_timeout=drain_s)
    await runner.setup()
    drained = False
    try:
        try:
            await web.TCPSite(runner, address[0], address[1]).start()
        except OSError as exc:
            raise cannot_listen(address[0], address[1], "--listen", exc) from None
        log.info(
            "queue %s serving on http://%s:%d (store %s)", replica, address[0], address[1], redacted(store)
        )
        stopping = asyncio.ensure_future(stop.wait())
        failing = asyncio.ensure_future(service.failed.wait())
        await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failing.cancel()
        if not service.failed.is_set():
            log.info("queue %s draining: held clients get up to %.0f s to be answered", replica, drain_s)
            await runner.cleanup()
            drained = True
    finally:
        await service.stop()
        if not drained:
            await runner.cleanup()
    return 1 if service.failed.is_set() else 0
