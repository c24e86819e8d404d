# tokenpools: `make run` for the site with demo data, `make test` for the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST := $(BIN)/python -m pytest

.PHONY: venv system-deps migrate demo run serve test test-sqlite test-postgres lint bench-policy clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,engine]'
	touch $(STAMP)

venv: $(STAMP)

system-deps:
	bash .ci/system-deps.sh

migrate: venv
	$(BIN)/python manage.py migrate --noinput

demo: migrate
	$(BIN)/python manage.py seed_demo

run: demo
	$(BIN)/python manage.py serve --host $(HOST) --port $(PORT)

serve: venv
	$(BIN)/python manage.py serve --host $(HOST) --port $(PORT)

# The whole suite on SQLite, then the REST API suite again on a real PostgreSQL started for it.
test: venv system-deps lint test-sqlite test-postgres

test-sqlite: venv
	$(PYTEST) -q

test-postgres: venv
	$(BIN)/python -m tests.support.services --postgres -- $(PYTEST) -q -m "api or postgres" -p no:cacheprovider

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench-policy: venv
	$(BIN)/python -m bench.policy

clean:
	rm -rf $(VENV) db.sqlite3 var .pytest_cache
