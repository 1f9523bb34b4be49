"""Every command block of README.md and docs/*.md runs as written, and shows what it prints.

A block's fence says what it is, in README.md and docs/*.md alike:
- ```sh: commands a reader pastes. Run here, in document order, one working directory per document.
- ```sh notest: REASON: commands for another place (a cluster, a Docker daemon, the whole test suite).
  Not run; the fence says why, so that no block stops running without a reason written down.
- ```console: a transcript, commands with what they printed elsewhere (`$ ` before each command).
- any other language (text, yaml, …): not commands. A block of commands in one fails the test.

How the blocks run:
- In a temporary directory holding copies of the repository paths they name (the virtualenv is
  linked), so what they write (out/…) stays there.
- A block that starts processes in the background (a line ending in `&`) is a set of services: it
  keeps running while the test waits for every 127.0.0.1 port it names to listen, and the blocks
  after it are its clients. At the end its whole process group is stopped: SIGTERM, then SIGKILL.
- Comment lines that end a block show what it prints. The block's output must be that text (JSON is
  compared as JSON); a leading HTTP status before it, which `curl -s` does not print, is checked by
  running the block's last curl once more with `-o /dev/null -w '%{http_code}'`.
- The ports are the documents' own (127.0.0.1:10000, …). As root each document's blocks get a network
  namespace of their own, whose loopback nothing else on the machine uses; otherwise every port they
  name must be free, or the test is skipped (and fails under CI=true).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "notest"
# What starts a command, for finding commands in a block that says it holds none.
_COMMAND = re.compile(r"(\.venv/bin/|(kvgate|envoy|helm|kubectl|make|curl|docker|python3?(\.\d+)?) )")
# Paths the blocks name that they write themselves: never copied from the checkout.
WRITTEN = frozenset({"out"})
SERVICES_TIMEOUT_S = 120.0
BLOCK_TIMEOUT_S = 120.0
STOP_GRACE_S = 30.0
_PATH = re.compile(r"(?:^|(?<=[\s'\"=]))(\.?[A-Za-z0-9_][\w.-]*)/", re.MULTILINE)
_BACKGROUND = re.compile(r"[^&]&\s*(?:#.*)?$")


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int  # of the opening fence
    info: tuple[str, ...]
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    @property
    def language(self) -> str:
        return self.info[0] if self.info else ""

    @property
    def first_command(self) -> str:
        """The first line that is neither blank nor a comment."""
        lines = (line.strip() for line in self.lines)
        return next((line for line in lines if line and not line.startswith("#")), "")

    def why_not_run(self) -> str | None:
        """The REASON of a `sh notest: REASON` fence ('' when it gives none); None for other fences."""
        if self.language != "sh" or self.info[1:2] not in ((NOT_RUN,), (f"{NOT_RUN}:",)):
            return None
        return " ".join(self.info[2:])

    def runs(self) -> bool:
        return self.info == ("sh",)

    def serves(self) -> bool:
        return any(_BACKGROUND.search(line) for line in self.lines)

    def ports(self) -> list[int]:
        return sorted({int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", self.text)})

    def commands(self) -> list[str]:
        """The block's commands, continuation lines joined, comments left out."""
        commands, current = [], ""
        for line in self.lines:
            if not current and (not line.strip() or line.lstrip().startswith("#")):
                continue
            current += line
            if current.endswith("\\"):
                current = current[:-1]
            else:
                commands.append(current.strip())
                current = ""
        return commands

    def shown_output(self) -> str | None:
        """The text of the comment lines that end the block; an indented one continues the line."""
        tail: list[str] = []
        for line in reversed(self.lines):
            if not line.startswith("#"):
                break
            tail.insert(0, line[1:])
        if not tail:
            return None
        shown: list[str] = []
        for part in tail:
            if shown and part.startswith("   "):
                shown[-1] += " " + part.strip()
            else:
                shown.append(part.strip())
        return "\n".join(shown)


def read_blocks(path: Path) -> list[Block]:
    blocks, opened, body = [], None, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if opened is None and line.startswith("```"):
            opened, body = (number, tuple(line[3:].split())), []
        elif opened is not None and line.strip() == "```":
            blocks.append(Block(path, opened[0], opened[1], tuple(body)))
            opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{path}:{opened[0]}: a fence that never closes"
    return blocks


def documents() -> list[Path]:
    """The documents with a block to run."""
    return [document for document in DOCUMENTS if any(block.runs() for block in read_blocks(document))]


def fence_problem(block: Block) -> str | None:
    """What is wrong with the block's fence, if anything."""
    if not block.info:
        return f"{block}: a fence without a language (sh, console, text, yaml, …)"
    if block.language == "sh" and not block.runs() and not block.why_not_run():
        return f"{block}: ```{' '.join(block.info)}: a sh fence is ```sh or ```sh {NOT_RUN}: REASON"
    if block.language not in ("sh", "console") and _COMMAND.match(block.first_command):
        return f"{block}: commands in a ```{block.language} fence: ```sh, or ```sh {NOT_RUN}: REASON"
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_block_says_what_it_is(document: Path) -> None:
    problems = [problem for block in read_blocks(document) if (problem := fence_problem(block))]
    assert not problems, "\n".join(problems)


def test_fences_that_do_not_say_what_they_are_are_found() -> None:
    def block(info: str, *lines: str) -> Block:
        return Block(README, 1, tuple(info.split()), lines)

    assert block("sh notest: needs a cluster", "helm install x").why_not_run() == "needs a cluster"
    for fine in (block("sh", "make demo"), block("sh notest: why", "x"), block("console", "$ kvgate x")):
        assert fence_problem(fine) is None, fine
    for wrong in (
        block("", "make image"),
        block("sh notest", "helm install x"),
        block("sh runnable", "kvgate queue"),
        block("text", "# the demo", ".venv/bin/kvgate demo"),
    ):
        assert fence_problem(wrong) is not None, wrong
    assert fence_problem(block("text", "kvgate-gate ──► agent")) is None


def test_shown_output_joins_indented_comment_lines() -> None:
    block = Block(README, 1, ("sh",), ("curl -s x \\", "  -d y", '# 413 {"a": "b', '#   c"}'))
    assert block.commands() == ["curl -s x   -d y"]
    assert block.shown_output() == '413 {"a": "b c"}'
    assert not block.serves() and Block(README, 1, ("sh",), ("a &  # it runs", "b")).serves()


# --- running them -----------------------------------------------------------------------------------------


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the documents' blocks run in CI, but here: {reason}", pytrace=False)
    pytest.skip(f"the documents' blocks cannot run here: {reason}")


@dataclass(frozen=True, slots=True)
class Network:
    """Where the blocks' 127.0.0.1 lives: a network namespace held open by `holder`, else the host's."""

    holder: subprocess.Popen[str] | None

    def argv(self, argv: list[str]) -> list[str]:
        if self.holder is None:
            return argv
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--", *argv]

    def listening(self, port: int) -> bool:
        probe = ["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]
        return subprocess.run(self.argv(probe), capture_output=True, check=False).returncode == 0


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def own_network(ports: list[int]) -> Iterator[Network]:
    """A fresh network namespace with its loopback up (root), else the host's with `ports` free."""
    if os.geteuid() == 0 and all(shutil.which(tool) for tool in ("unshare", "nsenter", "ip")):
        holder = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", "ip link set lo up && echo up && exec sleep 86400"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert holder.stdout is not None
            if holder.stdout.readline().strip() == "up":
                yield Network(holder)
                return
        finally:
            holder.kill()
            holder.wait()
            if holder.stdout is not None:
                holder.stdout.close()
    busy = [port for port in ports if not _port_free(port)]
    if busy:
        unavailable(f"no network namespace of their own, and 127.0.0.1 ports {busy} are in use")
    yield Network(None)


def prepare(workdir: Path, blocks: list[Block]) -> None:
    """The repository paths the blocks name, copied (the virtualenv linked) into `workdir`."""
    workdir.mkdir()
    for name in sorted({name for block in blocks for name in _PATH.findall(block.text)}):
        source = ROOT / name
        if name == ".venv":
            (workdir / name).symlink_to(Path(sys.prefix))
        elif name not in WRITTEN and source.is_dir():
            shutil.copytree(source, workdir / name, symlinks=True)
        elif name not in WRITTEN and source.is_file():
            shutil.copy2(source, workdir / name)


class Services:
    """The blocks running in the background, each a process group of its own; stopped at the end."""

    def __init__(self) -> None:
        self._running: list[tuple[Block, subprocess.Popen[bytes], Path]] = []

    def start(self, block: Block, network: Network, workdir: Path, log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            process = subprocess.Popen(
                network.argv(["bash", "-e", "-c", block.text]),
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._running.append((block, process, log))
        return process

    def logs(self) -> str:
        parts = []
        for block, _, log in self._running:
            lines = log.read_text(errors="replace").splitlines()[-40:]
            parts.append(f"--- output of {block}:\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        for _, process, _ in self._running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for _, process, _ in self._running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
            # Whatever of the group outlived the grace (or the shell), by its group id.
            while _group_alive(process.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_serving(
    block: Block, process: subprocess.Popen[bytes], network: Network, services: Services
) -> None:
    waiting = block.ports()
    deadline = time.monotonic() + SERVICES_TIMEOUT_S
    while waiting := [port for port in waiting if not network.listening(port)]:
        code = process.poll()
        assert code in (None, 0), f"{block} ended with status {code}\n{services.logs()}"
        silent = f"{block}: nothing listens on 127.0.0.1 {waiting} after {SERVICES_TIMEOUT_S:g} s"
        assert time.monotonic() < deadline, f"{silent}\n{services.logs()}"
        time.sleep(0.2)


def check_output(block: Block, printed: str, network: Network, workdir: Path) -> None:
    shown = block.shown_output()
    if shown is None:
        return
    last = block.commands()[-1]
    status = re.fullmatch(r"(\d{3}) (.*)", shown, re.DOTALL)
    if status is not None and last.startswith("curl "):
        shown = status[2]
        again = subprocess.run(
            network.argv(["bash", "-c", f"{last} -o /dev/null -w '%{{http_code}}'"]),
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
        assert again.stdout == status[1], (
            f"{block}: HTTP status {again.stdout!r}, the document shows {status[1]}"
        )
    try:
        assert json.loads(printed) == json.loads(shown), (
            f"{block} printed\n{printed}\nthe document shows\n{shown}"
        )
    except json.JSONDecodeError:
        assert printed.split() == shown.split(), f"{block} printed\n{printed}\nthe document shows\n{shown}"


@pytest.mark.slow
@pytest.mark.parametrize("document", documents(), ids=lambda path: str(path.relative_to(ROOT)))
def test_command_blocks_run_as_written(document: Path, tmp_path: Path) -> None:
    blocks = [block for block in read_blocks(document) if block.runs()]
    if shutil.which("curl") is None and any("curl " in block.text for block in blocks):
        unavailable("curl is not installed")
    workdir = tmp_path / "work"
    prepare(workdir, blocks)
    services = Services()
    with own_network(sorted({port for block in blocks for port in block.ports()})) as network:
        try:
            for block in blocks:
                if block.serves():
                    process = services.start(block, network, workdir, tmp_path / f"block-{block.line}.log")
                    wait_serving(block, process, network, services)
                    continue
                done = subprocess.run(
                    network.argv(["bash", "-e", "-c", block.text]),
                    cwd=workdir,
                    capture_output=True,
                    text=True,
                    timeout=BLOCK_TIMEOUT_S,
                    check=False,
                )
                assert done.returncode == 0, (
                    f"{block} failed ({done.returncode}):\n{done.stderr}\n{services.logs()}"
                )
                check_output(block, done.stdout, network, workdir)
        finally:
            services.stop()
