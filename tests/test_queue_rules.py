"""Small rules of the queue: its config section, RFC 7240 preferences, whether a job can ever fit,
the shape of its refusals, the bounded tenant label of its metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import kvgate.queue
from kvgate.config import parse_config
from kvgate.config.queue import QueueSettings
from kvgate.errors import ConfigError
from kvgate.headroom.snapshot import CapacitySource, NodeHeadroom, NodeView
from kvgate.policy.decision import Reason
from kvgate.queue.app import prefers_async
from kvgate.queue.batches import ENDED, OPEN, BatchStatus
from kvgate.queue.database import literal, literals
from kvgate.queue.jobs import ACTIVE, TERMINAL, JobState
from kvgate.queue.metrics import TENANT_LABELS, tenant_series
from kvgate.queue.placement import Fit, fit
from kvgate.queue.refusals import QueueRefusals
from kvgate.request.shape import Api


def test_the_queue_section_loads_with_defaults_bounds_and_named_errors() -> None:
    assert parse_config("").queue == QueueSettings()
    config = parse_config("queue:\n  max_hold_s: 120\n  max_files_per_tenant: 7\n")
    assert (config.queue.max_hold_s, config.queue.max_files_per_tenant) == (120, 7)
    with pytest.raises(ConfigError, match=r"queue.tenant_header: unknown key"):
        parse_config("queue: {tenant_header: x-tenant}\n")  # the tenant is x-kvgate-tenant, Envoy's
    with pytest.raises(ConfigError, match=r"kvgate.yaml:2: queue.max_jobs: must be >= 1, got 0"):
        parse_config("queue:\n  max_jobs: 0\n", "kvgate.yaml")
    with pytest.raises(ConfigError, match=r"queue.max_hold: unknown key"):
        parse_config("queue: {max_hold: 1}\n")
    with pytest.raises(ConfigError, match=r"queue.forward_headers\[1\]: 'x-kvgate-tokens'"):
        parse_config("queue: {forward_headers: [accept, x-kvgate-tokens]}\n")
    with pytest.raises(ConfigError, match=r"reservation_lease_s must be >= queue\.claim_lease_s"):
        parse_config("queue: {claim_lease_s: 30, reservation_lease_s: 10}\n")


@pytest.mark.parametrize(
    ("values", "deferred"),
    [
        (["respond-async"], True),
        (["Respond-Async, wait=10"], True),
        (["return=minimal", "respond-async; foo=bar"], True),
        (["wait=10"], False),
        (["respond-asynchronously"], False),
        ([], False),
    ],
)
def test_prefer_respond_async_is_read_as_rfc_7240_writes_it(values: list[str], deferred: bool) -> None:
    assert prefers_async(values) is deferred


def node(name: str, capacity: int, safety: float = 0.9, reported: bool = True) -> NodeView:
    headroom = NodeHeadroom(
        node=name, endpoint=f"{name}:8000", seq=1, sample_time_unix_ns=0, capacity_tokens=capacity,
        safety_ratio=safety, used_tokens=0, reserved_tokens=0, reservations=0, headroom_tokens=capacity,
        healthy=True, reason="", capacity_source=CapacitySource.ENGINE, kv_usage=0.0, running=0,
        waiting=0, preemptions_total=0, gpus=(), period_ms=100,
    )  # fmt: skip
    return NodeView(name, headroom if reported else None, 0.0, reported, reported, reported)


def test_a_job_is_too_big_only_when_every_node_reported_and_none_admits_it() -> None:
    nodes = (node("a", 10_000), node("b", 20_000))
    assert fit(nodes, 18_000) is Fit.FITS  # b admits 20,000 x 0.9
    assert fit(nodes, 18_001) is Fit.TOO_BIG
    assert fit((node("a", 10_000), node("b", 0, reported=False)), 18_001) is Fit.UNKNOWN
    assert fit((node("a", 0),), 1) is Fit.UNKNOWN  # an engine that reports no capacity yet
    assert fit((), 1) is Fit.UNKNOWN


def test_queue_refusals_have_the_gates_shape_and_follow_its_settings() -> None:
    refusals = QueueRefusals(parse_config("refusals: {too_long_status: 400}\nqueue: {retry_after_s: 9}\n"))
    timeout = refusals.hold_timeout(300, Api.CHAT)
    headers = dict(timeout.headers)
    assert (timeout.status, headers["retry-after"], headers["x-kvgate-reason"]) == (429, "9", "hold_timeout")
    assert json.loads(timeout.body)["error"]["type"] == "rate_limit_error"
    big = refusals.queue(Reason.EXCEEDS_NODE_CAPACITY, "too big", Api.ANTHROPIC_MESSAGES)
    assert big.status == 400 and "retry-after" not in dict(big.headers)
    assert json.loads(big.body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "too big"},
    }
    full = refusals.queue_full("it is", 5000)
    assert full.status == 429 and dict(full.headers)["retry-after"] == "9"


def test_the_tenant_label_is_bounded() -> None:
    tokens = {f"t{i}": 1000 + i for i in range(TENANT_LABELS + 5)}
    series = tenant_series(tokens)
    assert len(series) == TENANT_LABELS + 1
    assert series[0] == (float(1000 + TENANT_LABELS + 4), {"tenant": f"t{TENANT_LABELS + 4}"})
    assert series[-1] == (float(sum(1000 + i for i in range(5))), {"tenant": "_other"})


def test_the_queues_sql_names_job_states_and_batch_statuses_only_through_their_enums() -> None:
    words = sorted({str(value) for value in (*JobState, *BatchStatus)})
    by_hand = re.compile("'(" + "|".join(words) + ")'")
    for path in sorted(Path(kvgate.queue.__file__).parent.glob("*.py")):
        assert not by_hand.findall(path.read_text()), f"{path.name} spells a state by hand"
    assert literal(JobState.QUEUED) == "'queued'"
    assert literals(ACTIVE) == "('queued', 'running')"
    assert set(JobState) == ACTIVE | TERMINAL and not ACTIVE & TERMINAL
    assert not OPEN & ENDED
