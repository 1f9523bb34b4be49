"""The names kvgate and Envoy agree on: HTTP headers, the dynamic-metadata namespace and its keys.

One module, importing nothing, so the gate's responses, `kvgate envoy-config`, the queue and the
chart tests spell every name the same way. Client-sent headers with the `x-kvgate-` prefix are
never trusted: Envoy strips the routing ones at its edge, and the gate overwrites or removes the rest.
"""

from __future__ import annotations

HEADER_PREFIX = "x-kvgate-"

# Set by the gate on a routed request (upstream headers; Envoy echoes some to the client).
POOL_HEADER = "x-kvgate-pool"
TOKENS_HEADER = "x-kvgate-tokens"
REASON_HEADER = "x-kvgate-reason"
ENDPOINT_HEADER = "x-kvgate-endpoint"
# vLLM publishes a request's X-Session-ID with each KV-cache block it stores (vllm 0.32,
# vllm/entrypoints/generate/base/serving.py _get_session_id; v1/core/block_pool.py
# _build_block_stored_event): the gate sends its reservation id in it on a request it reserved for,
# so the node's agent ties the engine's blocks to the reservation (kvgate.agent.prefix_events). A
# client's own X-Session-ID is overwritten there (it could name another request's reservation).
SESSION_HEADER = "x-session-id"
# The headers the gate itself decides; a client's header of the same name is overwritten, never trusted.
ROUTING_HEADERS = (POOL_HEADER, ENDPOINT_HEADER, TOKENS_HEADER, REASON_HEADER)

# On a refusal the client may retry: when to come back, in milliseconds (Retry-After takes whole
# seconds). `retry-after-ms` is the same value under the name the official OpenAI and Anthropic SDKs
# read first (kvgate.policy.refusals).
RETRY_AFTER_MS_HEADER = "x-kvgate-retry-after-ms"
SDK_RETRY_AFTER_MS_HEADER = "retry-after-ms"

# Set by the async queue on its answers: the job a request became (GET /v1/kvgate/jobs/{id}).
JOB_ID_HEADER = "x-kvgate-job-id"

# Who the request is from and how much it matters: set only by Envoy, after it authenticated the
# request (a client's copies are removed at the edge), and forwarded by the gate; an absent tenant
# is ANONYMOUS_TENANT, charged like any other (kvgate.policy.identity, docs/operations.md).
TENANT_HEADER = "x-kvgate-tenant"
ANONYMOUS_TENANT = "anonymous"
# The label of the tenants past a metric's label bound (the gate's and the queue's per-tenant series).
OTHER_TENANTS = "_other"
PRIORITY_HEADER = "x-kvgate-priority"
# A client's own hints (read, never set, by the gate): RFC 7240 preferences.
PREFER_HEADER = "prefer"

# Per-route policy: gRPC metadata of the ext_proc stream, set by an Envoy route or virtual host
# (ExtProcPerRoute overrides.grpc_initial_metadata); see kvgate.policy.route.
ROUTE_INTERACTIVE_MAX_TOKENS = "x-kvgate-interactive-max-tokens"
ROUTE_MAX_TOTAL_TOKENS = "x-kvgate-max-total-tokens"
ROUTE_DEFAULT_OUTPUT_TOKENS = "x-kvgate-default-output-tokens"
ROUTE_MODEL_POLICY = "x-kvgate-model-policy"
ROUTE_ASYNC = "x-kvgate-async"
ROUTE_MAX_PRIORITY = "x-kvgate-max-priority"
ROUTE_TENANT_CLASS = "x-kvgate-tenant-class"
# The same name as an upstream header: a classed route's requests to `kvgate queue` carry their class
# (set by Envoy's route table, a client's copy removed at the edge), so the queue weighs its jobs as
# the gate weighs the route's requests (kvgate.policy.tenant_book).
TENANT_CLASS_HEADER = ROUTE_TENANT_CLASS

# The dynamic-metadata namespace of the gate's decision, and its keys. Envoy routes on `pool` and
# `endpoint` in the one-round-trip set-up and access logs read the rest.
METADATA_NAMESPACE = "kvgate"
META_POOL = "pool"
META_REASON = "reason"
META_ENDPOINT = "endpoint"
META_TOKENS = "tokens"
META_METHOD = "method"
META_PROMPT_TOKENS = "prompt_tokens"
META_MODEL = "model"
META_RESERVED_TOKENS = "reserved_tokens"  # what the agent charged (less than tokens with a shared prefix)
META_PREFIX_HIT_TOKENS = "prefix_hit_tokens"  # prompt tokens the node is expected to hold cached
META_SESSION = "session"  # a reserved request's id, for SESSION_HEADER in the one-round-trip set-up
META_PRIORITY = "priority"  # the priority admitted with, for PRIORITY_HEADER in the one-round-trip set-up

# The upstream header each routing metadata key becomes in the one-round-trip set-up.
HEADER_FOR_METADATA = {
    POOL_HEADER: META_POOL,
    ENDPOINT_HEADER: META_ENDPOINT,
    TOKENS_HEADER: META_TOKENS,
    REASON_HEADER: META_REASON,
}

# The Endpoint Picker Protocol's names (gateway-api-inference-extension
# docs/proposals/004-endpoint-picker-protocol/README.md @84436a96): the engine(s) the picker names, as
# a header and as dynamic metadata under LB_NAMESPACE with the same value (`ip:port`, or a fallback
# list `ip:port,ip:port`); the gateway's subset hint (filter metadata, a list of `ip:port`); and the
# engine that served, which the gateway reports on the response.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
