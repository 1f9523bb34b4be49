#!/usr/bin/env bash
# The peer routers kvgate is compared with, as they ship on PyPI: smg (SGLang Model Gateway) and
# vllm-router (vLLM's router), both Rust binaries in Python wheels. They go into a venv of their own,
# cached outside the clone (${KVGATE_PEERS_CACHE:-$HOME/.cache/kvgate/peers}) so a fresh clone or
# `make clean` does not download 60 MB again; `.venv-peers` in the checkout is a symlink to it.
# Idempotent: a venv whose stamp lists exactly these pins is kept as it is.
set -euo pipefail

# Pinned as shipped, with everything they pull in (what pip resolved for Python 3.11 on 2026-12-01).
PINS=(
  "smg==1.13.0"
  "vllm-router==0.1.17"
  "aiohappyeyeballs==2.7.1" "aiohttp==3.14.5" "aiosignal==1.4.0" "annotated-doc==0.0.7"
  "annotated-types==0.8.0" "anyio==4.16.0" "attrs==26.1.0" "certifi==2026.10.19.post1"
  "charset-normalizer==3.5.3" "click==8.5.1" "fastapi==0.165.0" "frozenlist==1.8.0" "grpcio==1.85.1"
  "grpcio-health-checking==1.85.1" "h11==0.16.0" "idna==3.20" "multidict==7.2.1"
  "opentelemetry-api==1.45.2" "orjson==3.13.0" "propcache==0.5.4" "protobuf==7.36.2"
  "pydantic==2.14.4" "pydantic_core==2.50.5" "PyYAML==6.0.4" "requests==2.34.2" "setproctitle==1.3.7"
  "starlette==1.10.0" "typing-inspection==0.4.5" "typing_extensions==4.16.0" "urllib3==2.8.0"
  "uvicorn==0.54.0" "yarl==1.25.1"
)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${KVGATE_PEERS_CACHE:-$HOME/.cache/kvgate/peers}"
python="${PYTHON:-python3}"
venv="$cache/venv"
stamp="$venv/.kvgate-pins"
link="$here/.venv-peers"
wanted="$(printf '%s\n' "${PINS[@]}")"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && [ -x "$venv/bin/smg" ] \
  && [ -x "$venv/bin/vllm-router" ]; then
  echo "peers: $venv already holds ${PINS[0]} ${PINS[1]}"
else
  echo "peers: installing ${PINS[0]}, ${PINS[1]} and their dependencies (${#PINS[@]} pinned packages) into $venv"
  mkdir -p "$cache"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${PINS[@]}"
  "$venv/bin/python" -m pip check
  printf '%s\n' "$wanted" >"$stamp"
fi

if [ -L "$link" ] || [ ! -e "$link" ]; then
  ln -sfn "$venv" "$link"
else
  echo "peers: $link exists and is not a symlink; leaving it alone" >&2
  exit 1
fi
echo "peers: $link -> $venv"
