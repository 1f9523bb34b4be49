"""kvgate.digits, the one reader of whole numbers from text someone else wrote, fuzzed; and the places
outside the gate and the queue that read numbers with it (an engine's metrics page, its HTTP answer)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.addresses import split_host_port
from kvgate.agent.sources.engines import read_engine_page
from kvgate.agent.sources.scrape import parse_response
from kvgate.digits import INT64_MAX, NotWhole, read_whole, whole_number
from kvgate.errors import ConfigError, HeadroomError
from kvgate.sim.cli import parse_listen


def test_only_ascii_digits_in_range_count() -> None:
    assert read_whole("42", maximum=100) == 42
    assert read_whole(" \t007 ", maximum=100) == 7, "HTTP's optional whitespace, leading zeros"
    assert read_whole("100", minimum=1, maximum=100) == 100
    assert read_whole("0" * 50 + "5", maximum=9) == 5, "zeros do not count against the length"
    for text in (
        "\xb2",
        "\u0663",
        "\uff11",
        "1.5",
        "-1",
        "+1",
        "1_0",
        "1e3",
        "0x10",
        "",
        " ",
        "\n5",
        "5\x00",
    ):
        assert whole_number(text, maximum=10**9) is None, repr(text)
    assert whole_number("101", maximum=100) is None
    assert whole_number("0", minimum=1, maximum=100) is None
    assert whole_number("9" * 100_000, maximum=INT64_MAX) is None, "refused by length, never converted"
    assert whole_number(None, maximum=1) is None


def test_why_not_names_the_value_shortened() -> None:
    why = read_whole("lots", minimum=1, maximum=10)
    assert isinstance(why, NotWhole)
    assert why.describe("limit") == "limit: 'lots' is not a whole number from 1 to 10"
    long = read_whole("x" * 100, maximum=10)
    assert (
        isinstance(long, NotWhole)
        and long.describe("n") == f"n: {'x' * 40 + '…'!r} is not a whole number from 0 to 10"
    )


@given(st.text(max_size=60), st.integers(0, 2**70), st.integers(0, 2**70))
def test_any_text_reads_as_a_number_in_range_or_not_at_all(text: str, low: int, high: int) -> None:
    minimum, maximum = min(low, high), max(low, high)
    value = read_whole(text, minimum=minimum, maximum=maximum)
    digits = text.strip(" \t")
    if digits.isascii() and digits.isdigit() and minimum <= int(digits) <= maximum:
        assert value == int(digits)
    else:
        assert isinstance(value, NotWhole)


@given(st.integers(0, 2**80), st.sampled_from(["{}", " {} ", "\t{}", "000{}"]))
def test_every_whole_number_in_range_is_read_exactly(number: int, written: str) -> None:
    assert whole_number(written.format(number), maximum=2**80) == number


def _vllm_page(blocks: str, block_size: str = "16") -> str:
    labels = f'block_size="{block_size}",num_gpu_blocks="{blocks}",engine="0"'
    return (
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:num_requests_running{engine="0"} 1\n'
        'vllm:num_requests_waiting{engine="0"} 0\n'
    )


def test_an_engine_page_with_other_scripts_digits_is_refused_not_crashed_on() -> None:
    assert read_engine_page(_vllm_page("100")).capacity_tokens == 1584  # 99 blocks: one is the null block
    for blocks, block_size in (("\xb2", "16"), ("100", "\u0663"), ("1.5", "16")):
        with pytest.raises(HeadroomError, match="needs integer num_gpu_blocks and block_size"):
            read_engine_page(_vllm_page(blocks, block_size))


def test_an_engine_answer_with_a_latin1_number_is_a_bad_response() -> None:
    assert parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", True) is not None
    for answer in (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", b"HTTP/1.1 2\xb2 OK\r\n\r\n"):
        with pytest.raises(Exception, match=r"bad Content-Length|not an HTTP/1\.x response") as raised:
            parse_response(answer, True)
        assert not isinstance(raised.value, ValueError), "the scrape's own error, not int()'s"


@given(st.text(max_size=12))
def test_any_port_text_is_a_port_or_a_config_error_naming_where(port: str) -> None:
    try:
        host, number = split_host_port(f"agent:{port}", "headroom.agents[0]")
    except ConfigError as exc:
        assert "headroom.agents[0]" in str(exc)
    else:
        assert host == "agent" and 1 <= number <= 65535 and port.strip(" \t").isascii()


def test_a_superscript_port_is_a_config_error_not_a_crash() -> None:
    with pytest.raises(ConfigError, match="--listen"):
        parse_listen("127.0.0.1:8²")
    assert parse_listen("[::1]:0") == ("::1", 0)


def test_an_unbracketed_ipv6_host_is_a_config_error() -> None:
    """Hypothesis found "agent::1" read as host "agent:" and port 1."""
    with pytest.raises(ConfigError, match=r"headroom.agents\[0\].*IPv6 host in brackets"):
        split_host_port("agent::1", "headroom.agents[0]")
    with pytest.raises(ConfigError, match="IPv6 host in brackets"):
        split_host_port("::1:8080")
    assert split_host_port("[::1]:8080") == ("::1", 8080)
