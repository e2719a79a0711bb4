# The README's two commands: `make demo` and `make test`. Each creates .venv
# and installs what it needs from pyproject.toml; nothing else is required.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,demo,docs,web,langchain,http]'
	touch $@

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,demo,docs,web,langchain,http,bench]'
	touch $@

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/python -m examples.demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -n auto --dist worksteal

# The documentation site, into site/ (the suite builds it too, strictly).
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis demo-output site
