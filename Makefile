# Two commands: `make run` (set up and serve the demo) and `make test` (set up and run
# every check). Everything else here is a helper for those two.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Checks and tests never need a real secret.
TEST_ENV := SECRET_KEY=test-only-secret-key-not-for-production

.PHONY: setup run test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	mkdir -p var
	DEBUG=1 $(BIN)/python manage.py migrate --noinput
	DEBUG=1 $(BIN)/python manage.py seed_demo
	@echo "Serving on http://127.0.0.1:8000/ (ASGI, uvicorn); Ctrl-C stops."
	DEBUG=1 $(BIN)/uvicorn arbor.asgi:application --host 127.0.0.1 --port 8000

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(TEST_ENV) $(BIN)/mypy .

pytest: setup
	$(TEST_ENV) $(BIN)/pytest

test: lint typecheck pytest

bench: setup
	mkdir -p var
	DEBUG=1 $(BIN)/python manage.py migrate --noinput
	DEBUG=1 $(BIN)/python manage.py bench_tree
	$(TEST_ENV) $(BIN)/python manage.py bench_turns
	$(TEST_ENV) $(BIN)/python manage.py bench_compaction
	$(TEST_ENV) $(BIN)/python manage.py bench_import

clean:
	rm -rf $(VENV) var/*.sqlite3
