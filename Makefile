# The two Quickstart commands. Both create .venv and install what they need: the demo
# only what it runs (extra `demo`), the tests the development tools as well (extra `dev`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install install-demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install-demo: $(BIN)/python
	@echo "installing the demo's dependencies into $(VENV) (torch, transformers, FastAPI: minutes the first time)"
	$(BIN)/pip install --quiet -e '.[demo]'

install: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'

demo: install-demo
	$(BIN)/deltaboard demo

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q
