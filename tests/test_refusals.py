"""The one refusal table: every refusal reason has a row, the docs print the same table, and each
API shape is what its official SDK parses."""

from __future__ import annotations

import json
from pathlib import Path

from kvgate.errors import BodyTooLargeError, InvalidRequestError, RequestError, UnsupportedEncodingError
from kvgate.policy.decision import Reason, Refusal
from kvgate.policy.refusals import INTERNAL_ERROR, RULES, Refusals, RetryRule, refusal_for, table_markdown
from kvgate.request.shape import Api

DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
ROUTED = {Reason.SHORT, Reason.LONG, Reason.ASYNC, Reason.UNPARSED, Reason.NO_BODY}


def test_every_refusal_reason_has_exactly_one_row() -> None:
    assert set(RULES) == set(Reason) - ROUTED
    for rule in RULES.values():
        assert (rule.retry is RetryRule.NEVER) == (rule.status < 429), rule


def test_operations_doc_prints_the_table_from_the_code() -> None:
    text = DOCS.read_text()
    printed = text.split("<!-- refusal-table -->\n", 1)[1].split("\n<!-- /refusal-table -->", 1)[0]
    assert printed == table_markdown(), "docs/operations.md: paste kvgate.policy.refusals.table_markdown()"


def test_openai_and_anthropic_shapes() -> None:
    refusals = Refusals()
    refusal = Refusal(Reason.NO_CAPACITY, "No capacity.", 9000)
    openai = refusals.answer(refusal, Api.CHAT)
    assert openai.status == 429
    assert json.loads(openai.body) == {
        "error": {"message": "No capacity.", "type": "rate_limit_error", "param": None, "code": "no_capacity"}
    }
    anthropic = refusals.answer(refusal, Api.ANTHROPIC_MESSAGES)
    assert json.loads(anthropic.body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "No capacity."},
    }
    assert (
        dict(openai.headers)
        == dict(anthropic.headers)
        == {
            "content-type": "application/json",
            "x-kvgate-reason": "no_capacity",
            "x-kvgate-tokens": "9000",
            "retry-after": "2",
            "x-kvgate-retry-after-ms": "2000",
            "retry-after-ms": "2000",
        }
    )


def test_retry_after_follows_the_rule_unless_the_refusal_knows_better() -> None:
    refusals = Refusals(capacity_retry_after_s=5)
    assert refusals.retry_after_s(Refusal(Reason.QUEUE_FULL, "")) == 5
    assert refusals.retry_after_s(Refusal(Reason.OVERLOADED, "")) == 1
    assert refusals.retry_after_s(Refusal(Reason.TOO_LONG, "")) is None
    assert refusals.retry_after_s(Refusal(Reason.NO_CAPACITY, "", retry_after_s=0.3)) == 0.3
    assert (
        dict(refusals.answer(Refusal(Reason.NO_CAPACITY, "", retry_after_s=0.3), None).headers)["retry-after"]
        == "1"
    ), "whole seconds, rounded up"


def test_a_forecast_retry_after_is_also_sent_to_the_millisecond() -> None:
    """Whole seconds would put every client of a spread-out forecast back on the same second; the SDKs
    read `retry-after-ms` first."""
    answer = Refusals().answer(Refusal(Reason.NO_CAPACITY, "", 12000, retry_after_s=2.3456), Api.CHAT)
    headers = dict(answer.headers)
    assert (headers["retry-after"], headers["x-kvgate-retry-after-ms"], headers["retry-after-ms"]) == (
        "3",
        "2346",
        "2346",
    )
    never = dict(Refusals().answer(Refusal(Reason.TOO_LONG, "", 99999), Api.CHAT).headers)
    assert not {"retry-after", "retry-after-ms", "x-kvgate-retry-after-ms"} & never.keys()


def test_too_long_status_400_answers_as_the_engines_do() -> None:
    refusals = Refusals(too_long_status=400)
    answer = refusals.answer(Refusal(Reason.TOO_LONG, "too long", 20000), Api.ANTHROPIC_MESSAGES)
    assert answer.status == 400
    assert json.loads(answer.body)["error"]["type"] == "invalid_request_error"
    assert Refusals().status(Reason.TOO_LONG) == 413


def test_request_errors_become_refusals_by_their_class() -> None:
    assert refusal_for(InvalidRequestError("bad")) == Refusal(Reason.INVALID, "bad")
    assert refusal_for(BodyTooLargeError("big")).reason is Reason.BODY_TOO_LARGE
    assert refusal_for(UnsupportedEncodingError("br")).reason is Reason.UNSUPPORTED_ENCODING
    assert refusal_for(RequestError("odd")) == Refusal(Reason.INVALID, "odd"), "any other kind: 400"

    class Deeper(BodyTooLargeError):
        pass

    assert refusal_for(Deeper("bigger")).reason is Reason.BODY_TOO_LARGE, "by its class or a base"


def test_what_was_not_expected_is_a_retryable_503_in_each_apis_shape() -> None:
    """Never a 500 and never a broken stream: the SDKs retry a 503 by themselves, a second later."""
    refusals = Refusals()
    openai = refusals.answer(INTERNAL_ERROR, Api.CHAT)
    assert openai.status == 503
    headers = dict(openai.headers)
    assert (headers["retry-after"], headers["retry-after-ms"], headers["x-kvgate-reason"]) == (
        "1",
        "1000",
        "internal_error",
    )
    assert json.loads(openai.body)["error"] == {
        "message": "The gateway failed on this request; retry shortly.",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    anthropic = json.loads(refusals.answer(INTERNAL_ERROR, Api.ANTHROPIC_MESSAGES).body)
    assert anthropic["error"]["type"] == "api_error"
