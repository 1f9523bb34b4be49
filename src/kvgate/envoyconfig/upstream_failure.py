"""What Envoy answers when the node a request was routed to fails before it answers.

A node that is stopping (a rolling update's SIGTERM: its server closes its listening socket and
drains what it holds), has just died, or resets the stream before its first byte makes Envoy's router
answer a plain-text 503 "upstream connect error or disconnect/reset before headers" itself
(`Filter::onUpstreamReset` -> `onUpstreamAbort`, source/common/router/router.cc, envoyproxy/envoy
v1.40.0). No SDK can tell that from a broken gateway, and the faulted replay counted it as a lost
request: the gate had pinned a long request to a node 0.6 s after that node's SIGTERM, before its agent
reported it gone. The request never reached an engine, so another try is safe: Envoy's local reply
mappers (`local_reply_config`, HttpConnectionManager) rewrite exactly those answers, matched by the
response flag the router set (`Filter::streamResetReasonToResponseFlag`, same file), into the refusal
table's `upstream_unavailable`: OpenAI's error shape, `x-kvgate-reason` and Retry-After, which the
official SDKs retry. The gate's reservation ends with the ext_proc stream, as for any other answer.

A stream cut after the node's first byte stays cut: Envoy has sent the headers, there is nothing left
to rewrite, and the node did hold that request.
"""

from __future__ import annotations

from kvgate.policy.decision import Reason, Refusal
from kvgate.policy.refusals import HttpAnswer, Refusals

# Envoy's response flags for an upstream that failed before its response started: UF connection
# failure or timeout, UC connection termination, UR remote reset, UO circuit-breaker overflow, UH no
# healthy host, URX retries exhausted (envoy/stream_info/stream_info.h's CoreResponseFlag short names).
UPSTREAM_FAILURE_FLAGS: tuple[str, ...] = ("UF", "UC", "UR", "UO", "UH", "URX")

UPSTREAM_UNAVAILABLE = Refusal(
    Reason.UPSTREAM_UNAVAILABLE,
    "The engine chosen for this request could not be reached before it answered (it may be restarting); "
    "retry shortly.",
)


def upstream_unavailable() -> HttpAnswer:
    """Envoy's answer in place of its plain-text upstream failure, from the one refusal table."""
    return Refusals().answer(UPSTREAM_UNAVAILABLE, None)
