"""The async tier: `kvgate queue`, the durable, headroom-aware upstream of the `async` pool.

Requests the gate overflows to the async pool, and the lines of OpenAI batches, become jobs in a
store (SQLite for one replica, PostgreSQL for several). A dispatcher runs each job only after a
long-pool agent granted its KV reservation, on that node, in priority then tenant-fair then age
order. Three client contracts: held (the answer on the same connection), deferred (`Prefer:
respond-async`: 202 and a job URL), and the OpenAI Batch API.

Pure modules: settings, jobs, fairness, placement, batchfile, errors. The rest are adapters (store,
engine calls, HTTP). This package imports nothing heavy at import time: config.py reads its settings.
"""
