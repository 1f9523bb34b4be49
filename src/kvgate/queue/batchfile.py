"""Batch input and output files (JSONL): reading the requests, writing the answers. Pure.

Input: one request per line, `{"custom_id", "method": "POST", "url", "body"}`, every `url` the batch's
endpoint, custom ids unique. A malformed line fails the whole batch at validation, with the line
number, as OpenAI's does. The file arrives in chunks (LineSplitter cuts them into lines, never
holding more than one line and one chunk), and its lines are counted before any is parsed: a file
with too many fails without being read into memory.

Output: one line per request that got a 2xx answer; the error file: one per request that got any
other answer (`response` set) or none (`error` set: refused at admission, bigger than every node,
expired, cancelled).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class LineSplitter:
    """Cuts a file's chunks into its lines at each newline (JSON Lines: jsonlines.org; a `\r` before
    it is whitespace to JSON). A line split across chunks is joined once, when it ends."""

    _pending: list[bytes] = field(default_factory=list)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines `chunk` ends."""
        pieces = chunk.split(b"\n")
        if len(pieces) == 1:
            self._pending.append(chunk)
            return []
        first = b"".join([*self._pending, pieces[0]])
        self._pending = [pieces[-1]]
        return [first, *pieces[1:-1]]

    def end(self) -> list[bytes]:
        """The last line, when the file does not end with a newline."""
        last = b"".join(self._pending)
        self._pending = []
        return [last] if last else []


def requests_in(lines: Iterable[bytes]) -> int:
    """How many requests these lines hold (lines that are not blank), without parsing any."""
    return sum(1 for raw in lines if raw.strip())


def count_problem(requests: int, max_lines: int) -> LineProblem | None:
    """Why a file of `requests` lines cannot be a batch (read before any line is parsed)."""
    if requests == 0:
        return LineProblem(None, "empty_file", "The input file has no requests.")
    if requests > max_lines:
        message = f"The input file has {requests} requests; a batch takes at most {max_lines}."
        return LineProblem(None, "too_many_requests", message)
    return None


def read_lines(lines: Iterable[bytes], endpoint: str) -> tuple[list[BatchLine], list[LineProblem]]:
    """The requests of an input file's lines, or the problems that make it invalid (first 20)."""
    requests: list[BatchLine] = []
    problems: list[LineProblem] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        problem = _check(number, raw, endpoint, seen)
        if isinstance(problem, LineProblem):
            problems.append(problem)
            if len(problems) >= 20:
                break
        else:
            requests.append(problem)
    return requests, problems


def _check(number: int, raw: bytes, endpoint: str, seen: set[str]) -> BatchLine | LineProblem:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return LineProblem(number, "invalid_file_format", f"Line {number} is not UTF-8 text.")
    try:
        request = json.loads(text)
    except ValueError:
        return LineProblem(number, "invalid_json_line", f"Line {number} is not valid JSON.")
    if not isinstance(request, dict):
        return LineProblem(number, "invalid_request", f"Line {number} is not a JSON object.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineProblem(number, "missing_required_parameter", f"Line {number} has no custom_id.")
    if custom_id in seen:
        message = f"Line {number} repeats custom_id {_shown(custom_id)}."
        return LineProblem(number, "duplicate_custom_id", message)
    seen.add(custom_id)
    if str(request.get("method", "")).upper() != "POST":
        return LineProblem(number, "invalid_method", f"Line {number}: method must be POST.")
    if request.get("url") != endpoint:
        return LineProblem(
            number,
            "mismatched_url",
            f"Line {number}: url {_shown(request.get('url'))} is not the batch's {endpoint}.",
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


def _shown(value: object) -> str:
    """A client's value in a problem's message, cut short (the messages are kept with the batch)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def _jsonl(records: list[bytes]) -> bytes:
    return b"".join(record + b"\n" for record in records)
