"""Headroom: the per-node agent and the gate's view of it.

Pure (no gRPC, no I/O; the policy may import these):
    snapshot        NodeHeadroom, GpuReading, NodeView, ReserveOutcome, the headroom formula
    capacity        KV bytes per token from a model's shape; static capacity over free GPU memory
    ledger          reservations: atomic grant/refuse, release, lease expiry
    engines         read_engine_page(text) -> EngineReading: vLLM, SGLang, TGI, llama.cpp readers
    node            NodeState: samples + ledger -> NodeHeadroom
    settings        HeadroomSettings, the gate's `headroom:` config section
    status          what an agent sees, as `kvgate status` prints it (text or JSON)
Adapters:
    nvml, fake_nvml             GPU sampling through nvidia-ml-py on its own thread; a scriptable fake
    scrape, fake_engine         the engine's /metrics over kept-alive HTTP/1.1; a fake /metrics to test
    agent, cli, broadcast       the agent's gRPC server; `kvgate agent` and `kvgate status`
    client, view, resolve       the gate's subscriptions, Reserve and Release
    wire, protogen              protobuf conversion and code generation

This package's __init__ imports nothing, so importing the pure modules never pulls in gRPC.
"""
