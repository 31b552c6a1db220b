# Two entry points: `make demo` and `make test`. Both create .venv on first use.
# Two stamps: `make demo` installs the runtime only (torch, then torchtsp, its dependencies and the serve extra); `make test`,
# `make test-fast` and `make lint` add the test dependencies (the dev extra: transformers, lm-eval, ...) on top.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean

$(RUNTIME): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pinned torch first: a local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	@echo "make: installing torch (CPU wheel), then torchtsp into $(VENV) (pip names each package as it goes)"
	$(PY) -m pip install --progress-bar off torch==2.13.0 numpy
	# The serve extra too (fastapi, uvicorn, pydantic, jinja2, prometheus_client: small), so the README's serve
	# example runs after `make demo` alone.
	$(PY) -m pip install --progress-bar off -e ".[serve]"
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	@echo "make: adding the test dependencies (torchtsp[dev]) into $(VENV) (a few minutes)"
	$(PY) -m pip install --progress-bar off -e ".[dev]"
	touch $(STAMP)

demo: $(RUNTIME)
	$(VENV)/bin/torchtsp train --preset tiny --nproc 4 --tsp 4 --steps 120 --out runs/demo --overwrite

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest --durations=15

# The inner loop: single-process unit tests only (no multi-rank runs); README gives the measured time.
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -m "not multirank" --durations=5

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
