"""A job: one request kept by the queue until an engine answered it. Plain data and its states.

    queued ──claim──► running ──finish──► succeeded | failed
      │  ▲               │
      │  └──requeue──────┘   engine dropped the connection, claim lease lost, replica shut down
      ├──► cancelled         DELETE, hold timeout, batch cancel (a running job's call is aborted),
      │                      a held job's client gone for queue.reattach_s before it started
      ├──► expired           its batch's completion window passed
      └──► failed            too big for every node, or refused when its batch line was admitted

The store makes every transition with one conditional write (`WHERE state = ...`), so two replicas
can never both move a job out of `queued`.
"""

from __future__ import annotations

import enum
import json
import secrets
from dataclasses import dataclass
from typing import Any


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED})
ACTIVE = frozenset(JobState) - TERMINAL  # queued or running: still the queue's to run


def new_id(prefix: str) -> str:
    """Ids in OpenAI's style (`batch_…`, `file-…`); random, so replicas never collide."""
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What is sent to the engine: the path, the headers the queue forwards, the body as received."""

    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class JobResult:
    """The engine's answer, kept whole (a streamed answer as its event-stream text)."""

    status: int
    content_type: str
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True, slots=True)
class JobError:
    """Why a job ended without an engine answer (or with one the queue could not deliver)."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class JobCharge:
    """What a job's tenant is charged for it with fair shares (kvgate.queue.fairness): its likeliest
    prompt count and its output budget, the gate's charge; the agent settles the output part on what
    the engine generated. `tokens` may be more (the safe side of a threshold, the gate's estimate)."""

    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class NewJob:
    id: str
    request: JobRequest
    tokens: int
    priority: int  # rank in admission.priorities: 0 is the most important
    tenant: str
    model: str | None = None
    stream: bool = False
    request_id: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    line: int | None = None
    expires_at: float | None = None
    # A held job's hold: it expires this long after it is stored unless the replica holding its client
    # renews it (None: no hold, a deferred job or a batch line).
    hold_s: float | None = None
    # Set for a batch line refused at admission: it is stored already failed, for the error file.
    error: JobError | None = None
    charge: JobCharge | None = None
    # The class of fairness settings its route gave its tenant (kvgate.policy.tenant_book).
    tenant_class: str | None = None


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    state: JobState
    tokens: int
    priority: int
    tenant: str
    created_at: float
    model: str | None = None
    stream: bool = False
    request_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    owner: str | None = None
    node: str | None = None
    reservation: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    line: int | None = None
    result: JobResult | None = None
    error: JobError | None = None
    # Loaded only where the job is about to be sent to an engine.
    request: JobRequest | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued job as the dispatcher plans with it."""

    id: str
    priority: int
    tenant: str
    tokens: int
    seq: int  # the store's insertion order: age
    attempts: int = 0
    # When it was queued, by the store's wall clock (Unix seconds): its place in the one waiting order
    # the agents keep across the queue and the gates (kvgate.agent.backfill).
    created_at: float = 0.0
    charge: JobCharge | None = None  # None: stored by a kvgate that kept no charge (schema 2)
    tenant_class: str | None = None  # its route's (None: none, or stored before schema 4)


def body_json(result: JobResult) -> Any:
    """The engine's body as JSON when it is JSON, else as text."""
    if "json" in result.content_type:
        try:
            return json.loads(result.body)
        except ValueError:
            pass
    return result.body.decode("utf-8", errors="replace")


def describe(job: Job, priorities: tuple[str, ...], position: int | None) -> dict[str, Any]:
    """The job as GET /v1/kvgate/jobs/{id} shows it."""
    described: dict[str, Any] = {
        "id": job.id,
        "object": "kvgate.job",
        "status": job.state.value,
        "request_id": job.request_id,
        "model": job.model,
        "tenant": job.tenant,
        "priority": priorities[job.priority] if job.priority < len(priorities) else str(job.priority),
        "estimated_tokens": job.tokens,
        "position": position,
        "attempts": job.attempts,
        "replica": job.owner,
        "created_at": int(job.created_at),
        "started_at": _seconds(job.started_at),
        "finished_at": _seconds(job.finished_at),
        "error": {"code": job.error.code, "message": job.error.message} if job.error else None,
        "response": None,
    }
    if job.result is not None:
        described["response"] = {
            "status_code": job.result.status,
            "content_type": job.result.content_type,
            "body": body_json(job.result),
        }
    return described


def _seconds(value: float | None) -> int | None:
    return None if value is None else int(value)
