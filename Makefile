# The README's two set-up commands: `make run` and `make test`. Both work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow lint bench models clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip

$(STAMP): pyproject.toml | $(PY)
	# torch first and pinned: the CPU build on local disk; an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,load]'
	touch $(STAMP)

nginx:
	@command -v nginx >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q nginx)

run: $(STAMP)
	$(VENV)/bin/pagedserve serve

test: $(STAMP) nginx
	$(PY) -m pytest -q

test-slow: $(STAMP) nginx
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/offline.py

models: $(STAMP)
	$(PY) models/train.py

clean:
	rm -rf $(VENV) build *.egg-info
