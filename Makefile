# Two commands do all setup on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo tour test test-long test-fast test-lower lint format venv clean

# (Re)create the virtual environment when it is missing or pyproject.toml changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev,hf,cpu,data,ray]'
	touch $(STAMP)

venv: $(STAMP)

# The main job on the embedded corpus (the Python standard library): prepare, train, evaluate,
# checkpoint, plot, sample. Leaves runs/gpt_tiny/. Running it again finds the run finished (exit 0).
# --check-bars: exit 3 if the learning bar is not reached (a plain `tjax train` only reports it).
# Ends with report/index.html: curves, samples, attention maps, position pictures (opens offline).
demo: $(STAMP)
	$(PY) -m transformer_jax.cli train experiments/gpt_tiny.yaml --check-bars
	$(PY) -m transformer_jax.cli report runs/gpt_tiny --text "def add(a, b): return a + b" --out report

# A tour of the model families: each tiny preset's forward pass and `tjax info` for a few presets.
tour: $(STAMP)
	$(PY) -m transformer_jax.cli.demo

# tests/parallel run in their own process: they need 8 simulated devices from the start.
# Whole programs end to end (marked long) are make test-long's; CI runs both.
test: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist worksteal --ignore=tests/parallel -m "not long"
	$(PY) -m pytest tests/parallel -n 2 --dist worksteal -m "not long"

# Whole programs: training runs killed and resumed through the CLI, two- and four-process
# launches, resumes on other topologies, the README's Python blocks, benchmarks against their
# rivals, an experiment's tiny run, the learning bars of unit tests.
test-long: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist worksteal --ignore=tests/parallel -m long
	$(PY) -m pytest tests/parallel -n 2 --dist worksteal -m long

# The inner loop: the core's unit tests (ops, layers, models, backends) without the tests marked
# slow. The conformance suite (tests/conformance) compiles every model kind: make test runs it.
test-fast: $(STAMP)
	$(PY) -m pytest tests/ops tests/layers tests/models tests/backends -n 2 -m "not slow"

# The lowest versions pyproject.toml admits of jax, flax, optax, orbax and chex
# (.ci/lower-bounds.txt), in a venv of their own: the core's and the trainer's fast tests.
LOWER := .venv-lower
test-lower:
	test -x $(LOWER)/bin/python || $(PYTHON) -m venv $(LOWER)
	$(LOWER)/bin/python -m pip install -q -c .ci/lower-bounds.txt -e '.[test,cpu]'
	$(LOWER)/bin/python -m pytest tests/ops tests/layers tests/models tests/backends tests/train \
	  -n 2 -m "not slow"

# What CI checks: the lint rules and the formatting (configured in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrites the tree to the house format and applies ruff's safe fixes.
format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(LOWER) runs report
