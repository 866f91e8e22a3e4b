# The two Quickstart commands. Both create .venv and install what they need: the demo
# only what it runs (extra `demo`), the tests the development tools as well (extra `dev`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install chaos install-demo chromium

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

# The dashboard's browser test (tests/ui) drives Debian's chromium; install it when missing
# (as root, or through sudo without a password). Without it that test skips, saying why.
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq chromium; } \
		|| { sudo -n apt-get update -qq && sudo -n apt-get install -y -qq chromium; } \
		|| echo "chromium could not be installed: tests/ui will skip"

test: install chromium
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q -n 2

# The chaos suite's long form: hundreds of faults (kill -9 of board, publisher and follower,
# a board replica frozen, Redis flushed, frozen and restarted, SeaweedFS frozen and
# restarted, corrupted blobs), each followed by the invariants; prints its seed and counts.
# `make test` runs its short form.
CHAOS_FAULTS ?= 300
chaos: install
	DELTABOARD_CHAOS_FAULTS=$(CHAOS_FAULTS) $(BIN)/pytest tests/chaos -q -s -p no:cacheprovider --timeout=0
