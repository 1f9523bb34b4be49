"""Headroom: the contract between a node's agent and the gate, and the gate's side of it.

Pure (no gRPC, no I/O; the policy and the queue may import these):
    snapshot        NodeHeadroom, GpuReading, NodeView, ReserveOutcome, the headroom formula
Adapters:
    wire, protogen              protobuf conversion and code generation (the wire contract)
    client, view, resolve       the gate's subscriptions, Reserve and Release
    giveback                    a Release tried again, and an unanswered Reserve given back
    credentials                 TLS credentials for the agents' listeners and the gate's channels

The agent process itself lives in kvgate.agent; nothing here imports it.
This package's __init__ imports nothing, so importing the pure modules never pulls in gRPC.
"""
