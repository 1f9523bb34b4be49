"""The async tier: `kvgate queue`, the durable, headroom-aware upstream of the `async` pool.

Requests the gate overflows to the async pool, and the lines of OpenAI batches, become jobs in a
store (SQLite for one replica, PostgreSQL for several). A dispatcher runs each job only after a
long-pool agent granted its KV reservation, on that node, in priority then tenant-fair then age
order. Three client contracts: held (the answer on the same connection), deferred (`Prefer:
respond-async`: 202 and a job URL), and the OpenAI Batch API.

Every file, batch and job is its tenant's (x-kvgate-tenant, set by Envoy after authentication;
`anonymous` without one): another tenant's is not found. Files are bounded per tenant and expire.

Pure modules: jobs, fairness, placement, batches, batchfile, refusals, schema. The rest do
I/O: the store (database, sqlite_db, postgres_db, store, batchstore, filestore), the engines and
agents (engines, runner, dispatcher, live), HTTP (app, files_http, batch_http), and the wiring
(intake's estimators, settle, metrics, service, cli). Its settings are the `queue:` section,
kvgate.config.queue.
"""
