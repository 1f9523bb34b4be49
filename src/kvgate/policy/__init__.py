"""Admission policy: pure decisions over token estimates and headroom. No gRPC, no Envoy, no asyncio."""

from kvgate.policy.classify import TokenClass, classify, decide, thresholds
from kvgate.policy.decision import Decision, Reason, Refusal, Route

__all__ = ["Decision", "Reason", "Refusal", "Route", "TokenClass", "classify", "decide", "thresholds"]
