"""OpenAI Batch API objects as the queue keeps them, and their JSON. Pure.

Shapes follow the official `openai` SDK's models (openai 3.57.0: `openai/types/batch.py`,
`batch_request_counts.py`, `file_object.py`): the SDK's `batches.retrieve` and `files.create` parse
these unchanged.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvgate.queue.jobs import Job, JobState

# The endpoints a batch may address: the inference APIs the queue can run (and OpenAI's batch allows).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# OpenAI accepts only this window (`BatchCreateParams.completion_window: Literal["24h"]`).
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
# A file's `expires_after` (openai 3.57.0 types/file_create_params.py `ExpiresAfter`): anchor
# `created_at`, seconds "between 3600 (1 hour) and 2592000 (30 days)".
EXPIRY_ANCHOR = "created_at"
MIN_EXPIRY_S = 3600
MAX_EXPIRY_S = 2_592_000
# A batch's `metadata` (openai 3.57.0 types/shared/metadata.py): "Set of 16 key-value pairs …
# Keys are strings with a maximum length of 64 characters. Values are strings with a maximum
# length of 512 characters."
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


OPEN = frozenset({BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING})
ENDED = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})


@dataclass(frozen=True, slots=True)
class Counts:
    total: int
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    status: BatchStatus
    endpoint: str
    input_file_id: str
    completion_window: str
    tenant: str
    created_at: float
    expires_at: float | None
    counts: Counts
    metadata: dict[str, str] | None = None
    # Validation errors of a batch that failed: [{"code", "message", "line"}].
    errors: tuple[dict[str, Any], ...] = ()
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None

    def with_counts(self, counts: Counts) -> Batch:
        return replace(self, counts=counts)

    def on_clock(self, created_at: float) -> Batch:
        """The batch as a clock that read `created_at` at its creation stamps it: every time it holds
        moves with created_at, keeping its distance (its expiry stays its window away)."""
        shift = created_at - self.created_at

        def moved(at: float | None) -> float | None:
            return None if at is None else at + shift

        return replace(
            self,
            created_at=created_at,
            expires_at=moved(self.expires_at),
            in_progress_at=moved(self.in_progress_at),
            finalizing_at=moved(self.finalizing_at),
            completed_at=moved(self.completed_at),
            failed_at=moved(self.failed_at),
            expired_at=moved(self.expired_at),
            cancelling_at=moved(self.cancelling_at),
            cancelled_at=moved(self.cancelled_at),
        )


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    tenant: str  # its owner: only this tenant lists, reads or deletes it
    purpose: str
    filename: str
    bytes: int
    created_at: float
    expires_at: float | None


def expiry_seconds(anchor: str | None, seconds: str | None, longest_s: float) -> float | str:
    """How long an upload is kept: its `expires_after` within OpenAI's bounds, and no longer than
    `longest_s` (queue.file_ttl_s, also what it gets without one); or what is wrong with it."""
    if anchor is None and seconds is None:
        return longest_s
    if anchor != EXPIRY_ANCHOR:
        return f"expires_after[anchor] must be {EXPIRY_ANCHOR!r}, got {_shown(anchor)}."
    if seconds is None or not seconds.isascii() or not seconds.isdigit():
        return f"expires_after[seconds] must be a whole number of seconds, got {_shown(seconds)}."
    if not MIN_EXPIRY_S <= int(seconds) <= MAX_EXPIRY_S:
        return f"expires_after[seconds] must be from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}, got {int(seconds)}."
    return min(float(seconds), longest_s)


def metadata_problem(metadata: object) -> str | None:
    """What is wrong with a batch's `metadata`, by OpenAI's rule; None when nothing is."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return "metadata must be an object of strings."
    if len(metadata) > MAX_METADATA_PAIRS:
        return f"metadata holds at most {MAX_METADATA_PAIRS} pairs."
    if any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()):
        return f"metadata keys are at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}."
    return None


def _shown(value: str | None) -> str:
    """A client's value in a message, cut short."""
    return repr(value if value is None or len(value) <= 40 else value[:40] + "…")


def settlement(batch: Batch, lines: Sequence[Job]) -> tuple[BatchStatus, Counts]:
    """How a batch ends once none of its lines is waiting or running, and its final counts."""
    completed = sum(1 for job in lines if job.state is JobState.SUCCEEDED)
    counts = Counts(batch.counts.total, completed, len(lines) - completed)
    if batch.status is BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED, counts
    if any(job.state is JobState.EXPIRED for job in lines):
        return BatchStatus.EXPIRED, counts
    return BatchStatus.COMPLETED, counts


def batch_json(batch: Batch) -> dict[str, Any]:
    errors = None
    if batch.errors:
        errors = {"object": "list", "data": [dict(e) for e in batch.errors]}
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status.value,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at),
        "in_progress_at": _int(batch.in_progress_at),
        "expires_at": _int(batch.expires_at),
        "finalizing_at": _int(batch.finalizing_at),
        "completed_at": _int(batch.completed_at),
        "failed_at": _int(batch.failed_at),
        "expired_at": _int(batch.expired_at),
        "cancelling_at": _int(batch.cancelling_at),
        "cancelled_at": _int(batch.cancelled_at),
        "request_counts": {
            "total": batch.counts.total,
            "completed": batch.counts.completed,
            "failed": batch.counts.failed,
        },
        "metadata": batch.metadata,
    }


def file_json(stored: StoredFile) -> dict[str, Any]:
    return {
        "id": stored.id,
        "object": "file",
        "bytes": stored.bytes,
        "created_at": int(stored.created_at),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
        "expires_at": _int(stored.expires_at),
        "status_details": None,
    }


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list answer, with the cursor fields the SDK's pagination reads."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def encode_metadata(metadata: dict[str, str] | None) -> str | None:
    return None if metadata is None else json.dumps(metadata)


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)
