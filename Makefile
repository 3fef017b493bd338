# The two entry points a newcomer needs (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPECBENCH := $(VENV)/bin/specbench
# CPU build of torch unless a CUDA driver is visible (the CPU wheel installs quickly from local disk).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: setup demo test lint fixtures clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,eval]"
	touch $@

demo: setup
	$(SPECBENCH) demo

test: setup
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check .

fixtures: setup
	$(SPECBENCH) fixtures --out harness/data/fixtures/tiny --seed 0

clean:
	rm -rf $(VENV) results/* build *.egg-info
