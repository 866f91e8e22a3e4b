# The two Quickstart commands. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'

demo: install
	$(BIN)/deltaboard demo

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q
