"""`kvgate queue` assembled: the store, the long pool's headroom view, the dispatcher, the runner,
housekeeping, and the HTTP app in front of them.

Store events reach the parts that care: a new or requeued job wakes the dispatcher, an ended job
wakes the held requests waiting on it, a cancelled one cuts its engine call if it runs here.
Housekeeping, every second or so: requeue jobs whose claim lease ran out (another replica died),
expire batch lines past their window, renew the holds of the held clients connected here and cancel
the held jobs whose clients left (kvgate.queue.live), settle batches, refresh the metrics' figures,
and now and then sweep: results older than `queue.result_ttl_s`, expired files and uploads past
`queue.upload_timeout_s`, batches ended long ago; then give the disk back (SQLite).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from kvgate.config import Config
from kvgate.errors import StoreError
from kvgate.headroom import giveback
from kvgate.headroom.credentials import ChannelSecurity
from kvgate.headroom.snapshot import NodeView
from kvgate.headroom.view import HeadroomView
from kvgate.queue.app import JobsApp
from kvgate.queue.batch_http import BatchApi
from kvgate.queue.batchstore import BatchStore
from kvgate.queue.database import RESYNC
from kvgate.queue.dispatcher import Dispatcher, HeadroomSource
from kvgate.queue.engines import HttpEngines
from kvgate.queue.files_http import FilesApi
from kvgate.queue.filestore import FileStore
from kvgate.queue.intake import Intake
from kvgate.queue.jobs import Job
from kvgate.queue.live import LiveRuns, Signals
from kvgate.queue.metrics import QueueMetrics
from kvgate.queue.refusals import QueueRefusals
from kvgate.queue.runner import Abort, Engines, Runner
from kvgate.queue.settle import Settler
from kvgate.queue.store import CANCEL, DONE, NEW, JobStore, QueueStats
from kvgate.queue.stores import open_database

log = logging.getLogger(__name__)

AGENT_CALL_TIMEOUT_S = 1.0
_SWEEP_S = 60.0
_STATS_S = 2.0
_SETTLE_S = 5.0


class QueueService:
    def __init__(
        self,
        config: Config,
        store_url: str,
        replica: str,
        *,
        source: HeadroomSource | None = None,
        engines: Engines | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`source` and `engines` replace the real agents and engines (in-process tests)."""
        self.config = config
        self.replica = replica
        self._store_url = store_url
        self._clock = clock
        self._view: HeadroomView | None = None
        self._source = source
        self._http_engines: HttpEngines | None = None
        if engines is None:
            engines = self._http_engines = HttpEngines(config.queue.engine_timeout_s)
        self._engines: Engines = engines
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-queue")
        self._tasks: set[asyncio.Task[None]] = set()
        self._stats: QueueStats | None = None
        # Set when a background task died: the process should exit rather than serve half a queue.
        self.failed = asyncio.Event()

    async def start(self) -> None:
        config = self.config
        settings = config.queue
        database = open_database(self._store_url)
        self.jobs = JobStore(database)
        self.files = FileStore(database)
        self.batches = BatchStore(database, self.jobs, self.files)
        self._database = database
        leftovers = await self.jobs.start()
        if database.exclusive:
            # Uploads this store shows as running were a dead process's.
            await self.files.sweep(upload_timeout_s=0)
        if self._source is None:
            # The queue renews its reservations while a job runs: a short lease is what a crash leaves.
            # No client waits on its Reserve the way one waits on the gate's, and a Release that times
            # out holds a node's room until the lease ends: give the agents time to answer.
            headroom = dataclasses.replace(
                config.headroom,
                lease_s=settings.reservation_lease_s,
                reserve_timeout_s=max(config.headroom.reserve_timeout_s, AGENT_CALL_TIMEOUT_S),
            )
            agents_tls = config.tls.agents
            self._view = HeadroomView(
                headroom,
                subscriber=f"kvgate-queue:{self.replica}",
                security=ChannelSecurity(agents_tls) if agents_tls.enabled else None,
                # One holder for every replica: any of them releases what a dead one left running.
                holder="kvgate-queue",
                on_demand=True,
            )
            await self._view.start()
            self._source = self._view
        source = self._source
        self.signals = Signals()
        self.live = LiveRuns(self.signals)
        self.metrics = QueueMetrics(lambda: self._stats, lambda: len(self.runner))
        self.runner = Runner(
            self.jobs,
            source,
            self._engines,
            self.live,
            settings=settings,
            owner=self.replica,
            on_end=self._ended,
            clock=self._clock,
        )
        self.dispatcher = Dispatcher(
            self.jobs,
            source,
            self.runner,
            self.replica,
            claim_lease_s=settings.claim_lease_s,
            stale_nodes=config.admission.stale_nodes,
            on_dispatch=self._dispatched,
            clock=self._clock,
            demand=self._view.demand if self._view is not None else lambda wanted: None,
            fairness=config.fairness,
        )
        self.settler = Settler(self.batches, settings.file_ttl_s)
        intake = Intake(config)
        refusals = QueueRefusals(config)
        self._jobs_app = JobsApp(
            config=config,
            store=self.jobs,
            intake=intake,
            nodes=source.snapshot,
            live=self.live,
            signals=self.signals,
            abort=lambda job_id: self.runner.abort(job_id, Abort.CANCELLED),
            refusals=refusals,
            metrics=self.metrics,
            executor=self._executor,
        )
        self._files_api = FilesApi(config=config, files=self.files, intake=intake, refusals=refusals)
        self._batch_api = BatchApi(
            config=config,
            batches=self.batches,
            files=self.files,
            jobs=self.jobs,
            settler=self.settler,
            intake=intake,
            nodes=source.snapshot,
            refusals=refusals,
            metrics=self.metrics,
            executor=self._executor,
        )
        database.subscribe(self._on_event)
        self._spawn(self.dispatcher.run())
        self._spawn(self.runner.keep_claims())
        self._spawn(self._housekeeping())
        if leftovers:
            log.info("requeued %d jobs a previous process left running", len(leftovers))
            self._spawn(self._release_all(leftovers))

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.request.max_body_bytes, middlewares=[self._batch_api.store_errors]
        )
        app.router.add_get("/health", self._health)
        self._files_api.add_routes(app)
        self._batch_api.add_routes(app)
        self._jobs_app.add_routes(app)
        return app

    async def stop(self) -> None:
        """Stop dispatching, put the jobs running here back in the queue, let go of everything."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.runner.stop()
        if self._view is not None:
            await self._view.stop()
        if self._http_engines is not None:
            await self._http_engines.close()
        await self._database.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def nodes(self) -> tuple[NodeView, ...]:
        """The long pool's nodes as this replica's dispatcher sees them."""
        assert self._source is not None
        return self._source.snapshot()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("queue task %s died", task.get_name(), exc_info=task.exception())
            self.failed.set()

    def _on_event(self, event: str) -> None:
        if event in (NEW, RESYNC):
            self.dispatcher.poke(reload=True)
            if event == RESYNC:
                self.signals.signal_all()
        elif event.startswith(CANCEL):
            job_id = event.removeprefix(CANCEL)
            self.runner.abort(job_id, Abort.CANCELLED)
            self.signals.signal(job_id)
        elif event.startswith(DONE):
            self.signals.signal(event.removeprefix(DONE))
            # A queued job may have left the queue (cancelled, failed): the waiting set changed.
            self.dispatcher.poke(reload=True)

    def _dispatched(self, job: Job) -> None:
        if job.started_at is not None:
            priorities = self.config.admission.priorities
            name = priorities[job.priority] if job.priority < len(priorities) else str(job.priority)
            self.metrics.dispatched(max(0.0, job.started_at - job.created_at), name)

    def _ended(self, job: Job, how: str) -> None:
        self.metrics.ended(how)
        self.dispatcher.poke()
        if job.batch_id is not None:
            self._spawn(self._settle(job.batch_id))

    async def _settle(self, batch_id: str) -> None:
        try:
            await self.settler.settle(batch_id)
        except StoreError as error:
            log.warning("batch %s not settled yet: %s", batch_id, error)

    async def _release_all(self, jobs: list[Job]) -> None:
        assert self._source is not None
        for job in jobs:
            if job.node is not None and job.reservation is not None:
                await giveback.release(self._source, job.node, job.reservation)

    async def _housekeeping(self) -> None:
        settings = self.config.queue
        period = min(1.0, settings.claim_lease_s / 3, (settings.reattach_s or 3.0) / 3)
        due = dict.fromkeys(("holds", "stats", "settle", "sweep"), 0.0)
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            try:
                recovered = await self.jobs.recover()
                if recovered:
                    log.warning("requeued %d jobs whose claim lease ran out", len(recovered))
                    self._spawn(self._release_all(recovered))
                for batch_id in await self.jobs.expire():
                    await self.settler.settle(batch_id)
                if settings.reattach_s and now >= due["holds"]:
                    # A third of the hold: two renewals may fail before a connected client's job lapses.
                    # A lapsed job is never dispatched (the store's filter), so cancelling it can wait.
                    due["holds"] = now + settings.reattach_s / 3
                    await self.jobs.hold(self.signals.connected(), settings.reattach_s)
                    self.metrics.abandoned(len(await self.jobs.abandon()))
                if now >= due["stats"]:
                    due["stats"] = now + _STATS_S
                    self._stats = await self.jobs.stats()
                if now >= due["settle"]:
                    due["settle"] = now + _SETTLE_S
                    await self.settler.settle_all()
                if now >= due["sweep"]:
                    due["sweep"] = now + _SWEEP_S
                    await self.sweep()
            except StoreError as error:
                log.warning("housekeeping: %s", error)

    async def sweep(self) -> None:
        """Delete what has been kept long enough, then give the disk it held back."""
        settings = self.config.queue
        await self.jobs.sweep(settings.result_ttl_s)
        await self.files.sweep(settings.upload_timeout_s)
        # A batch outlives every file it may name (its input and output files expire within
        # file_ttl_s), so that its ids stay meaningful while they may be asked for.
        await self.batches.sweep(settings.file_ttl_s)
        await self._database.reclaim()
