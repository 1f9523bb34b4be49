"""kvgate: admission gate for LLM inference traffic."""

from kvgate.grpc_transport import choose_transport

# Before any kvgate module imports grpc, which reads its transport choice once, at import.
choose_transport()
