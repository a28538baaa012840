# The two commands of the README:
#   make demo   - set up and run the example project's demo (SQLite, no server needed)
#   make test   - set up and run the whole test suite (lint, types, every backend), in
#                 each cell of the tested matrix (tox.ini, scripts/test-matrix)
# Both create .venv on first use; nothing is installed outside the project but the
# system packages the test servers need (scripts/install-test-deps).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint matrix pytest clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The demo needs only the package; lint, tox and the quick `make pytest` (this venv's
# Python and Django only) need every extra.
$(BIN)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(BIN)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(BIN)/.installed-base
	cd example_project && ../$(BIN)/python manage.py migrate --noinput --verbosity 0
	cd example_project && ../$(BIN)/python manage.py syncguard_demo

test: $(BIN)/.installed
	bash scripts/install-test-deps
	$(MAKE) --no-print-directory lint matrix

# Python 3.11 + Django 5.2 and Python 3.13 + Django 6.1, each in its own tox env.
matrix: $(BIN)/.installed
	bash scripts/test-matrix $(PYTEST_ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy django_syncguard

pytest: $(BIN)/.installed
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .tox .pytest_cache .mypy_cache .ruff_cache .test-servers
