"""The per-node agent: samples its engine and GPUs, streams headroom, grants reservations.

Pure (no gRPC, no I/O):
    node            NodeState: samples + ledger -> NodeHeadroom
    ledger          reservations: atomic grant/refuse, release, lease expiry
    prefix_blocks   the prompt blocks reservations hold, shared or idle
    prefix_audit    whether the engine's prefix cache holds what the agent believes
    prefix_events   the engine's KV events linked to reservations: the prefix index made the engine's
    engine_cache    the engine's cached blocks as its KV events tell them
    kv_events       vLLM's KV-event messages decoded, their sequence checked
    releases        when live reservations are expected to end
    decode_rate     the engine's per-request output rate
    prefill_backlog the granted prompt tokens the engine has yet to prefill (placement ranks by it)
    capacity        KV bytes per token from a model's shape; static capacity over free GPU memory
    status          what an agent sees, as `kvgate status` prints it (text or JSON)
Adapters:
    server, metrics             the agent's gRPC server and its Prometheus endpoint
    subscribers                 who follows the stream, and what each already knows
    cli                         `kvgate agent` and `kvgate status`
    in_process                  in-process agents behind the gate's interface, for tests
    sources                     what the agent reads: engine pages, NVML, and their fakes

The gate, the policy and the queue never import this package: they see an agent through
kvgate.headroom's contract.
"""
