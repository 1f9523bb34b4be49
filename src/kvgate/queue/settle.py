"""Settling batches: once none of a batch's lines is queued or running, write its output and error
files (its tenant's, kept `queue.file_ttl_s` as uploads are: a client may come back for them days
later) and give it its final status (completed, expired or cancelled).

Called when one of its lines ends on this replica, after a cancel, and now and then for every open
batch (lines that ended on another replica, expiry); the store makes sure only one replica settles.
"""

from __future__ import annotations

import logging
import time

from kvgate.queue.batches import OPEN, Batch, StoredFile, settlement
from kvgate.queue.batchfile import output_files
from kvgate.queue.batchstore import BatchStore
from kvgate.queue.jobs import TERMINAL, new_id

log = logging.getLogger(__name__)


class Settler:
    def __init__(self, batches: BatchStore, files_ttl_s: float) -> None:
        self._batches = batches
        self._files_ttl_s = files_ttl_s

    async def settle(self, batch_id: str) -> Batch | None:
        """Settle the batch if all its lines ended; the batch as it is now."""
        batch = await self._batches.batch(batch_id, None)
        if batch is None or batch.status not in OPEN:
            return batch
        lines = await self._batches.lines(batch_id)
        if any(job.state not in TERMINAL for job in lines):
            return batch
        status, counts = settlement(batch, lines)
        output, errors = output_files(lines)
        # Stamped on the database's clock as they are written (BatchStore.finish).
        now = time.time()
        files = [
            (
                StoredFile(
                    new_id("file-"),
                    batch.tenant,
                    "batch_output",
                    f"{batch.id}_{kind}.jsonl",
                    len(content),
                    now,
                    None,
                ),
                content,
            )
            if content
            else None
            for kind, content in (("output", output), ("error", errors))
        ]
        ttl_s = self._files_ttl_s
        if await self._batches.finish(batch, status, counts, files[0], files[1], files_ttl_s=ttl_s):
            log.info(
                "batch %s %s: %d completed, %d failed",
                batch.id,
                status.value,
                counts.completed,
                counts.failed,
            )
        return await self._batches.batch(batch_id, None)

    async def settle_all(self) -> None:
        for batch_id in await self._batches.settled():
            await self.settle(batch_id)
