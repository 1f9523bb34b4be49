"""Holding a request in the gate past Envoy's ext_proc message_timeout.

Envoy gives the gate `message_timeout` (5 s in the shipped configs) to answer each message; past it,
failing open, it sends the request on undecided, to the interactive pool. A long request that waits
for room longer than that is held: once the answer to its body has taken `notice_s`, the gate sends
Envoy one ProcessingResponse carrying only `override_message_timeout` (kvgate.gate.responses.hold),
which Envoy takes as the new deadline of the message it waits on, and keeps waiting. Envoy takes one
such response per message, up to its own `max_message_timeout`, so the one the gate sends covers the
rest of the longest wait at once, plus MARGIN_S. docs/operations.md, "Holding a request in the gate".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.config import AdmissionConfig

# After the longest wait, the answer still has to be made and reach Envoy: a last Reserve in flight
# when the wait ends (headroom.reserve_timeout_s, 50 ms by default) and an event loop under load.
MARGIN_S = 2.0
# The gate asks for more time once an answer has taken half of admission.max_wait_s, which operators
# keep below Envoy's message_timeout less the body's transfer (docs/operations.md): the request is
# then sure to be held before Envoy gives up on it. Never sooner than this, so that a max_wait_s of 0
# does not cost every long request an extra message.
MIN_NOTICE_S = 0.05
# The gate's first answer to a body, or its ask for more time, must reach Envoy before its
# message_timeout: the body's transfer and a busy event loop come on top of the wait.
ANSWER_MARGIN_S = 0.5


@dataclass(frozen=True, slots=True)
class Holding:
    notice_s: float  # an answer that takes longer is held: Envoy is asked for more time
    longest_s: float  # the longest the gate waits for room (admission.longest_wait_s)

    def extension_s(self, waited_s: float) -> float:
        """Envoy's new deadline for an answer that has taken `waited_s` so far."""
        return max(0.0, self.longest_s - waited_s) + MARGIN_S


def holding(admission: AdmissionConfig) -> Holding | None:
    """How the gate holds requests; None when it does not (admission.max_hold_s <= max_wait_s)."""
    if admission.max_hold_s <= admission.max_wait_s:
        return None
    return Holding(max(MIN_NOTICE_S, admission.max_wait_s / 2), admission.longest_wait_s)


def least_message_timeout_s(admission: AdmissionConfig) -> float:
    """The shortest Envoy ext_proc message_timeout the gate works behind: its first answer to a body
    comes after the wait for room or, when it holds requests, it asks for more time at `notice_s`;
    either must reach Envoy before it gives up and fails open."""
    held = holding(admission)
    return (admission.max_wait_s if held is None else held.notice_s) + ANSWER_MARGIN_S
