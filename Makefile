# Two commands do all setup on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

# (Re)create the virtual environment when it is missing or pyproject.toml changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m transformer_jax.demo

test: $(STAMP)
	$(PY) -m pytest tests -n 2

clean:
	rm -rf $(VENV) runs
