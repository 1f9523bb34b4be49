"""Docker for the image test, on machines that reach no container registry.

`docker_daemon()` gives the daemon DOCKER_HOST (or the client's default socket) reaches; when there is
none it starts a private `dockerd` as root, with its data root, exec root and socket in a temporary
directory, no iptables and no bridge (containers use the host's network), and stops it at the end.
Its storage driver is overlay2 where the kernel allows it, else vfs: vfs copies the whole filesystem
for every layer and container, which made one image build take 2 min 15 s here against 22 s.

`debian_base()` gives a Python 3.11 base image built from Debian packages (`mmdebstrap`, imported
with `docker import`), cached as a tarball outside the repository and keyed on how it is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

STORAGE_DRIVERS = ("overlay2", "vfs")
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
# The base: Debian's Python 3.11 (bookworm), a venv module for the build stage, CA certificates.
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
BASE_TIMEOUT_S = 600.0


class DockerUnavailable(Exception):
    """Docker cannot run here; the message says why."""


@dataclass(frozen=True, slots=True)
class Docker:
    """The docker client pointed at one daemon. `own`: a daemon started here (nothing else uses it)."""

    host: str | None
    own: bool

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.host is not None:
            env["DOCKER_HOST"] = self.host
        return env

    def run(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, env=self.env(), check=False
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:4])} failed ({result.returncode}):\n{result.stderr}")
        return result


def _answers(docker: Docker) -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return (
            docker.run("version", "--format", "{{.Server.Version}}", timeout=15, check=False).returncode == 0
        )
    except subprocess.TimeoutExpired:
        return False


@contextlib.contextmanager
def docker_daemon() -> Iterator[Docker]:
    """A daemon for the duration of the block: the reachable one, else a private one."""
    existing = Docker(os.environ.get("DOCKER_HOST"), own=False)
    if _answers(existing):
        yield existing
        return
    missing = [tool for tool in ("docker", "dockerd") if shutil.which(tool) is None]
    if missing:
        raise DockerUnavailable(f"no Docker daemon is reachable and {', '.join(missing)} is not installed")
    if os.geteuid() != 0:
        raise DockerUnavailable("no Docker daemon is reachable, and starting one needs root")
    # Short: the daemon's sockets live under it, and a unix socket path holds 107 bytes at most.
    root = Path(tempfile.mkdtemp(prefix="kvgate-dockerd-", dir="/tmp"))
    process: subprocess.Popen[bytes] | None = None
    try:
        failures = []
        for driver in STORAGE_DRIVERS:
            process, docker = _start(root, driver)
            if _wait_ready(docker, process):
                break
            failures.append(f"{driver}: {_log_tail(root)}")
            _stop(process)
            process = None
        else:
            raise DockerUnavailable("dockerd did not start:\n" + "\n".join(failures))
        yield docker
    finally:
        if process is not None:
            _stop(process)
        _unmount_below(root)
        shutil.rmtree(root, ignore_errors=True)


def _start(root: Path, driver: str) -> tuple[subprocess.Popen[bytes], Docker]:
    for name in ("data", "exec"):
        shutil.rmtree(root / name, ignore_errors=True)
    socket = root / "docker.sock"
    argv = [
        "dockerd",
        *("--storage-driver", driver),
        *("--data-root", str(root / "data"), "--exec-root", str(root / "exec")),
        *("--pidfile", str(root / "dockerd.pid"), "--host", f"unix://{socket}"),
        # No registry is reachable and the host network is used: no NAT rules, no bridge.
        *("--iptables=false", "--ip6tables=false", "--bridge=none"),
    ]
    log = (root / "dockerd.log").open("wb")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return process, Docker(f"unix://{socket}", own=True)


def _wait_ready(docker: Docker, process: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if _answers(docker):
            return True
        time.sleep(0.3)
    return False


def _log_tail(root: Path, lines: int = 5) -> str:
    try:
        return "\n".join((root / "dockerd.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM: dockerd stops its containers and its containerd, and unmounts its layers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _unmount_below(root: Path) -> None:
    """What dockerd left mounted under its directories (its default network namespace stays bound
    under exec/netns after a clean stop), deepest first."""
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1] for line in mounts]
    prefix = f"{root}/"
    for point in sorted((p for p in points if p.startswith(prefix)), reverse=True):
        subprocess.run(["umount", point], capture_output=True, check=False, timeout=30)


def base_cache_key(suite: str = BASE_SUITE, packages: Sequence[str] = BASE_PACKAGES) -> str:
    return hashlib.sha256(f"mmdebstrap minbase {suite} {' '.join(sorted(packages))}".encode()).hexdigest()[
        :16
    ]


def debian_base(docker: Docker, cache_root: Path) -> str:
    """The tag of a Debian bookworm base with Python 3.11, imported into `docker` from the cached tarball
    (built first with mmdebstrap when absent)."""
    key = base_cache_key()
    tag = f"kvgate-test-base:{key}"
    if docker.run("image", "inspect", tag, check=False).returncode == 0:
        return tag
    tarball = cache_root / f"debian-{BASE_SUITE}-python3-{key}.tar"
    if not tarball.exists():
        _mmdebstrap(tarball)
    docker.run("import", str(tarball), tag, timeout=300)
    return tag


def _mmdebstrap(tarball: Path) -> None:
    if shutil.which("mmdebstrap") is None:
        raise DockerUnavailable("mmdebstrap is not installed (make setup installs it with apt)")
    if os.geteuid() != 0:
        raise DockerUnavailable("building the Debian base image with mmdebstrap needs root")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    # Our own name: another run building the same base at once writes its own. It ends in .tar, and the
    # format is named as well: mmdebstrap picks its output format from the file name, and under any
    # other name it writes a directory, which `docker import` refuses.
    partial = tarball.with_name(f"{tarball.stem}.{os.getpid()}.partial.tar")
    argv = [
        "mmdebstrap",
        "--variant=minbase",
        "--format=tar",
        f"--include={','.join(BASE_PACKAGES)}",
        BASE_SUITE,
        str(partial),
    ]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=BASE_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed ({result.returncode}):\n{result.stderr[-3000:]}")
        if not partial.is_file():
            raise RuntimeError(f"mmdebstrap wrote no tarball at {partial}")
        # Renamed only when whole: an interrupted run leaves no cache entry behind.
        partial.replace(tarball)
    finally:
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)
