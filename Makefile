# The two entry points a newcomer needs (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPECBENCH := $(VENV)/bin/specbench
# torch is chosen per machine, never left to the registry's default: the CPU build where no CUDA driver
# answers (nvidia-smi), the CUDA build where one does; the install is then checked to be that build.
# Elsewhere the CPU wheel comes from PyTorch's CPU index: make setup TORCH_PIP_ARGS="--index-url URL".
TORCH_VERSION ?= 2.13.0
CUDA := $(shell nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(CUDA),1)
# === (exact string): never 2.13.0+cpu, which == would also match where a CPU wheel sits in pip's find-links
TORCH_SPEC ?= torch===$(TORCH_VERSION)
TORCH_CHECK := torch.version.cuda is not None
else
TORCH_SPEC ?= torch==$(TORCH_VERSION)+cpu
TORCH_CHECK := torch.version.cuda is None
endif
TORCH_PIP_ARGS ?=
# What `make setup` installs, at the versions in constraints.txt (scripts/freeze_constraints.py writes it).
EXTRAS ?= test,eval,hf,frames

.PHONY: setup demo test lint fixtures clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "setup: $(VENV) with $(TORCH_SPEC) and specbench[$(EXTRAS)] pinned by constraints.txt (~1-4 min once)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	@# setuptools' "Editable installation" notice (folders named like the package in the working directory:
	@# specbench/ holds the links to the same code) is information, not a problem: kept out of the output.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	$(PY) -c "import torch, sys; sys.exit(0 if $(TORCH_CHECK) else 'torch ' + torch.__version__ + ' is not the build wanted ($(TORCH_CHECK))')"
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
