# The two commands of the README:
#   make demo   installs what it needs into .venv and runs `flashwatch demo`
#   make test   installs what it needs into .venv and runs the whole test suite
# Variables: PYTHON (interpreter for the venv), VENV (its folder), TORCH (the torch
# requirement used only when the venv has no torch yet), ARGS (extra arguments for demo),
# JOBS (test processes, pytest-xdist: 2 by default, 1 runs the tests one at a time in one process).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TRITON ?= triton==3.6.0
ARGS ?=
JOBS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flashwatch-installed

.PHONY: demo test install prometheus clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the version tested. From PyPI on Linux that is a CUDA build (GBs); for the
	# CPU build: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" (unquoted below)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	# Triton runs the kernels on CUDA and, under TRITON_INTERPRET=1, on the CPU in tests.
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q "$(TRITON)" || echo "no triton wheel here: the CPU reference path still works"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The Prometheus end-to-end tests need prometheus and promtool (Debian package `prometheus`).
prometheus:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
	      || echo "could not install prometheus: its tests will be skipped"; \
	  else echo "prometheus not installed and not root: its tests will be skipped (apt-get install prometheus)"; fi; }

demo: $(STAMP)
	$(VENV)/bin/flashwatch demo $(ARGS)

test: $(STAMP) prometheus
	$(PY) -m pytest -q $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist worksteal)

clean:
	rm -rf $(VENV) build *.egg-info runs
