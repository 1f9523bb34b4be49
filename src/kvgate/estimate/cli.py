"""`kvgate estimate` (what the gate would count for a request body) and `kvgate calibrate`."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from kvgate.config import ModelConfig
from kvgate.errors import ConfigError, RequestError
from kvgate.estimate import calibration, local_estimator
from kvgate.estimate.estimator import Estimator, PromptCosts, TokenEstimate
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.estimate.fit import fit
from kvgate.policy.classify import classify, thresholds
from kvgate.policy.refusals import RULES, refusal_for
from kvgate.request.parse import load_json, parse_body
from kvgate.request.shape import Api

# Which API a body came through, from its keys (the gate knows it from the path).
_API_KEYS = (
    ("messages", Api.CHAT),
    ("input", Api.RESPONSES),
    ("prompt", Api.COMPLETIONS),
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    estimate = subparsers.add_parser(
        "estimate",
        help="estimate a request body's tokens the way the gate does",
        description=(
            "Read an OpenAI- or Anthropic-style request body (one per line with --jsonl) and print, "
            "per body, one JSON object: prompt_tokens, output_tokens, total_tokens, method (fast or "
            "exact) and class (interactive, long, too_long), with the gate's default thresholds."
        ),
    )
    estimate.add_argument(
        "--tokenizer",
        type=Path,
        help="sentencepiece .model, Hugging Face tokenizer.json or Mistral tekken .json "
        "(without one: the estimate spans every shipped tokenizer family, settled on the safe side "
        "near a threshold, as the gate does)",
    )
    estimate.add_argument(
        "--method",
        choices=["auto", "fast", "exact"],
        default="auto",
        help="auto: count exactly only near a threshold, as the gate does (default)",
    )
    estimate.add_argument("--jsonl", action="store_true", help="one request body per input line")
    estimate.add_argument(
        "--api",
        choices=[a.value for a in Api],
        help="body format (default: guessed from its keys: messages → chat, input → responses, "
        "prompt → completions)",
    )
    estimate.add_argument("file", nargs="?", type=Path, help="request body file (default: stdin)")
    estimate.set_defaults(func=run_estimate)

    calibrate = subparsers.add_parser(
        "calibrate",
        help="fit the fast estimator to a tokenizer",
        description=(
            "Count real text with the tokenizer, fit the fast estimator's weights and error band, and "
            "write them as JSON. The gate uses the file when it sits beside the tokenizer as "
            f"<tokenizer>{calibration.SUFFIX}. Use a few hundred KB of each kind of text your users "
            "send (prose, code, compact and pretty JSON, tool definitions, every language); .txt and "
            ".gz files, directories walked."
        ),
    )
    calibrate.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        help="sentencepiece .model, Hugging Face tokenizer.json or Mistral tekken .json",
    )
    calibrate.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        required=True,
        metavar="DIR_OR_FILE",
        help="text your users send: .txt or .gz files, or directories of them",
    )
    calibrate.add_argument(
        "--out",
        type=Path,
        required=True,
        help=f"the calibration file to write; the gate reads <tokenizer>{calibration.SUFFIX}",
    )
    calibrate.set_defaults(func=run_calibrate)


def _api(body: bytes, name: str | None) -> Api:
    if name is not None:
        return Api(name)
    document = load_json(body)
    return next((api for key, api in _API_KEYS if key in document), Api.CHAT)


def _estimate(
    estimator: Estimator, body: bytes, args: argparse.Namespace, model: ModelConfig
) -> TokenEstimate:
    shape = parse_body(_api(body, args.api), body)
    if args.method == "fast":
        return estimator.fast_estimate(shape)
    if args.method == "exact":
        return estimator.count_sync(shape)
    return estimator.estimate_sync(shape, thresholds(model))


def _bodies(stream: IO[bytes], jsonl: bool) -> Iterator[bytes]:
    if not jsonl:
        yield stream.read()
        return
    for line in stream:
        if line.strip():
            yield line


def run_estimate(args: argparse.Namespace) -> int:
    model = ModelConfig()
    costs = PromptCosts(model.image_tokens, model.message_overhead_tokens, model.default_output_tokens)
    estimator = local_estimator(args.tokenizer, costs, notice=False)
    if args.method == "exact" and args.tokenizer is None:
        raise ConfigError("--method exact needs --tokenizer")
    try:
        stream = args.file.open("rb") if args.file else sys.stdin.buffer
    except OSError as exc:
        raise ConfigError(f"cannot read {args.file}: {exc.strerror}") from None
    status = 0
    try:
        for body in _bodies(stream, args.jsonl):
            try:
                result = _estimate(estimator, body, args, model)
            except RequestError as error:
                refusal = refusal_for(error)
                print(json.dumps({"error": RULES[refusal.reason].code, "message": refusal.message}))
                status = 1
                continue
            report = {
                "prompt_tokens": result.prompt_tokens,
                "output_tokens": result.output_tokens,
                "total_tokens": result.total,
                "method": result.method,
                "class": str(classify(result.total, model)),
                "complete": result.complete,
            }
            print(json.dumps(report), flush=True)
    finally:
        if args.file:
            stream.close()
    return status


def corpus_texts(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        if path.is_dir():
            yield from corpus_texts(sorted(p for p in path.rglob("*") if p.is_file()))
        elif path.suffix == ".gz":
            yield gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
        elif path.is_file():
            yield path.read_text("utf-8", "replace")
        else:
            raise ConfigError(f"corpus path not found: {path}")


def run_calibrate(args: argparse.Namespace) -> int:
    # Before the fit, which takes minutes on a real corpus.
    if not args.out.parent.is_dir():
        raise ConfigError(f"--out {args.out}: no directory {args.out.parent}")
    tokenizer = TokenizerFile.open(args.tokenizer)
    texts = [text for text in corpus_texts(args.corpus) if text.strip()]
    if not texts:
        raise ConfigError("the corpus holds no text")
    fitted = fit(tokenizer, load_counter(tokenizer), texts)
    args.out.write_text(fitted.to_json(), "utf-8")
    relative = sorted(value for _, value in fitted.uncertainty)
    print(
        f"{args.out}: {fitted.samples} pieces, held-back error mean {fitted.mean_error:.1%} "
        f"worst {fitted.worst_error:.1%}; band per class of text {relative[0]:.1%} to {relative[-1]:.1%} "
        f"(median {relative[len(relative) // 2]:.1%}) ± {fitted.absolute_error:g} tokens",
        file=sys.stderr,
    )
    return 0
