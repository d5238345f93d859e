# Two commands: `make run` (set up and serve the demo) and `make test` (set up and run
# every check; `make test-quick` leaves out the slow tests). Everything else here is a
# helper for those.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Checks and tests never need a real secret. The benches chat with the offline demo
# (fake/*), which a server with DEBUG off offers only with ARBOR_FAKE_MODELS=1.
TEST_ENV := SECRET_KEY=test-only-secret-key-not-for-production ARBOR_FAKE_MODELS=1

# Real agent harnesses for the gateway tests (tests/test_gateway_harness.py) and the
# importer tests (Codex: tests/test_import_codex.py), from the npm registry at pinned
# versions; and Anthropic's legacy public Claude tokenizer (its table, claude.json) for
# the compaction bench's token counts. Without npm they are skipped, except under CI=true.
HARNESS := var/harness
HARNESS_STAMP := $(HARNESS)/.installed-stamp
HARNESS_PACKAGES := @anthropic-ai/claude-code@2.1.197 @mariozechner/pi-coding-agent@0.73.1 \
  @openai/codex@0.171.0 @anthropic-ai/tokenizer@0.0.4

.PHONY: setup run test test-quick lint typecheck pytest bench clean harness

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

$(HARNESS_STAMP): Makefile
	@if command -v npm >/dev/null; then \
	  mkdir -p $(HARNESS) && cd $(HARNESS) && \
	  { [ -f package.json ] || echo '{"private": true}' > package.json; } && \
	  npm install --no-audit --no-fund --loglevel=error $(HARNESS_PACKAGES) && \
	  touch .installed-stamp; \
	elif [ "$$CI" = true ]; then echo "npm is missing: the harness tests cannot run" >&2; exit 1; \
	else echo "npm is missing: the harness tests will be skipped"; fi

harness: $(HARNESS_STAMP)

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

# The suite runs in PYTEST_WORKERS processes (pytest-xdist), a test file per process at
# a time: many tests wait on subprocesses (servers, workers, harnesses, OCR), so even a
# 2-core machine gains from three. Each process gets its own test database and Redis db.
# Each run ends with its 20 slowest tests and one line naming every skip (conftest.py).
PYTEST_WORKERS ?= 3
PYTEST := $(TEST_ENV) $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=20
pytest: setup harness
	$(PYTEST)

test: lint typecheck pytest

# The same checks and tests without those marked slow (OCR, the real agent CLIs, chaos,
# benches, browser tests with a server of their own): the quick loop while working.
test-quick: lint typecheck setup harness
	$(PYTEST) -m "not slow"

bench: setup harness
	mkdir -p var
	DEBUG=1 $(BIN)/python manage.py migrate --noinput
	DEBUG=1 $(BIN)/python manage.py bench_tree
	$(TEST_ENV) $(BIN)/python manage.py bench_turns
	$(TEST_ENV) $(BIN)/python manage.py bench_compaction
	$(TEST_ENV) $(BIN)/python manage.py bench_import
	$(TEST_ENV) $(BIN)/python manage.py bench_storage
	$(TEST_ENV) $(BIN)/python manage.py bench_gateway
	$(TEST_ENV) $(BIN)/python manage.py bench_harness
	$(TEST_ENV) $(BIN)/python manage.py bench_load
	$(TEST_ENV) $(BIN)/python manage.py bench_page
	@# The tree, turns, storage and load on PostgreSQL, when one is reachable (CI's
	@# machine has one).
	@if pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then \
	  psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='arbor_bench'" | grep -q 1 \
	    || createdb -h 127.0.0.1 -U postgres arbor_bench; \
	  export DATABASE_URL=postgres://postgres@127.0.0.1:5432/arbor_bench $(TEST_ENV) && \
	  $(BIN)/python manage.py migrate --noinput -v0 && \
	  for bench in bench_tree bench_turns bench_storage bench_load; do \
	    $(BIN)/python manage.py $$bench || exit 1; done; \
	else echo '{"postgresql": "skipped: no PostgreSQL on 127.0.0.1:5432"}'; fi

clean:
	rm -rf $(VENV) var/*.sqlite3
