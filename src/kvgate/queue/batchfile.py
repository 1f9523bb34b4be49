"""Batch input and output files (JSONL): reading the requests, writing the answers. Pure.

Input: one request per line, `{"custom_id", "method": "POST", "url", "body"}`, every `url` the batch's
endpoint, custom ids unique. A malformed line fails the whole batch at validation, with the line
number, as OpenAI's does. Output: one line per request that got a 2xx answer; the error file: one per
request that got any other answer (`response` set) or none (`error` set: refused at admission,
bigger than every node, expired, cancelled).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvgate.queue.jobs import Job, JobState, body_json


@dataclass(frozen=True, slots=True)
class BatchLine:
    line: int  # 1-based
    custom_id: str
    body: bytes  # the request body, re-encoded as JSON


@dataclass(frozen=True, slots=True)
class LineProblem:
    line: int | None
    code: str
    message: str

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": None, "line": self.line}


def read_lines(content: bytes, endpoint: str, max_lines: int) -> tuple[list[BatchLine], list[LineProblem]]:
    """The requests of an input file, or the problems that make it invalid (first 20)."""
    lines: list[BatchLine] = []
    problems: list[LineProblem] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [LineProblem(None, "invalid_file_format", "The input file is not UTF-8 text.")]
    numbered = [(n, raw) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not numbered:
        return [], [LineProblem(None, "empty_file", "The input file has no requests.")]
    if len(numbered) > max_lines:
        return [], [
            LineProblem(
                None,
                "too_many_requests",
                f"The input file has {len(numbered)} requests; a batch takes at most {max_lines}.",
            )
        ]
    for number, raw in numbered:
        problem = _check(number, raw, endpoint, seen)
        if isinstance(problem, LineProblem):
            problems.append(problem)
            if len(problems) >= 20:
                break
        else:
            lines.append(problem)
    return lines, problems


def _check(number: int, raw: str, endpoint: str, seen: set[str]) -> BatchLine | LineProblem:
    try:
        request = json.loads(raw)
    except ValueError:
        return LineProblem(number, "invalid_json_line", f"Line {number} is not valid JSON.")
    if not isinstance(request, dict):
        return LineProblem(number, "invalid_request", f"Line {number} is not a JSON object.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineProblem(number, "missing_required_parameter", f"Line {number} has no custom_id.")
    if custom_id in seen:
        return LineProblem(number, "duplicate_custom_id", f"Line {number} repeats custom_id {custom_id!r}.")
    seen.add(custom_id)
    if str(request.get("method", "")).upper() != "POST":
        return LineProblem(number, "invalid_method", f"Line {number}: method must be POST.")
    if request.get("url") != endpoint:
        return LineProblem(
            number,
            "mismatched_url",
            f"Line {number}: url {request.get('url')!r} is not the batch's {endpoint}.",
        )
    body = request.get("body")
    if not isinstance(body, dict):
        return LineProblem(number, "invalid_body", f"Line {number}: body must be a JSON object.")
    return BatchLine(number, custom_id, json.dumps(body).encode())


def output_files(jobs: Iterable[Job]) -> tuple[bytes, bytes]:
    """(output file, error file) for a batch's ended lines, in input order."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for job in sorted(jobs, key=lambda j: j.line or 0):
        record: dict[str, Any] = {"id": f"batch_req_{job.id}", "custom_id": job.custom_id}
        if job.result is not None:
            record["response"] = {
                "status_code": job.result.status,
                "request_id": job.request_id or job.id,
                "body": body_json(job.result),
            }
            record["error"] = None
        else:
            record["response"] = None
            error = job.error
            record["error"] = {
                "code": error.code if error else job.state.value,
                "message": error.message if error else f"The request ended {job.state.value}.",
            }
        target = output if job.state is JobState.SUCCEEDED else errors
        target.append(json.dumps(record).encode())
    return _jsonl(output), _jsonl(errors)


def _jsonl(records: list[bytes]) -> bytes:
    return b"".join(record + b"\n" for record in records)
