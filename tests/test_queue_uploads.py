"""Uploads with a real `kvgate queue` process, whose memory is measured (issue 27, security review
finding 5: "A 548 KB gzip upload stored 191 MiB and took the queue to 706 MiB").

The gzip bomb is refused before it is read, and the queue's peak resident memory (VmHWM, reset once
the queue listens) stays far under what the body inflates to; a plain 64 MiB upload is written to
the store as it arrives, so the peak grows by a small part of the file, not by the file (the old
queue held it whole, twice).
"""

from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from kvgate.harness.processes import Service, kvgate_command
from kvgate.harness.stack import started
from kvgate.localports import free_port

MiB = 1024 * 1024
BOUNDARY = "kvgate-upload-boundary"
HEAD = (
    f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=purpose\r\n\r\nbatch\r\n"
    f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=file; filename=in.jsonl\r\n"
    "content-type: application/jsonl\r\n\r\n"
).encode()
TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()
# One MiB of batch lines (the same line over and over: what compresses about a thousandfold).
_LINE = json.dumps(
    {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}
).encode()
BLOCK = (_LINE + b"\n") * (MiB // (len(_LINE) + 1))


def queue_process(tmp: Path, env: dict[str, str], *flags: str) -> Service:
    """`kvgate queue` on a free port; its agent is nowhere (no job runs: only the files API is used)."""
    config = tmp / "queue.yaml"
    config.write_text(f"headroom: {{agents: ['127.0.0.1:{free_port()}']}}\n")
    port = free_port()
    argv = kvgate_command(
        "queue",
        *("--listen", f"127.0.0.1:{port}", "--config", str(config), "--metrics-listen", "off", *flags),
    )
    return started(Service("queue", argv, tmp, env=env, port=port), port)


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[Service]:
    service = queue_process(tmp_path, {"KVGATE_QUEUE_STORE": f"sqlite:///{tmp_path / 'queue.db'}"})
    try:
        yield service
    finally:
        service.stop()


def reset_peak(pid: int) -> None:
    """VmHWM back to the current RSS (Linux 4.0+, proc(5): /proc/PID/clear_refs, value 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_bytes(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def exchange(port: int, head: list[str], body: Iterable[bytes] = ()) -> tuple[int, bytes]:
    """One HTTP/1.1 request, its body sent piece by piece as it is made; the status and body answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(("\r\n".join([*head, "host: queue", "connection: close"]) + "\r\n\r\n").encode())
        for piece in body:
            connection.sendall(piece)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def post_file(
    port: int, body: Iterator[bytes], length: int, encoding: str | None = None
) -> tuple[int, bytes]:
    head = [
        "POST /v1/files HTTP/1.1",
        f"content-type: multipart/form-data; boundary={BOUNDARY}",
        f"content-length: {length}",
        *([f"content-encoding: {encoding}"] if encoding else []),
    ]
    return exchange(port, head, body)


def gzip_bomb(inflated_mib: int) -> bytes:
    """A multipart body of `inflated_mib` MiB of batch lines, gzip-compressed, made a MiB at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip container
    parts = [packer.compress(HEAD)]
    parts += [packer.compress(BLOCK) for _ in range(inflated_mib)]
    parts += [packer.compress(TAIL), packer.flush()]
    return b"".join(parts)


def test_a_gzip_bomb_upload_is_refused_and_the_queues_memory_stays_bounded(queue: Service) -> None:
    bomb = gzip_bomb(191)
    assert len(bomb) < 1 * MiB, "the review's probe: a few hundred KB that inflate to 191 MiB"
    pid = queue.process.pid
    reset_peak(pid)
    before = peak_bytes(pid)
    status, answer = post_file(queue.port, iter([bomb]), len(bomb), encoding="gzip")
    assert status == 415, answer[:300]
    assert json.loads(answer)["error"]["code"] == "unsupported_content_encoding"
    grown = peak_bytes(pid) - before
    assert grown < 24 * MiB, f"the queue's peak grew by {grown / MiB:.0f} MiB (706 MiB before the fix)"
    status, listed = exchange(queue.port, ["GET /v1/files HTTP/1.1"])
    assert status == 200 and json.loads(listed)["data"] == []


def test_a_large_upload_is_written_as_it_arrives_not_held_whole(queue: Service) -> None:
    size_mib = 64
    pid = queue.process.pid
    reset_peak(pid)
    before = peak_bytes(pid)
    pieces = iter([HEAD, *(BLOCK for _ in range(size_mib)), TAIL])
    status, answer = post_file(queue.port, pieces, len(HEAD) + size_mib * len(BLOCK) + len(TAIL))
    assert status == 200, answer[:300]
    assert json.loads(answer)["bytes"] == size_mib * len(BLOCK)
    grown = peak_bytes(pid) - before
    assert grown < size_mib * MiB // 2, (
        f"the queue's peak grew by {grown / MiB:.0f} MiB for a {size_mib} MiB file"
    )
