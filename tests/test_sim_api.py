"""The simulator's prompt-token rule and ids, request parsing, vLLM's 400 on context overflow, and the
/tokenize and render answers built from them."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
from conftest import TOKENIZER_DIR
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.sim.api import EngineError, check_context, error_body, parse_request
from kvgate.sim.render import generate_request, prompt_ids, tokenize
from kvgate.sim.tokens import ByteQuads, count_text_tokens, load_tokenizer, make_prompt


def test_tokens_are_utf8_bytes_over_four_rounded_up() -> None:
    assert count_text_tokens("") == 0
    assert count_text_tokens("abcd") == 1
    assert count_text_tokens("abcde") == 2
    assert count_text_tokens("日本") == 2  # 6 bytes


@pytest.mark.parametrize("size", [0, 1, 537, 32000])
def test_make_prompt_has_exactly_the_requested_size(size: int) -> None:
    assert count_text_tokens(make_prompt(size, random.Random(size))) == size


def test_chat_prompt_sums_text_parts_and_ignores_images() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "y" * 9},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {"role": "assistant", "content": None},
        ],
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = parse_request("chat", body)
    assert (request.prompt_tokens, request.max_tokens, request.stream, request.include_usage) == (
        13,
        7,
        True,
        True,
    )


def test_completions_accept_text_and_token_ids_and_default_to_16_tokens() -> None:
    assert parse_request("completion", {"prompt": "abcdefgh"}).prompt_tokens == 2
    assert parse_request("completion", {"prompt": ["abcd"]}).prompt_tokens == 1
    request = parse_request("completion", {"prompt": [1, 2, 3]})
    assert (request.prompt_tokens, request.max_tokens) == (3, 16)
    assert parse_request("chat", {"messages": [{"role": "user", "content": "hi"}]}).max_tokens is None
    ends = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "kvgate_sim_eos_after": 50}
    assert parse_request("chat", ends).eos_after == 50


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("chat", {"messages": []}),
        ("chat", "not an object"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": True}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "kvgate_sim_eos_after": 0}),
        ("completion", {"prompt": ["a", "b"]}),
        ("completion", {}),
    ],
)
def test_malformed_requests_are_400(api: str, body: object) -> None:
    with pytest.raises(EngineError) as info:
        parse_request(api, body)  # type: ignore[arg-type]
    assert info.value.status == 400


def test_prompt_plus_max_tokens_over_the_model_len_is_vllms_400() -> None:
    request = parse_request("chat", {"messages": [{"role": "user", "content": "w" * 4000}], "max_tokens": 97})
    check_context(request, max_model_len=1097)
    with pytest.raises(EngineError) as info:
        check_context(request, max_model_len=1096)
    assert error_body(info.value) == {
        "error": {
            "message": (
                "This model's maximum context length is 1096 tokens. However, you requested 1097 tokens "
                "(1000 in the messages, 97 in the completion). Please reduce the length of the messages or "
                "completion."
            ),
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


def test_prompt_alone_at_the_model_len_is_400_when_no_max_tokens() -> None:
    request = parse_request("chat", {"messages": [{"role": "user", "content": "w" * 400}]})
    check_context(request, max_model_len=101)
    with pytest.raises(EngineError, match="your request has 100 input tokens"):
        check_context(request, max_model_len=100)


def test_ignore_eos_is_vllm_s_boolean_sampling_field() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert parse_request("chat", body).ignore_eos is False
    assert parse_request("chat", {**body, "ignore_eos": True}).ignore_eos is True
    with pytest.raises(EngineError, match="ignore_eos"):
        parse_request("chat", {**body, "ignore_eos": "yes"})


@pytest.mark.parametrize(
    "text", ["", "abc", "abcd", "héllo wörld", "日本語のテキスト", "emoji 🎉 x", " the" * 40]
)
def test_byte_quads_give_one_id_per_charged_token_and_spell_the_text(text: str) -> None:
    tokenizer = ByteQuads()
    ids = tokenizer.ids(text)
    assert len(ids) == tokenizer.count(text) == count_text_tokens(text)
    assert all(0 <= i < 2**32 for i in ids)
    assert b"".join(struct.pack("<I", i) for i in ids).rstrip(b"\0") == text.encode()
    if text.isascii():
        assert "".join(tokenizer.pieces(ids)) == text


@pytest.fixture(scope="module", params=["sentencepiece", "tekken", "huggingface"])
def tokenizer_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "sentencepiece":
        return TOKENIZER_DIR / "mistral_instruct_tokenizer_240323.model.v3"
    if request.param == "tekken":
        return TOKENIZER_DIR / "tekken_240911.json"
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trained.train_from_iterator([SAMPLE * 20], trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    trained.save(str(path))
    return path


SAMPLE = "The quick brown fox jumps over the lazy dog. 日本語も少し。 def f(x): return x * 2\n"


def test_a_tokenizer_file_gives_the_ids_it_counts(tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_file)
    counter = load_counter(TokenizerFile.open(tokenizer_file))
    ids = tokenizer.ids(SAMPLE)
    assert len(ids) == tokenizer.count(SAMPLE) == counter.count(SAMPLE)
    pieces = tokenizer.pieces(tokenizer.ids("hello world"))
    assert all(pieces) and "hello" in "".join(pieces)


def test_tokenize_counts_what_a_chat_is_charged_and_spells_each_token() -> None:
    tokenizer = ByteQuads()
    messages = [
        {"role": "system", "content": "x" * 41},
        {"role": "user", "content": [{"type": "text", "text": "y" * 9}, {"type": "image_url"}]},
    ]
    answer = tokenize({"messages": messages, "return_token_strs": True}, tokenizer, 4096)
    charged = parse_request("chat", {"messages": messages}).prompt_tokens
    assert answer["count"] == len(answer["tokens"]) == charged == 11 + 3
    assert answer["max_model_len"] == 4096
    assert "".join(answer["token_strs"]) == "x" * 41 + "y" * 9
    plain = tokenize({"prompt": "abcdefgh"}, tokenizer, 4096)
    assert plain == {
        "count": 2,
        "max_model_len": 4096,
        "tokens": tokenizer.ids("abcdefgh"),
        "token_strs": None,
    }
    for bad in ({}, {"prompt": 5}, {"messages": "hi"}, ["prompt"]):
        with pytest.raises(EngineError):
            tokenize(bad, tokenizer, 4096)


def test_render_answers_vllm_s_generate_request_with_the_prompt_s_ids() -> None:
    body = {"messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": 5, "temperature": 0.2}
    request = parse_request("chat", body)
    ids = prompt_ids(request, ByteQuads())
    answer = generate_request(request, body, ids=ids, request_id="r1", model="m", budget=5)
    assert answer["token_ids"] == ByteQuads().ids("abcdefgh")
    assert answer["request_id"] == "r1"
    assert set(answer) == {
        "request_id",
        "token_ids",
        "features",
        "sampling_params",
        "model",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
    }
    sampling = answer["sampling_params"]
    assert (sampling["max_tokens"], sampling["temperature"], sampling["top_p"]) == (5, 0.2, 1.0)
    assert sampling["ignore_eos"] is False
    given = parse_request("completion", {"prompt": [5, 6, 7]})
    assert prompt_ids(given, ByteQuads()) == [5, 6, 7]
