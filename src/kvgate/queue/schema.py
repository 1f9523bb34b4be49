"""The tables of the queue's store, in the SQL both databases take (two type names differ)."""

from __future__ import annotations


def statements(serial_key: str, blob: str) -> list[str]:
    """CREATE statements, safe to run on every start. `serial_key`: an auto-numbered primary key."""
    return [
        f"""CREATE TABLE IF NOT EXISTS kvgate_jobs (
            seq {serial_key},
            id TEXT NOT NULL UNIQUE,
            request_id TEXT UNIQUE,
            state TEXT NOT NULL,
            priority INTEGER NOT NULL,
            tenant TEXT NOT NULL,
            tokens BIGINT NOT NULL,
            model TEXT,
            stream INTEGER NOT NULL,
            path TEXT NOT NULL,
            headers TEXT NOT NULL,
            body {blob} NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION,
            started_at DOUBLE PRECISION,
            finished_at DOUBLE PRECISION,
            attempts INTEGER NOT NULL DEFAULT 0,
            owner TEXT,
            lease_until DOUBLE PRECISION,
            node TEXT,
            reservation TEXT,
            batch_id TEXT,
            custom_id TEXT,
            line INTEGER,
            result_status INTEGER,
            result_type TEXT,
            result_body {blob},
            error_code TEXT,
            error_message TEXT
        )""",
        # Covers what the dispatcher, the bounds check and the metrics read of waiting jobs, so they never
        # touch the rows themselves (each holds a whole prompt).
        "CREATE INDEX IF NOT EXISTS kvgate_jobs_waiting "
        "ON kvgate_jobs (state, priority, tenant, seq, tokens, attempts, id)",
        "CREATE INDEX IF NOT EXISTS kvgate_jobs_batch ON kvgate_jobs (batch_id, line)",
        "CREATE INDEX IF NOT EXISTS kvgate_jobs_finished ON kvgate_jobs (finished_at)",
        f"""CREATE TABLE IF NOT EXISTS kvgate_files (
            id TEXT PRIMARY KEY,
            purpose TEXT NOT NULL,
            filename TEXT NOT NULL,
            bytes BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            content {blob} NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS kvgate_batches (
            id TEXT PRIMARY KEY,
            status TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL,
            tenant TEXT NOT NULL,
            metadata TEXT,
            errors TEXT,
            total INTEGER NOT NULL,
            completed INTEGER,
            failed INTEGER,
            output_file_id TEXT,
            error_file_id TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            in_progress_at DOUBLE PRECISION,
            expires_at DOUBLE PRECISION,
            finalizing_at DOUBLE PRECISION,
            completed_at DOUBLE PRECISION,
            failed_at DOUBLE PRECISION,
            expired_at DOUBLE PRECISION,
            cancelling_at DOUBLE PRECISION,
            cancelled_at DOUBLE PRECISION
        )""",
    ]
