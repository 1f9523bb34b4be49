"""Receive the engine's KV-cache events: the I/O half of kvgate.agent.kv_events (ZeroMQ, on a thread).

One daemon thread owns the sockets (a ZMQ socket belongs to one thread): a SUB socket subscribed to
every topic, bound at the endpoint (vLLM *connects* its PUB socket to a `tcp://host:port` endpoint
without '*': vllm/distributed/kv_events.py ZmqEventPublisher._socket_setup) or connected to a
publisher that binds (vLLM given `tcp://*:port`, `kvgate sim --kv-events-endpoint`). It decodes each
message and checks its sequence; on a break, when vLLM's replay endpoint is given, it asks it for the
batches missed (vLLM keeps the last `buffer_steps`, 10,000 by default) and hands them on first.
What it hands on waits in a bounded deque that the agent's sampling loop drains every period
(`drain`): the loop never waits on the feed, and when the loop falls that far behind the oldest
batches are dropped, which the index sees as a gap (kvgate.agent.prefix_events).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from kvgate.agent.kv_events import (
    END_OF_REPLAY,
    Batch,
    Break,
    KvEventError,
    Sequencer,
    decode,
    decode_payload,
)
from kvgate.errors import ConfigError

log = logging.getLogger(__name__)

MAX_QUEUED = 10_000  # batches waiting for the sampling loop
_POLL_MS = 100
_REPLAY_WAIT_MS = 2_000
_RCVHWM = 100_000  # vLLM's publisher high-water mark (KVEventsConfig.hwm)


class KvEventFeed:
    def __init__(
        self, endpoint: str, *, bind: bool, replay: str | None = None, max_queued: int = MAX_QUEUED
    ) -> None:
        self.endpoint = endpoint
        self.bind = bind
        self.replay = replay
        self.received = 0
        self.undecodable = 0
        self.replayed = 0
        self._queue: deque[Batch] = deque(maxlen=max_queued)
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)

    def start(self, timeout_s: float = 5.0) -> None:
        """Open the sockets on the feed's thread; ConfigError when the endpoint cannot be used."""
        self._thread.start()
        self._ready.wait(timeout_s)
        if self._error is not None:
            raise ConfigError(f"kv events {self.endpoint}: {self._error}") from self._error

    def drain(self) -> list[Batch]:
        """Every batch received since the last call, in order (never waits)."""
        items = []
        while self._queue:
            items.append(self._queue.popleft())
        return items

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if not self._thread.is_alive():  # its sockets are closed: the context can end
            self._context.term()

    def _run(self) -> None:
        try:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, _RCVHWM)
            sub.setsockopt(zmq.LINGER, 0)
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        log.info("kv events: %s %s", "bound at" if self.bind else "connected to", self.endpoint)
        sequence = Sequencer()
        try:
            while not self._stop.is_set():
                if not sub.poll(_POLL_MS):
                    continue
                self._take(sub.recv_multipart(), sequence)
        finally:
            sub.close(0)

    def _take(self, frames: list[bytes], sequence: Sequencer) -> None:
        self.received += 1
        try:
            batch = decode(frames)
        except KvEventError as exc:
            self.undecodable += 1
            log.warning("%s (taken as a gap)", exc)
            return
        lost = sequence.check(batch.seq)
        if lost is not None:
            log.info("kv events: %s", lost.why)
            if lost.kind is Break.GAP and self.replay is not None:
                for missed in self._replayed(lost.first, lost.last):
                    self._queue.append(missed)
        sequence.take(batch.seq)
        self._queue.append(batch)

    def _replayed(self, first: int, last: int) -> list[Batch]:
        """Batches first..last from vLLM's replay endpoint: what its buffer still holds of them."""
        assert self.replay is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        found: list[Batch] = []
        try:
            dealer.connect(self.replay)
            dealer.send_multipart([b"", first.to_bytes(8, "big")])
            while not self._stop.is_set() and dealer.poll(_REPLAY_WAIT_MS):
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else END_OF_REPLAY
                if seq == END_OF_REPLAY:
                    break
                if first <= seq <= last:
                    found.append(decode_payload(seq, frames[-1]))
        except (zmq.ZMQError, KvEventError) as exc:
            log.warning("kv events: replay of %d..%d from %s failed: %s", first, last, self.replay, exc)
        finally:
            dealer.close(0)
        self.replayed += len(found)
        log.info("kv events: replayed %d of batches %d..%d", len(found), first, last)
        return found
