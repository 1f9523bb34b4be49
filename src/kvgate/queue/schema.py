"""The tables of the queue's store, in the SQL both databases take, and how an older store is brought
up to them. Pure: the adapters (sqlite_db, postgres_db) run what `plan` returns in one transaction.

Versions (the one row of `kvgate_schema`; a store without that table is version 1 or empty):
    1  kvgate 0.x up to issue 27: files without an owner, their content in one column; request ids
       unique across all tenants
    2  files, batches and jobs carry their tenant; request ids unique per tenant
       (UNIQUE(tenant, request_id)); file content in 1 MiB chunks (kvgate_file_chunks); files expire
    3  a job keeps its tenant's charge apart from the tokens it reserves: its likeliest prompt count
       and its output budget (charge_prompt_tokens, charge_output_tokens; NULL in older rows)
    4  a job keeps the tenant class its route gave it (tenant_class; NULL: none, or an older row)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvgate.errors import StoreError
from kvgate.queue.database import literal

VERSION = 4
# A version-1 file had no expiry: it expires this long after its upload (OpenAI's default for
# purpose=batch, `expires_after` in openai 3.57.0 types/file_create_params.py).
LEGACY_FILE_TTL_S = 30 * 24 * 3600
# A version-1 file names no tenant; unless a batch says whose it is, it gets this owner, which no
# request can have (an absent or empty x-kvgate-tenant is `anonymous`): it is swept, never served.
NO_TENANT = ""


class FileStatus(enum.StrEnum):
    """A file row while its upload runs, and once it is whole (OpenAI's `processed`)."""

    UPLOADING = "uploading"
    PROCESSED = "processed"


@dataclass(frozen=True, slots=True)
class Dialect:
    """Where the two databases' SQL differs."""

    serial_key: str  # an auto-numbered primary key
    blob: str
    tables_sql: str  # the names of the tables in the store's schema
    # SQLite keeps a column's UNIQUE for the table's life (ALTER TABLE cannot drop it): the table
    # is copied into a new one instead. PostgreSQL drops the constraint by name.
    rebuilds: bool


SQLITE = Dialect(
    "INTEGER PRIMARY KEY AUTOINCREMENT",
    "BLOB",
    "SELECT name FROM sqlite_master WHERE type = 'table'",
    rebuilds=True,
)
POSTGRESQL = Dialect(
    "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    "BYTEA",
    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()",
    rebuilds=False,
)

VERSION_TABLE = "CREATE TABLE IF NOT EXISTS kvgate_schema (version INTEGER NOT NULL)"
READ_VERSION = "SELECT max(version) FROM kvgate_schema"


def plan(dialect: Dialect, version: int | None, tables: set[str]) -> list[str]:
    """The statements that bring a store at `version` (None: no row in kvgate_schema) holding
    `tables` to VERSION; StoreError for a store a newer kvgate wrote."""
    if version is not None and version > VERSION:
        raise StoreError(f"the store's schema is version {version}; this kvgate knows up to {VERSION}")
    steps: list[str] = []
    if version is None and "kvgate_jobs" in tables:
        steps += _upgrade_to_2(dialect)
    steps += statements(dialect)
    if version is None or version < 3:
        # After the CREATEs, so that a new store gets them too: the table is created as version 2 had
        # it, which the version-1 upgrade's SQLite rebuild copies rows into.
        steps += _upgrade_to_3()
    if version is None or version < 4:
        steps += _upgrade_to_4()
    if version != VERSION:
        steps += ["DELETE FROM kvgate_schema", f"INSERT INTO kvgate_schema (version) VALUES ({VERSION})"]
    return steps


def statements(dialect: Dialect) -> list[str]:
    """CREATE statements of the current version, safe to run on every start."""
    return [
        _jobs_table("kvgate_jobs", dialect),
        # Covers what the dispatcher, the bounds check and the metrics read of waiting jobs, so they never
        # touch the rows themselves (each holds a whole prompt).
        "CREATE INDEX IF NOT EXISTS kvgate_jobs_waiting "
        "ON kvgate_jobs (state, priority, tenant, seq, tokens, attempts, id)",
        "CREATE INDEX IF NOT EXISTS kvgate_jobs_batch ON kvgate_jobs (batch_id, line)",
        "CREATE INDEX IF NOT EXISTS kvgate_jobs_finished ON kvgate_jobs (finished_at)",
        # A request id names one job of its tenant: another tenant's same id is another job.
        "CREATE UNIQUE INDEX IF NOT EXISTS kvgate_jobs_request ON kvgate_jobs (tenant, request_id)",
        """CREATE TABLE IF NOT EXISTS kvgate_files (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            status TEXT NOT NULL,
            purpose TEXT NOT NULL,
            filename TEXT NOT NULL,
            bytes BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION
        )""",
        "CREATE INDEX IF NOT EXISTS kvgate_files_tenant ON kvgate_files (tenant, created_at, id)",
        "CREATE INDEX IF NOT EXISTS kvgate_files_expiry ON kvgate_files (expires_at)",
        _CHUNKS_TABLE.format(blob=dialect.blob),
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
        "CREATE INDEX IF NOT EXISTS kvgate_batches_tenant ON kvgate_batches (tenant, created_at, id)",
    ]


_CHUNKS_TABLE = """CREATE TABLE IF NOT EXISTS kvgate_file_chunks (
            file_id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            data {blob} NOT NULL,
            PRIMARY KEY (file_id, seq)
        )"""


def _jobs_table(name: str, dialect: Dialect) -> str:
    return f"""CREATE TABLE IF NOT EXISTS {name} (
            seq {dialect.serial_key},
            id TEXT NOT NULL UNIQUE,
            request_id TEXT,
            state TEXT NOT NULL,
            priority INTEGER NOT NULL,
            tenant TEXT NOT NULL,
            tokens BIGINT NOT NULL,
            model TEXT,
            stream INTEGER NOT NULL,
            path TEXT NOT NULL,
            headers TEXT NOT NULL,
            body {dialect.blob} NOT NULL,
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
            result_body {dialect.blob},
            error_code TEXT,
            error_message TEXT
        )"""


def _upgrade_to_3() -> list[str]:
    return [
        "ALTER TABLE kvgate_jobs ADD COLUMN charge_prompt_tokens BIGINT",
        "ALTER TABLE kvgate_jobs ADD COLUMN charge_output_tokens BIGINT",
    ]


def _upgrade_to_4() -> list[str]:
    return ["ALTER TABLE kvgate_jobs ADD COLUMN tenant_class TEXT"]


def _upgrade_to_2(dialect: Dialect) -> list[str]:
    """Version 1 to 2. A file takes the tenant of the batch that names it (its input, output or error
    file), else NO_TENANT; its content becomes one chunk; it expires LEGACY_FILE_TTL_S after upload."""
    files = [
        _CHUNKS_TABLE.format(blob=dialect.blob),
        f"ALTER TABLE kvgate_files ADD COLUMN tenant TEXT NOT NULL DEFAULT '{NO_TENANT}'",
        f"ALTER TABLE kvgate_files ADD COLUMN status TEXT NOT NULL DEFAULT {literal(FileStatus.PROCESSED)}",
        "ALTER TABLE kvgate_files ADD COLUMN expires_at DOUBLE PRECISION",
        "UPDATE kvgate_files SET tenant = coalesce((SELECT min(b.tenant) FROM kvgate_batches b WHERE "
        "kvgate_files.id IN (b.input_file_id, b.output_file_id, b.error_file_id)), "
        f"'{NO_TENANT}'), expires_at = created_at + {LEGACY_FILE_TTL_S}",
        "INSERT INTO kvgate_file_chunks (file_id, seq, data) SELECT id, 0, content FROM kvgate_files",
        "ALTER TABLE kvgate_files DROP COLUMN content",
    ]
    if not dialect.rebuilds:
        # PostgreSQL names a column's UNIQUE constraint TABLE_COLUMN_key (docs: CREATE TABLE).
        return [*files, "ALTER TABLE kvgate_jobs DROP CONSTRAINT IF EXISTS kvgate_jobs_request_id_key"]
    # SQLite: the documented way to change a constraint (sqlite.org/lang_altertable.html, "Making
    # Other Kinds Of Table Schema Changes"): a new table, the rows copied (seq included, so ages and
    # AUTOINCREMENT carry over), the old one dropped with its indexes, the new one renamed.
    return [
        *files,
        _jobs_table("kvgate_jobs_v2", dialect),
        "INSERT INTO kvgate_jobs_v2 SELECT * FROM kvgate_jobs",
        "DROP TABLE kvgate_jobs",
        "ALTER TABLE kvgate_jobs_v2 RENAME TO kvgate_jobs",
    ]
