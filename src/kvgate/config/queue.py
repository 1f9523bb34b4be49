"""The `queue:` section of kvgate.yaml: bounds, timeouts and leases of `kvgate queue`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.bounds import at_least
from kvgate.errors import ConfigError

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class QueueSettings:
    # A held request whose job has not started this long after it arrived gets 429 with Retry-After
    # and the job is cancelled; one that started is answered when it ends. Under common SDK timeouts
    # (openai: 600 s), and Envoy's route must wait longer than this (its stream idle timeout
    # defaults to 300 s).
    max_hold_s: float = field(default=300.0, metadata=at_least(1))
    # A held job whose client left before it started (its connection closed, or the replica holding
    # it died) waits this long for the client to come back with the same x-request-id, then is
    # cancelled (`client_gone`) rather than run for nobody and charged to its tenant. The replica
    # holding the connection renews it every third of this. 0: such a job stays and runs when its
    # turn comes (kvgate before 2026-12-05).
    reattach_s: float = field(default=15.0, metadata=at_least(0))
    # Finished jobs (their engine response) are kept this long for GET /v1/kvgate/jobs/{id}.
    result_ttl_s: float = field(default=3600.0, metadata=at_least(1))
    # Jobs queued or running, and tokens queued, past which new work is refused with 429.
    max_jobs: int = field(default=10_000, metadata=at_least(1))
    max_tokens_waiting: int = field(default=100_000_000, metadata=at_least(1))
    # Times a job is sent to an engine before it fails (an engine that drops the connection).
    max_attempts: int = field(default=3, metadata=at_least(1))
    # A replica renews its claim on running jobs every third of this; a replica that stops renewing
    # loses them after it (PostgreSQL: another replica runs them again).
    claim_lease_s: float = field(default=30.0, metadata=at_least(0.3))
    # The agent's KV reservation lease, renewed while the job runs: what a crash leaves held.
    reservation_lease_s: float = field(default=60.0, metadata=at_least(1))
    retry_after_s: int = field(default=10, metadata=at_least(1))
    # On SIGTERM the replica stops taking connections and keeps running jobs and answering the clients
    # it holds for up to this long (under Kubernetes' 30 s terminationGracePeriodSeconds); what is still
    # running then goes back in the queue, and those clients' connections close.
    drain_s: float = field(default=25.0, metadata=at_least(0))
    # Request headers stored with a job and sent to the engine with it (never x-kvgate-*).
    # `authorization` is left out on purpose: listing it stores clients' credentials in the store.
    forward_headers: tuple[str, ...] = ("content-type", "accept", "traceparent", "tracestate")
    # The Batch API: largest input file, most lines in one batch (OpenAI's limits).
    max_file_bytes: int = field(default=200 * MiB, metadata=at_least(1))
    max_batch_lines: int = field(default=50_000, metadata=at_least(1))
    # What one tenant (x-kvgate-tenant) may keep in files at once, uploads and batch outputs alike:
    # past the count or the concurrent uploads, 429; past the bytes, 413. Batch outputs are always
    # written (they count against later uploads). The total bounds every tenant together: size it
    # under the store's disk (the chart's PVC is 10 GiB), leaving room for jobs.
    max_files_per_tenant: int = field(default=500, metadata=at_least(1))
    max_file_bytes_per_tenant: int = field(default=1024 * MiB, metadata=at_least(1))
    max_uploads_per_tenant: int = field(default=2, metadata=at_least(1))
    max_file_bytes_total: int = field(default=6144 * MiB, metadata=at_least(1))
    # Files expire this long after their upload unless the upload's `expires_after` asks for less
    # (OpenAI's default for purpose=batch, and its longest: 30 days). A batch's output and error
    # files expire this long after the batch ended.
    file_ttl_s: float = field(default=30 * 24 * 3600.0, metadata=at_least(3600))
    # An upload still unfinished this long after it began is dropped (its slot and bytes freed).
    upload_timeout_s: float = field(default=900.0, metadata=at_least(1))
    # Longest one engine call may take.
    engine_timeout_s: float = field(default=3600.0, metadata=at_least(1))

    def __post_init__(self) -> None:
        for i, name in enumerate(self.forward_headers):
            if name.lower().startswith("x-kvgate-") or name.lower() != name:
                raise ConfigError(
                    f"queue.forward_headers[{i}]: {name!r} must be lower case and not an x-kvgate- header"
                )
        if 0 < self.reattach_s < 0.3:
            raise ConfigError(f"queue.reattach_s must be 0 (off) or at least 0.3 s, got {self.reattach_s:g}")
        # Both are renewed every third of claim_lease_s: a shorter reservation could lapse between two.
        if self.reservation_lease_s < self.claim_lease_s:
            raise ConfigError("queue.reservation_lease_s must be >= queue.claim_lease_s")
