# Development tasks for django-idempotency. `make help` lists them.
#
# Everything runs from a virtualenv in .venv, made with $(PYTHON) when missing. The package is
# installed there in editable mode with all extras and the `dev` dependency group, again only
# when pyproject.toml changed since the last install (a stamp file inside .venv remembers).
# The example project (`make demo`, `make storm`) runs from .venv-demo instead: the package
# with its extras and the `demo` group, nothing of the test or docs tooling. Each venv is
# filled by uv, which pip installs into it first: a few seconds, where pip's own install
# took most of a minute in CI (and `--group` needs pip 25.1, newer than many a venv's).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
REPORTS := $(VENV)/reports
EXTRAS := drf,celery,postgres,openapi,ninja,crypto,mcp,fastmcp,tasks
DEMO_VENV := .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
DEMO_STAMP := $(DEMO_VENV)/.installed-stamp

# The example project: its database (sqlite or postgres), the port of the throwaway server
# the retry storm runs against, and where `make demo` serves in the end.
EXAMPLE_DB ?= sqlite
export EXAMPLE_DB
# The example's charges also enqueue their receipt through Django's Tasks framework.
EXAMPLE_TASKS_RECEIPTS ?= 1
export EXAMPLE_TASKS_RECEIPTS
EXAMPLE_PGDATABASE ?= django_idempotency_example
STORM_PORT ?= 8765
DEMO_ADDR ?= 127.0.0.1:8000

# tox environments to run (comma-separated); empty runs the whole grid of tox.ini.
ENVS ?=

# tox needs python3.10 ... python3.13 on PATH. Where pyenv manages them and PYENV_VERSION is
# not set already, ask pyenv for the newest installed release of each, python3.11 first.
ifndef PYENV_VERSION
PYENV_GRID = $(shell command -v pyenv >/dev/null 2>&1 && \
	for v in 3.11 3.10 3.12 3.13; do pyenv latest $$v 2>/dev/null; done | paste -sd: -)
endif

.PHONY: help install lint check-migrations test test-quick coverage docs docs-code docs-screenshots test-mysql test-poolers test-pg16 test-galera test-standby test-tenants tox-pg16 test-quickstart \
	soak tox example-db storm demo clean

help:
	@echo "make test     lint, type-check, migration check, then pytest on SQLite and PostgreSQL"
	@echo "make test-quick  pytest on SQLite without the tests that start servers: no lint, no coverage"
	@echo "make lint     ruff (lint and format check), mypy, yamllint and actionlint"
	@echo "make coverage the coverage report of the last make test, with the lines missed"
	@echo "make docs     the documentation site, mkdocs build --strict into site/"
	@echo "make docs-code  the code blocks of the docs, copied again from the tested files"
	@echo "make docs-screenshots  the admin screenshots of the docs, taken again"
	@echo "make test-mysql  the database tests on MariaDB/MySQL (127.0.0.1:3306)"
	@echo "make test-poolers  the race, crash and fault suites through PgBouncer and Django's pool"
	@echo "make test-pg16  the database tests on a private PostgreSQL 16 (the pgserver wheel)"
	@echo "make test-galera  storms and a node killed on a private 3-node MariaDB Galera cluster"
	@echo "make test-standby  reads routed to a lagging standby, and failovers (sync and async)"
	@echo "make test-tenants  schemas per tenant (django-tenants): records, outbox and commands per tenant"
	@echo "make test-quickstart  the README's quickstart in a new project, with the built wheel"
	@echo "make soak     the soak test (SOAK_SECONDS, default 120) on PostgreSQL"
	@echo "make tox      the tox grid (ENVS=a,b for some environments only)"
	@echo "make tox-pg16 ENVS=a,b  tox envs on a private PostgreSQL 16, beside make tox"
	@echo "make storm    the example project's retry storm, a webhook redelivery and the outbox relay, against a throwaway server"
	@echo "make demo     the storm, then the example project on http://$(DEMO_ADDR)/ and its outbox relay"
	@echo "make bench    benchmarks on PostgreSQL, written to benchmarks/RESULTS.md (BENCH_ARGS=--quick)"
	@echo "make bench-scale  the table at 10k, 1M and 10M records and a purge beside traffic"
	@echo "make clean    remove .venv, .venv-demo, .tox, .tox-pg16, build output and the example database"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(BIN)/uv: | $(BIN)/python
	$(BIN)/python -m pip install --quiet uv

# UV_INSTALL VENV_BIN: install into that venv with its uv, the modules compiled as pip does
# (where PYTHONDONTWRITEBYTECODE is set, nothing else would compile them once).
UV_INSTALL = $(1)/uv pip install --quiet --compile-bytecode --python $(1)/python

$(STAMP): pyproject.toml | $(BIN)/uv
	$(call UV_INSTALL,$(BIN)) -e ".[$(EXTRAS)]" --group dev
	touch $@

$(DEMO_BIN)/python:
	$(PYTHON) -m venv $(DEMO_VENV)

$(DEMO_BIN)/uv: | $(DEMO_BIN)/python
	$(DEMO_BIN)/python -m pip install --quiet uv

$(DEMO_STAMP): pyproject.toml | $(DEMO_BIN)/uv
	$(call UV_INSTALL,$(DEMO_BIN)) -e ".[$(EXTRAS)]" --group demo
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy django_idempotency tests example_project docs/hooks.py
	$(BIN)/yamllint --strict .
	$(BIN)/actionlint -color=false

check-migrations: $(STAMP)
	PYTHONPATH=. $(BIN)/python -m django makemigrations --check --dry-run --settings=tests.settings

# Both databases always run, each under coverage.py (parallel mode: one data file per run,
# combined at the end), the PostgreSQL suite in three parts (tests/halves.py with PARTS=3:
# TEST_SHARD, whole files each; it waits on servers, workers and leases more than it computes),
# and after SQLite, in its lane, the django-tenants suite (tests/test_tenants.py on PostgreSQL
# with tests.tenants.settings: the checks and jobs that read every tenant's schema);
# the summary shows each run's closing pytest line and the coverage of them all together,
# and the target fails if any run failed or the coverage is below the floor of
# pyproject.toml ([tool.coverage.report] fail_under).
test: lint check-migrations
	@mkdir -p $(REPORTS)
	@$(BIN)/coverage erase
	@echo "==> pytest with TEST_DB=sqlite (then the django-tenants suite), and TEST_DB=postgres in"; \
	echo "    three parts (tests/halves.py),"; \
	echo "    side by side, each on databases of its own; output in $(REPORTS)/pytest-*.log;"; \
	echo "    a progress line every 30 s (minutes:seconds, then each run's percentage)"; \
	rm -f $(REPORTS)/pytest-sqlite.log $(REPORTS)/pytest-postgres-*.log \
		$(REPORTS)/pytest-tenants-covered.log; \
	$(BIN)/python -m tests.progress $(REPORTS)/pytest-sqlite.log \
		$(REPORTS)/pytest-postgres-1.log $(REPORTS)/pytest-postgres-2.log \
		$(REPORTS)/pytest-postgres-3.log & progress=$$!; \
	( TEST_DB=sqlite $(BIN)/coverage run -m pytest > $(REPORTS)/pytest-sqlite.log 2>&1; \
	  lane=$$?; \
	  TEST_DB=postgres $(BIN)/coverage run -m pytest --ds=tests.tenants.settings \
		tests/test_tenants.py > $(REPORTS)/pytest-tenants-covered.log 2>&1 || lane=1; \
	  exit $$lane ) & sqlite=$$!; \
	failed=0; \
	PARTS=3 REPORTS=$(REPORTS) TEST_DB=postgres $(BIN)/python -m tests.halves postgres \
		$(BIN)/coverage run -m pytest > /dev/null || failed=1; \
	wait $$sqlite || failed=1; \
	kill $$progress; \
	for run in sqlite postgres-1 postgres-2 postgres-3 tenants-covered; do \
		echo "==> pytest run $$run"; \
		cat $(REPORTS)/pytest-$$run.log; \
	done; \
	$(BIN)/coverage combine -q; \
	echo; \
	echo "==> Coverage of django_idempotency (SQLite and PostgreSQL runs together)"; \
	$(BIN)/coverage report --format=total > $(REPORTS)/coverage-total.txt || failed=1; \
	echo; \
	echo "==> Test summary"; \
	for run in sqlite postgres-1 postgres-2 postgres-3 tenants-covered; do \
		printf '  %-16s %s\n' "$$run:" "$$(tail -n 1 $(REPORTS)/pytest-$$run.log)"; \
	done; \
	printf '  %-16s %s%% of lines and branches (floor: %s%%)\n' "coverage:" \
		"$$(cat $(REPORTS)/coverage-total.txt)" \
		"$$($(BIN)/python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["tool"]["coverage"]["report"]["fail_under"])')"; \
	exit $$failed

# The fast loop: pytest on SQLite, without the tests that start a server or a worker process
# (the marker `servers`: gunicorn, uvicorn, runserver, live servers, Celery workers, relays,
# PgBouncer, a private PostgreSQL), without lint and without coverage: about 140 s of CPU,
# in one pytest-xdist process per core. TEST_QUICK=1: the property-based tests try a quarter
# of their examples
# (tests/helpers.py, examples). No test uses schemathesis's pytest plugin (CI's schemathesis
# step is a command of its own): not loading it saves two seconds in each pytest process,
# this one and the sample shop's runs of tests/test_testing_sample.py. PYTEST_ARGS: more
# arguments (`-x`, `-k name`, test files).
PYTEST_ARGS ?=
# QUICK_WORKERS: pytest-xdist processes (one per core: 2 here); 0 runs in this process.
QUICK_WORKERS ?= 2

test-quick: $(STAMP)
	TEST_DB=sqlite TEST_QUICK=1 PYTEST_ADDOPTS="-p no:schemathesis $(PYTEST_ADDOPTS)" \
		$(BIN)/pytest -q -m "not servers" -n $(QUICK_WORKERS) $(PYTEST_ARGS)

# The coverage report of the last `make test`, with the lines no test reached.
coverage: $(STAMP)
	$(BIN)/coverage report

# The documentation site, built strictly (any warning fails) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The Python blocks of the docs pages written anew from the tested files they copy (each names
# its source in a comment above it; tests/test_docs.py fails while one differs).
docs-code: $(STAMP)
	$(BIN)/python -m tests.docs_code

# The admin screenshots of the docs, taken again by the real-browser test (Debian chromium).
docs-screenshots: $(STAMP)
	DOCS_SCREENSHOTS=1 $(BIN)/pytest tests/test_admin_browser.py

# MariaDB/MySQL: mysqlclient builds against libmariadb-dev (Debian), so it is installed here
# rather than in the dev group.
$(BIN)/.mysqlclient: | $(STAMP)
	$(call UV_INSTALL,$(BIN)) "mysqlclient>=2.2"
	touch $@

# The tests that can reach the test database (TEST_DATABASE_ONLY=1, tests/conftest.py: the
# others show the same on every database, and make test runs them), in two halves side by
# side (tests/halves.py), each on a database of its own.
test-mysql: $(BIN)/.mysqlclient
	REPORTS=$(REPORTS) TEST_DB=mysql TEST_DATABASE_ONLY=1 \
		$(BIN)/python -m tests.halves mysql $(BIN)/pytest

# The suites that race, crash and cut the database, through a connection pooler: PgBouncer in
# transaction mode (Debian's package, installed here when missing and possible; the harness
# starts its own on a free port; prepared statements off, as Django's default) and Django's
# own pool with prepared statements on (TEST_DB_PREPARE=0), the two runs side by side.
POOLER_SUITES := tests/test_poolers.py tests/test_concurrency.py tests/test_crash.py \
	tests/test_faults_crash.py tests/test_faults_database.py tests/test_servers.py \
	tests/test_callers_transaction.py

test-poolers: $(STAMP)
	@command -v pgbouncer >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer; }
	@mkdir -p $(REPORTS)
	@$(BIN)/python -m tests.poolers pgbouncer $(POOLER_SUITES) -p no:cacheprovider \
		> $(REPORTS)/pytest-pgbouncer.log 2>&1 & bouncer=$$!; \
	TEST_DB_PREPARE=0 $(BIN)/python -m tests.poolers postgres-pool $(POOLER_SUITES) -p no:cacheprovider \
		> $(REPORTS)/pytest-postgres-pool.log 2>&1 & pool=$$!; \
	failed=0; wait $$bouncer || failed=1; wait $$pool || failed=1; \
	for run in pgbouncer postgres-pool; do \
		echo "==> pytest with TEST_DB=$$run"; \
		[ $$failed = 0 ] || cat $(REPORTS)/pytest-$$run.log; \
		printf '  %-14s %s\n' "$$run:" "$$(tail -n 1 $(REPORTS)/pytest-$$run.log)"; \
	done; \
	exit $$failed

# The PostgreSQL suite on PostgreSQL 16: the binaries of the pgserver wheel, a private server
# on a free port (tests/poolers.py starts and removes it). The tests that can reach the test
# database, as for MariaDB, in two halves side by side, each with a server of its own, and
# the engine's statements prepared (TEST_DB_PREPARE=0; make test runs them unprepared).
$(BIN)/.pgserver: | $(STAMP)
	$(call UV_INSTALL,$(BIN)) "pgserver>=0.1.4"
	touch $@

test-pg16: $(BIN)/.pgserver
	REPORTS=$(REPORTS) TEST_DATABASE_ONLY=1 TEST_DB_PREPARE=0 $(BIN)/python -m tests.halves pg16 \
		$(BIN)/python -m tests.poolers pg16 -p no:cacheprovider

# The tox envs in ENVS (their postgres ones) on a private PostgreSQL 16, in a tox work dir of
# their own (.tox-pg16), so that they can run beside `make tox`.
tox-pg16: $(BIN)/.pgserver $(BIN)/tox
	$(if $(PYENV_GRID),PYENV_VERSION=$(PYENV_GRID)) $(BIN)/python -m tests.poolers pg16 -- \
		$(BIN)/tox run --workdir .tox-pg16 $(if $(ENVS),-e $(ENVS))

# A three-node MariaDB Galera Cluster of our own (tests/galera.py: Debian's mariadbd and
# galera-4, free ports, a temporary directory), an app server on each node, storms split
# across them, a certification conflict and a node SIGKILLed mid-storm (about a minute).
test-galera: $(BIN)/.mysqlclient
	RUN_GALERA=1 TEST_LOG_REQUEST_ERRORS=1 $(BIN)/pytest tests/test_galera.py -p no:cacheprovider

# A private PostgreSQL 15 primary and a streaming standby of it (pg_basebackup), on free
# ports: reads routed to the standby 2 s behind, and failovers with synchronous and
# asynchronous replication (about a minute).
test-standby: $(STAMP)
	RUN_STANDBY=1 TEST_LOG_REQUEST_ERRORS=1 TEST_DB=postgres $(BIN)/pytest tests/test_standby.py \
		-p no:cacheprovider

# Schemas per tenant with django-tenants, on the PostgreSQL of make test (a database of its
# own per run): two tenants, one key in both, a crash in each, and the purge, the recovery
# and the relay run over every tenant as docs/scaling.md says. Its own settings module
# (tests/tenants/settings.py), which the rest of the suite does not load. Twice, side by
# side: as configured by default, and with the engine's statements prepared
# (TEST_DB_PREPARE=0), whose cursor must set the tenant's search_path too (about 40 s).
test-tenants: $(STAMP)
	@mkdir -p $(REPORTS)
	@TEST_DB=postgres $(BIN)/pytest --ds=tests.tenants.settings tests/test_tenants.py \
		-p no:cacheprovider > $(REPORTS)/pytest-tenants.log 2>&1 & plain=$$!; \
	TEST_DB=postgres TEST_DB_PREPARE=0 $(BIN)/pytest --ds=tests.tenants.settings \
		tests/test_tenants.py -p no:cacheprovider > $(REPORTS)/pytest-tenants-prepared.log 2>&1 \
		& prepared=$$!; \
	failed=0; wait $$plain || failed=1; wait $$prepared || failed=1; \
	for run in tenants tenants-prepared; do \
		echo "==> pytest $$run"; \
		[ $$failed = 0 ] || cat $(REPORTS)/pytest-$$run.log; \
		printf '  %-17s %s\n' "$$run:" "$$(tail -n 1 $(REPORTS)/pytest-$$run.log)"; \
	done; \
	exit $$failed

# The soak test: mixed traffic, purge and recovery for SOAK_SECONDS against a real server.
SOAK_SECONDS ?= 120
soak: $(STAMP)
	RUN_SOAK=1 SOAK_SECONDS=$(SOAK_SECONDS) TEST_DB=postgres $(BIN)/pytest -m soak -s

# The README's quickstart pasted into a new `django-admin startproject`, with the built wheel
# in a venv of its own, on PostgreSQL: its curl sequence and its function views (about 1 min).
test-quickstart: $(STAMP)
	RUN_QUICKSTART=1 $(BIN)/pytest tests/test_quickstart.py -p no:cacheprovider

# tox-uv: the envs are made and filled by uv (seconds each, where pip took minutes in CI).
$(BIN)/tox: | $(STAMP)
	$(call UV_INSTALL,$(BIN)) "tox>=4.22" "tox-uv>=1.11"

# TOX_PARALLEL=N: N envs at a time (tox run-parallel; each env's output shown when it ends).
tox: $(BIN)/tox
	$(if $(PYENV_GRID),PYENV_VERSION=$(PYENV_GRID)) $(BIN)/tox \
		$(if $(TOX_PARALLEL),run-parallel --parallel $(TOX_PARALLEL) --parallel-no-spinner,run) \
		$(if $(ENVS),-e $(ENVS))

# --- the example project ------------------------------------------------------------------

example-db: $(DEMO_STAMP)
ifeq ($(EXAMPLE_DB),postgres)
	@psql -h 127.0.0.1 -U postgres -tAc \
		"SELECT 1 FROM pg_database WHERE datname = '$(EXAMPLE_PGDATABASE)'" | grep -q 1 \
		|| createdb -h 127.0.0.1 -U postgres $(EXAMPLE_PGDATABASE)
endif
	$(DEMO_BIN)/python manage.py makemigrations --check --dry-run -v 0
	$(DEMO_BIN)/python manage.py migrate -v 0
	$(DEMO_BIN)/python manage.py ensure_demo_user --username demo --password demo

# A threaded development server in the background, the storm against it, then a Stripe
# webhook delivered twice (the retry answered from the record); the server is stopped
# whatever the outcome, and the target fails when either step found a problem.
storm: example-db
	@$(DEMO_BIN)/python manage.py runserver --noreload 127.0.0.1:$(STORM_PORT) \
		> $(DEMO_VENV)/storm-server.log 2>&1 & \
	server=$$!; \
	trap 'kill $$server 2>/dev/null || true' EXIT; \
	$(DEMO_BIN)/python -m example_project.demo_storm --url http://127.0.0.1:$(STORM_PORT) \
		--user demo --password demo; \
	$(DEMO_BIN)/python -m example_project.demo_webhook --url http://127.0.0.1:$(STORM_PORT); \
	$(DEMO_BIN)/python -m example_project.demo_steps --url http://127.0.0.1:$(STORM_PORT)
	@echo "==> The storm's receipts, sent from the outbox by the relay (Celery's, and Django's Tasks framework's):"
	@out=$$($(DEMO_BIN)/python manage.py relay_outbox --once); echo "$$out"; \
	[[ "$$(tail -n 1 <<< "$$out")" =~ ^Sent\ [1-9][0-9]*\ .*\ 0\ failed.*\ 0\ dead\.$$ ]] \
		|| { echo "the relay did not send the storm's receipt" >&2; exit 1; }
	@echo "==> The database worker of Django's Tasks framework runs the receipts handed to it:"
	$(DEMO_BIN)/python manage.py db_worker --backend worker --batch --no-reload --no-startup-delay -v 0
	@echo "==> An agent's tool call: a refund over MCP whose answer is lost, retried with its key (MCPServer, then FastMCP):"
	$(DEMO_BIN)/python -m example_project.mcp_agent

demo: storm
	@key=$$($(DEMO_BIN)/python -c 'import uuid; print(uuid.uuid4())'); \
	echo "The example API is starting on http://$(DEMO_ADDR)/ (admin: /admin/, demo/demo)."; \
	echo "Create a charge; run the same line again to get the replay:"; \
	echo; \
	echo "  curl -i -u demo:demo -H 'Content-Type: application/json' \\"; \
	echo "       -H 'Idempotency-Key: $$key' \\"; \
	echo "       -d '{\"amount\": 1000, \"currency\": \"EUR\"}' http://$(DEMO_ADDR)/api/charges/"; \
	echo; \
	echo "The same charges through django-ninja: http://$(DEMO_ADDR)/ninja/charges"; \
	echo "(Swagger UI: http://$(DEMO_ADDR)/ninja/docs; DRF's: http://$(DEMO_ADDR)/api/docs/)."; \
	echo "Deliver a signed Stripe event twice to /webhooks/stripe/ (the retry is replayed):"; \
	echo; \
	echo "  $(DEMO_BIN)/python -m example_project.demo_webhook --url http://$(DEMO_ADDR)"; \
	echo; \
	echo "An agent's refund over MCP (MCPServer and FastMCP), its answer lost and retried with its key (its own uvicorn):"; \
	echo; \
	echo "  $(DEMO_BIN)/python -m example_project.mcp_agent"; \
	echo; \
	echo "The outbox relay and the Tasks framework's database worker run beside the server."; \
	echo
	@$(DEMO_BIN)/python manage.py relay_outbox & \
	relay=$$!; \
	$(DEMO_BIN)/python manage.py db_worker --backend worker --no-reload & \
	worker=$$!; \
	trap 'kill $$relay $$worker 2>/dev/null || true' EXIT; \
	$(DEMO_BIN)/python manage.py runserver $(DEMO_ADDR)

clean:
	rm -rf $(VENV) $(DEMO_VENV) .tox .tox-pg16 build dist site *.egg-info example_project/db.sqlite3*

# --- benchmarks ---------------------------------------------------------------------------

# Every benchmark of benchmarks/ (see its README) on the PostgreSQL at 127.0.0.1, written to
# benchmarks/RESULTS.md: about 10 minutes on 2 cores; BENCH_ARGS=--quick for a smoke run.
# The alternatives go into their own venv, benchmarks/.venv-alternatives. wrk is Debian's,
# installed here when missing and possible; without it a Python load generator stands in.
BENCH_ARGS ?=

.PHONY: bench
bench: $(STAMP)
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get install -y -qq wrk >/dev/null 2>&1; } \
		|| echo "wrk is not installed: benchmarks/loadgen.py generates the load instead"
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

# The records table at 10 thousand, 1 million and 10 million rows, then a purge of the
# largest beside live claims (benchmarks/scale.py): the "Scale" section of RESULTS.md. The
# 10-million fill needs about 10 GB of disk and most of an hour on 2 cores; SCALE_ARGS=
# "--sizes 10000,100000" for a smoke run.
SCALE_ARGS ?= --sizes 10000,1000000,10000000 --purge

.PHONY: bench-scale
bench-scale: $(STAMP)
	nice -n 10 $(BIN)/python -m benchmarks.scale $(SCALE_ARGS) --json $(VENV)/scale.json
