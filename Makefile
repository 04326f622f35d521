# The two set-up commands: `make demo` (the embedded demo) and `make test` (the whole suite
# on real Kafka and MinIO). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
INFRA_ENV := $(CURDIR)/.infra.env

.PHONY: test lint demo venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

# Lints and type-checks (ruff, mypy: configured in pyproject.toml), then starts real Kafka
# and MinIO (fetched and built into ~/.cache/hadar on first use), runs every test against
# them, and stops them whatever the outcome. It ends with the 25 slowest tests, to keep the
# suite well inside 30 minutes.
test: $(STAMP) lint
	@set -e; \
	$(BIN)/hadar infra up --env-file $(INFRA_ENV) >/dev/null; \
	trap '$(BIN)/hadar infra down' EXIT; \
	set -a; . $(INFRA_ENV); set +a; \
	$(BIN)/python -m pytest -p no:cacheprovider --durations=25 tests

lint: $(STAMP)
	$(BIN)/ruff check
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/hadar demo --out demo-out

clean:
	rm -rf $(VENV) demo-out sim-out .infra.env
