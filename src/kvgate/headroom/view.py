"""The gate's view of every agent: one long-lived Subscribe stream each, Reserve, Release and Renew.

The view holds data, not decisions: which node to choose, and what to do with a stale or unhealthy
one, is the policy's business. For each agent it keeps the latest NodeHeadroom, when it arrived
(by the injected monotonic clock), and whether the stream is up. A stream that ends, fails or stays
silent for `idle_timeout_s` is reopened after a jittered exponential backoff, so a restarted agent is
found again and a fleet of gates does not reconnect in lock step. An agent that sends on change says
how often it sends at least (its heartbeat): it is stale, and its stream hung, only after a few
heartbeats without a message (kvgate.config.headroom). With TLS (a ChannelSecurity) the view
looks at the certificate files every `reload_interval_s` and, when they changed, reconnects to every
agent with them.

Each message's engine endpoint is vetted before the view keeps it (kvgate.config.headroom): a
node whose agent reports an endpoint off its own host, or on a port not allowed, is kept as unhealthy,
with the reason, so no request is ever pinned there. The view reserves and releases as one holder
(`holder`, by default its subscriber name); an agent that requires client certificates holds the
reservations under the certificate's identity instead.

Failure channels: `reserve` returns a ReserveOutcome for every answer the agent gives, refusals
included; it raises HeadroomError when it gets no answer (agent unknown, unreachable, or slower than
`reserve_timeout_s`: AgentCallError, when the call went out). `release` raises the same way;
kvgate.headroom.giveback tries it again, and gives back a Reserve that got no answer; the
reservation's lease is the last net.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import random
import socket
import time
from collections.abc import Callable, Sequence

from kvgate.addresses import split_host_port
from kvgate.config.headroom import HeadroomSettings, IpAddress, hung_after, ip_or_none, stale_after
from kvgate.errors import ConfigError, HeadroomError
from kvgate.headroom.client import AgentClient, HeadroomStream
from kvgate.headroom.credentials import ChannelSecurity
from kvgate.headroom.resolve import Resolver, resolve_agents
from kvgate.headroom.snapshot import (
    ExpectedRelease,
    NodeHeadroom,
    NodeView,
    PrefixChain,
    PrefixSummary,
    ReleaseOutcome,
    ReserveOutcome,
    TenantCharge,
    prefill_left,
)

log = logging.getLogger(__name__)

# How long an on-demand view keeps following the agents after the last demand: a queue whose jobs come
# in trickles does not reconnect for each one.
LINGER_S = 10.0
# A renewal is off the request path and has a third of a lease to land: it may take far longer than a
# Reserve (reserve_timeout_s) before it counts as failed.
RENEW_TIMEOUT_S = 1.0


class _Link:
    """One agent: its client, its stream task and what it last said."""

    def __init__(self, client: AgentClient) -> None:
        self.client = client
        self.latest: NodeHeadroom | None = None
        self.received_at = -math.inf
        self.connected = False
        self.task: asyncio.Task[None] | None = None
        # The agent's sample number at the latest answer taken on this stream (LedgerFigures.seq).
        self.answered_seq = 0
        # The endpoint last vetted on this stream, why it was refused ("" if taken), and until when
        # that verdict holds (a failed lookup is tried again after resolve_interval_s).
        self.vetted: tuple[str, str, float] | None = None


class HeadroomView:
    def __init__(
        self,
        settings: HeadroomSettings,
        clock: Callable[[], float] = time.monotonic,
        resolver: Resolver = resolve_agents,
        rng: Callable[[], float] = random.random,
        subscriber: str | None = None,
        *,
        security: ChannelSecurity | None = None,
        holder: str | None = None,
        on_demand: bool = False,
    ) -> None:
        """`on_demand`: follow the agents' streams only while `demand(True)` says someone needs them
        (and LINGER_S after): kvgate queue, whose dispatcher needs headroom only while jobs wait, and
        otherwise decodes every agent's every message for nothing (0.5-0.9 ms of CPU per request of
        the Mooncake replay, docs/benchmarks.md). Reserve and Release work either way; a paused link
        keeps its latest message (what the node admits when idle) but is not connected, so nothing is
        placed on it until its stream is back."""
        self.settings = settings
        self._security = security
        self._clock = clock
        self._resolver = resolver
        self._rng = rng
        self._subscriber = subscriber or f"{socket.gethostname()}:{os.getpid()}"
        self._holder = holder or self._subscriber
        self._endpoints = settings.endpoint_rule()
        self._links: dict[str, _Link] = {}
        self._resolve_task: asyncio.Task[None] | None = None
        self._tls_task: asyncio.Task[None] | None = None
        self._update = asyncio.Event()
        self._on_demand = on_demand
        self._following = not on_demand
        self._pause: asyncio.TimerHandle | None = None

    def demand(self, wanted: bool) -> None:
        """Whether the agents' streams are needed now (only an `on_demand` view pauses them): wanted,
        they are followed at once; not wanted, they stop LINGER_S later unless wanted again first."""
        if wanted:
            if self._pause is not None:
                self._pause.cancel()
                self._pause = None
            if not self._following:
                self._following = True
                for address, link in self._links.items():
                    self._follow_link(address, link)
        elif self._following and self._pause is None and self._on_demand:
            self._pause = asyncio.get_running_loop().call_later(LINGER_S, self._stop_following)

    def _stop_following(self) -> None:
        self._pause = None
        self._following = False
        for link in self._links.values():
            if link.task is not None:
                link.task.cancel()
                link.task = None
            link.connected = False

    def _follow_link(self, address: str, link: _Link) -> None:
        if link.task is None or link.task.done():
            link.task = asyncio.create_task(self._follow(address, link), name=f"kvgate-headroom-{address}")

    async def start(self) -> None:
        for address in self.settings.agents:
            self._add(address)
        if self.settings.dns is not None:
            await self._resolve_once()
            self._resolve_task = asyncio.create_task(self._resolve_forever(), name="kvgate-headroom-dns")
        if self._security is not None:
            self._tls_task = asyncio.create_task(self._watch_tls(self._security), name="kvgate-headroom-tls")

    async def stop(self) -> None:
        if self._pause is not None:
            self._pause.cancel()
        for task in (self._tls_task, self._resolve_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for address in list(self._links):
            await self._remove(address)

    def snapshot(self) -> tuple[NodeView, ...]:
        now = self._clock()
        return tuple(
            NodeView.seen(
                address,
                link.latest,
                link.received_at,
                now=now,
                connected=link.connected,
                stale_after_s=stale_after(self.settings.stale_after_s, _heartbeat_ms(link.latest)),
            )
            for address, link in sorted(self._links.items())
        )

    async def wait_update(self, timeout_s: float) -> bool:
        """Wait until any agent sends a message; False when `timeout_s` passed first."""
        event = self._update
        try:
            # Not asyncio.wait_for: on Python 3.11 it can swallow a cancel that meets a set event.
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            return False
        return True

    async def reserve(
        self,
        node: str,
        request_id: str,
        tokens: int,
        prefix: PrefixChain | None = None,
        lease_s: float | None = None,
        *,
        output_tokens: int = 0,
        waiting_since_unix_ns: int = 0,
        rank: int = 0,
        fair_service: float = 0.0,
        hold_slot: bool = False,
        charge: TenantCharge | None = None,
        reports_first_token: bool = False,
    ) -> ReserveOutcome:
        """Ask the agent `node` (a NodeView.agent) to charge `tokens`, of which `output_tokens` are the
        request's output budget (0: unknown); `waiting_since_unix_ns`, `rank` and `hold_slot`: its place
        in the one waiting order (kvgate.agent.backfill). See the module doc for errors."""
        link = self._link(node)
        lease = self.settings.lease_s if lease_s is None else lease_s
        outcome = await link.client.reserve(
            request_id,
            tokens,
            lease,
            self._holder,
            self.settings.reserve_timeout_s,
            prefix=prefix,
            output_tokens=output_tokens,
            waiting_since_unix_ns=waiting_since_unix_ns,
            rank=rank,
            fair_service=fair_service,
            hold_slot=hold_slot,
            charge=charge,
            reports_first_token=reports_first_token,
        )
        self._merge(link, outcome)
        told_service = outcome.after is not None and outcome.after.tenant is not None
        if outcome.granted and charge is not None and not told_service:
            self._merge_service(link, charge, outcome.charged_tokens, tokens)
        if outcome.granted:
            self._merge_prefill(link, max(0, tokens - output_tokens - outcome.cached_tokens))
            if prefix is not None:
                self._merge_prefix(link, prefix)
        return outcome

    async def first_token(self, node: str, request_id: str) -> bool:
        """The engine started answering `request_id` (a reservation made with reports_first_token)."""
        link = self._link(node)
        return await link.client.first_token(request_id, self._holder, self.settings.reserve_timeout_s)

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        """Give back `request_id`'s reservation; `unanswered`: the Reserve got no answer (giveback);
        `generated_tokens`: what the request generated by its engine's answer (0: not read)."""
        link = self._link(node)
        outcome = await link.client.release(
            request_id,
            self._holder,
            self.settings.reserve_timeout_s,
            unanswered=unanswered,
            generated_tokens=generated_tokens,
        )
        self._merge(link, outcome)
        return outcome

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]:
        """Extend the leases of this view's reservations `request_ids` on `node` by `lease_s` from now,
        in one call: the ids the agent no longer holds for us (lapsed)."""
        link = self._link(node)
        return await link.client.renew_leases(
            request_ids, self._holder, self.settings.lease_s, RENEW_TIMEOUT_S
        )

    def _link(self, node: str) -> _Link:
        link = self._links.get(node)
        if link is None:
            raise HeadroomError(f"no agent {node} in the headroom view (removed by DNS, or never configured)")
        return link

    @staticmethod
    def _merge_service(link: _Link, charge: TenantCharge, charged_tokens: int, reserved_tokens: int) -> None:
        """This view's own grant counts in its tenant's service, held and reserved tokens at once, before
        the agent's next message says so: the gate's line is ordered by it straight after the grant,
        the next request of that tenant sees it in its share, and its quota, which counts the growth of
        the reserved tokens, is not given back what the grant took (kvgate.policy.tenant_limits). An
        agent that tells the tenant's standing in its answer (LedgerFigures.tenant) needs none of this."""
        latest = link.latest
        if latest is None:
            return
        tenant = charge.tenant
        service = dict(latest.tenant_service)
        service[tenant] = service.get(tenant, 0.0) + charge.cost
        held = dict(latest.tenant_held)
        held[tenant] = held.get(tenant, 0) + charged_tokens
        reserved = dict(latest.tenant_tokens)
        if latest.publishes_tenant_tokens:
            reserved[tenant] = reserved.get(tenant, 0) + reserved_tokens
        link.latest = dataclasses.replace(
            latest, tenant_service=service, tenant_held=held, tenant_tokens=reserved
        )

    def _merge(self, link: _Link, outcome: ReserveOutcome | ReleaseOutcome) -> None:
        """The agent's answer is newer than the last pushed sample: its figures replace the sample's,
        which keeps its age (so the forecast it tells is shifted to count from the sample). An answer
        that tells `after` is all the stream will say of what the call changed (kvgate.agent.subscribers);
        one from an agent before it tells headroom and reserved tokens alone."""
        latest = link.latest
        if latest is None:
            return
        after = outcome.after
        if after is None:
            reservations = (
                outcome.reservations if isinstance(outcome, ReserveOutcome) else latest.reservations
            )
            link.latest = dataclasses.replace(
                latest,
                headroom_tokens=outcome.headroom_tokens,
                reserved_tokens=outcome.reserved_tokens,
                reservations=reservations,
            )
            return
        link.answered_seq = max(link.answered_seq, after.seq)
        link.latest = after.onto(latest, self._clock() - link.received_at)

    def _taken(self, link: _Link, message: NodeHeadroom) -> NodeHeadroom:
        """`message` as the view keeps it. One sampled before a call whose answer the view already took
        (its seq at most the answer's) can arrive after that answer, on its own stream: its other figures
        are the newest, but what the view took from its own calls' answers is kept, aged to now."""
        latest = link.latest
        if latest is None or message.seq > link.answered_seq:
            return message
        age_s = self._clock() - link.received_at
        backlog = prefill_left(latest.prefill_backlog_tokens, age_s, latest.prefill_tokens_per_s)
        return dataclasses.replace(
            message,
            headroom_tokens=latest.headroom_tokens,
            reserved_tokens=latest.reserved_tokens,
            reservations=latest.reservations,
            freed_tokens_total=latest.freed_tokens_total,
            releases=tuple(ExpectedRelease(max(0.0, r.after_s - age_s), r.tokens) for r in latest.releases),
            tenant_service=latest.tenant_service,
            tenant_held=latest.tenant_held,
            tenant_tokens=latest.tenant_tokens,
            prefill_backlog_tokens=math.ceil(backlog),
            prefix=latest.prefix,
        )

    def _merge_prefill(self, link: _Link, uncached_prompt_tokens: int) -> None:
        """The grant's prompt joins the node's prefill backlog before the agent's next message says so.
        The backlog is kept as of the message and drained by its age (NodeView.prefill_backlog_tokens),
        so what is added now is added with what that age will drain of it."""
        latest = link.latest
        if latest is None:
            return
        age_s = self._clock() - link.received_at
        rate = latest.prefill_tokens_per_s
        left = prefill_left(latest.prefill_backlog_tokens, age_s, rate)
        backlog = math.ceil(left + uncached_prompt_tokens + age_s * rate)
        link.latest = dataclasses.replace(latest, prefill_backlog_tokens=backlog)

    @staticmethod
    def _merge_prefix(link: _Link, chain: PrefixChain) -> None:
        """The node now holds `chain`: the next request with its prefix finds it before the agent's next
        message says so (which replaces this, generation and all)."""
        if link.latest is not None:
            known = link.latest.prefix
            blocks = known.blocks | frozenset(chain.blocks)
            summary = PrefixSummary(blocks, known.indexed_tokens, known.saved_tokens, generation=0)
            link.latest = dataclasses.replace(link.latest, prefix=summary)

    def _add(self, address: str) -> None:
        if address in self._links:
            return
        link = _Link(
            AgentClient(
                address, self.settings.reconnect_initial_s, self.settings.reconnect_max_s, self._security
            )
        )
        self._links[address] = link
        if self._following:
            self._follow_link(address, link)
        log.info("following agent %s", address)

    async def _remove(self, address: str) -> None:
        link = self._links.pop(address)
        if link.task is not None:
            link.task.cancel()
            await asyncio.gather(link.task, return_exceptions=True)
        await link.client.close()
        log.info("stopped following agent %s", address)

    async def _follow(self, address: str, link: _Link) -> None:
        failures = 0
        while True:
            stream = link.client.subscribe(self._subscriber)
            link.vetted = None  # a new stream may reach the agent at a new address
            link.answered_seq = 0  # and a restarted agent counts its samples from 1
            try:
                while (headroom := await self._next(stream, link.latest)) is not None:
                    link.latest = await self._vetted(address, link, self._taken(link, headroom))
                    link.received_at = self._clock()
                    link.connected = True
                    failures = 0
                    self._notify()
                log.info("agent %s ended its stream", address)
            except HeadroomError as exc:
                log.warning("%s", exc)
            except TimeoutError:
                silence = hung_after(self.settings.idle_timeout_s, _heartbeat_ms(link.latest))
                log.warning("agent %s sent nothing for %.2fs; reconnecting", address, silence)
            finally:
                stream.cancel()
                link.connected = False
            await asyncio.sleep(self._backoff(failures))
            failures += 1

    async def _vetted(self, address: str, link: _Link, headroom: NodeHeadroom) -> NodeHeadroom:
        """`headroom` as it came, or as unhealthy when its engine endpoint is refused (logged once
        per verdict: a refused endpoint is a misconfiguration or an agent not to be trusted)."""
        endpoint = headroom.endpoint
        now = self._clock()
        if link.vetted is None or link.vetted[0] != endpoint or link.vetted[2] <= now:
            problem, retry = await self._endpoint_problem(address, endpoint)
            previous = link.vetted[1] if link.vetted is not None else ""
            if problem and problem != previous:
                log.warning(
                    "agent %s: engine endpoint %s refused, node unhealthy: %s", address, endpoint, problem
                )
            elif previous and not problem:
                log.info("agent %s: engine endpoint %s taken", address, endpoint)
            link.vetted = (endpoint, problem, now + self.settings.resolve_interval_s if retry else math.inf)
        problem = link.vetted[1]
        if not problem:
            return headroom
        return dataclasses.replace(headroom, healthy=False, reason=f"endpoint_refused: {problem}")

    async def _endpoint_problem(self, address: str, endpoint: str) -> tuple[str, bool]:
        """Why the agent at `address` may not pin requests to `endpoint` ("" when it may), and
        whether that verdict came from a failed lookup (to be tried again)."""
        try:
            host, port = split_host_port(endpoint, "the agent's endpoint")
        except ConfigError as exc:
            return str(exc), False
        rule = self._endpoints
        try:
            agent = await self._addresses(split_host_port(address, "agent")[0])
            found = frozenset() if rule.named(host) else await self._addresses(host)
        except HeadroomError as exc:
            return f"cannot check it: {exc}", True
        return rule.problem(host, port, found, agent), False

    async def _addresses(self, host: str) -> frozenset[IpAddress]:
        literal = ip_or_none(host)
        if literal is not None:
            return frozenset((literal,))
        found = await self._resolver(host, 0)  # "ip:0" strings
        hosts = (split_host_port(entry, host, allow_port_zero=True)[0] for entry in found)
        return frozenset(ip for ip in map(ip_or_none, hosts) if ip is not None)

    async def _next(self, stream: HeadroomStream, latest: NodeHeadroom | None) -> NodeHeadroom | None:
        """The stream's next message; TimeoutError when the agent stays silent longer than its
        heartbeat (as `latest` says it) allows."""
        # Not asyncio.wait_for: on Python 3.11 it turns a cancel that meets a finished read into that
        # read's result or error, and a cancelled follower would then reconnect forever.
        async with asyncio.timeout(hung_after(self.settings.idle_timeout_s, _heartbeat_ms(latest))):
            return await stream.next()

    def _backoff(self, failures: int) -> float:
        ceiling = min(
            self.settings.reconnect_max_s, self.settings.reconnect_initial_s * 2.0 ** min(failures, 32)
        )
        return ceiling * (0.5 + 0.5 * self._rng())

    def _notify(self) -> None:
        self._update.set()
        self._update = asyncio.Event()

    async def _watch_tls(self, security: ChannelSecurity) -> None:
        while True:
            await asyncio.sleep(security.settings.reload_interval_s)
            if security.refresh():
                log.info("agent TLS files changed; reconnecting to %d agents", len(self._links))
                await asyncio.gather(*(self._reconnect(a, link) for a, link in list(self._links.items())))

    async def _reconnect(self, address: str, link: _Link) -> None:
        """A new channel with the new credentials, and the stream reopened on it at once (no backoff)."""
        if link.task is not None:
            link.task.cancel()
            await asyncio.gather(link.task, return_exceptions=True)
        # Twice the deadline of any Reserve/Release in flight: they end with their own answer or
        # timeout, never with a cancellation raised into the request that made them.
        await link.client.renew(2 * self.settings.reserve_timeout_s)
        if self._links.get(address) is link:
            link.task = asyncio.create_task(self._follow(address, link), name=f"kvgate-headroom-{address}")

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resolve_interval_s)
            await self._resolve_once()

    async def _resolve_once(self) -> None:
        assert self.settings.dns is not None
        host, port = split_host_port(self.settings.dns, "headroom.dns")
        try:
            found = await self._resolver(host, port)
        except HeadroomError as exc:
            log.warning("%s; keeping the %d agents known", exc, len(self._links))
            return
        static = set(self.settings.agents)
        for address in found - self._links.keys():
            self._add(address)
        for address in self._links.keys() - found - static:
            await self._remove(address)


def _heartbeat_ms(latest: NodeHeadroom | None) -> int:
    return latest.heartbeat_ms if latest is not None else 0


__all__ = ["HeadroomView", "NodeView", "ReleaseOutcome", "ReserveOutcome"]
