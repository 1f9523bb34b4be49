"""The page reader underneath the engine readers: one family at a time, garbage refused clearly, big
pages read as small ones."""

from __future__ import annotations

import pytest
from fixtures.engines import rules
from fixtures.engines.pages import Vllm

from kvgate.agent.sources.engines import read_engine_page
from kvgate.agent.sources.engines.promtext import Sample, label, metric_names, samples
from kvgate.errors import HeadroomError

M = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'


def test_a_family_is_found_by_its_exact_name_only() -> None:
    page = (
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
        f'vllm:num_preemptions_total{{engine="0",{M}}} 3.0\n'
        f'vllm:num_preemptions_created{{engine="0",{M}}} 1.764e+09\n'
        f'vllm:num_preemptions_total_x{{engine="0"}} 9.0\n'
        "vllm:num_preemptions_total 4\n"
    )
    found = samples(page, "vllm:num_preemptions_total")
    assert [s.value for s in found] == [3.0, 4.0]
    assert label(found[0], "engine") == "0" and label(found[1], "engine") is None


def test_labels_are_read_by_exact_key() -> None:
    sample = Sample('{engine_type="unified",tp_rank="3",dp_rank="1",num_gpu_blocks_override="None"}', 1.0)
    assert (label(sample, "tp_rank"), label(sample, "dp_rank"), label(sample, "engine")) == ("3", "1", None)
    assert label(sample, "num_gpu_blocks") is None
    escaped = Sample('{model_name="a \\"quoted\\" ,engine=\\"7\\"",engine="0"}', 1.0)
    assert label(escaped, "engine") == "0"


def test_crlf_and_timestamps_are_accepted() -> None:
    page = Vllm(blocks=(2001,), usage=(0.5,)).page()
    page = page.replace("} 0.5\n", "} 0.5 1764000000000\n").replace("\n", "\r\n")
    assert read_engine_page(page).used_tokens == 16_000


def test_metric_names_skips_comments_and_repeats() -> None:
    page = '# HELP a x\n# TYPE a gauge\na 1\nb{x="1"} 2\na 3\n<html>\nc 4\n'
    assert metric_names(page, 5) == ["a", "b", "c"]
    assert metric_names(page, 2) == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a Prometheus text page (0 chars, first line '')"),
        (
            "<html><body>502 Bad Gateway</body></html>\n",
            "not a Prometheus text page (42 chars, first line '<html><body>502 Bad Gateway</body></html>')",
        ),
        ("\x00\x01\x02\xff binary", "not a Prometheus text page"),
        ('vllm:kv_cache_usage_perc{engine="0"', "cannot parse"),
        ('vllm:kv_cache_usage_perc{engine="0"} zero\n', "cannot parse"),
        ('vllm:kv_cache_usage_perc{engine="0"} NaN\n', "finite"),
        ("vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running -1\n", "finite value >= 0"),
        ('vllm:kv_cache_usage_perc{engine="0"} 43.75\n', "beyond 1"),
        ('vllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{block_size="16"} 1.0\n', "num_gpu_blocks"),
        (
            'vllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{num_gpu_blocks="many",block_size="16"} 1\n',
            "integer",
        ),
        ('sglang:max_total_num_tokens{tp_rank="0"} -5\n', "finite value >= 0"),
    ],
)
def test_garbage_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(HeadroomError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_engine_page(text)


def test_a_big_page_reads_as_its_kv_figures_alone() -> None:
    """100 KB of histogram buckets around the figures change nothing (what a read of such a page
    costs is `python -m bench agent`'s figure)."""
    buckets = "".join(
        f'vllm:request_prompt_tokens_bucket{{engine="0",le="{2**i}.0",{M}}} {i}.0\n' for i in range(20)
    )
    bare = Vllm(blocks=(2500, 2500), usage=(0.5, 0.25)).page()
    page = buckets * 60 + bare
    assert len(page) > 100_000
    assert read_engine_page(page) == read_engine_page(bare)


def test_a_live_vllm_page_reads_as_the_families_the_reader_needs() -> None:
    """vLLM 0.32.0's page as served (55 KB: histograms, _created samples, families new in 0.32 such
    as num_requests_waiting_by_reason) reads as the handful of lines the reader takes from it."""
    page = (rules.LIVE / f"{rules.VLLM_VERSION}-load.txt").read_text()
    needed = (*rules.VLLM_FAMILIES, rules.VLLM_CACHE_INFO)
    kept = "".join(line + "\n" for line in page.splitlines() if any(line.startswith(n + "{") for n in needed))
    assert len(page) > 50_000 and len(kept) < 3_000
    assert read_engine_page(page) == read_engine_page(kept)
    assert "vllm:num_requests_waiting_by_reason" in metric_names(page, 200)
    assert samples(page, "vllm:num_requests_waiting")[0].value == 3.0  # not the _by_reason family
