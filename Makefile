# Meridian developer and CI entry points. `make test` is what CI runs (through .ci/run).
#
#   make setup   system packages (etcd, BIND9) if missing, .venv with the project and dev tools
#   make lint    ruff, ruff format --check, mypy --strict, import-linter layer contracts
#   make test    setup, lint, then pytest
#   make demo    the local demo (simulator.demo)
#   make bench   every benchmarks/*.py script (not _helpers.py)
#   make clean   caches and build output; `make distclean` also removes .venv

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# One binary from each system package the test fixtures need: etcd (etcd-server), named
# (bind9), named-checkconf (bind9-utils). Tests speak DNS through dnspython, so dig and
# nsupdate (bind9-dnsutils) are not needed.
SYSTEM_BINARIES := etcd named named-checkconf
SYSTEM_PACKAGES := etcd-server bind9 bind9-utils
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-deps lint test demo bench clean distclean

setup: system-deps $(STAMP)

system-deps:
	@missing=""; \
	for bin in $(SYSTEM_BINARIES); do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v "$$bin" >/dev/null || missing="$$missing $$bin"; \
	done; \
	packages=""; \
	[ -z "$$missing" ] || packages="$(SYSTEM_PACKAGES)"; \
	$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || [ -x "$(PY)" ] || packages="$${packages:+$$packages }python3-venv"; \
	if [ -n "$$packages" ]; then \
	  echo "setup: installing $$packages (missing binaries:$${missing:- none})"; \
	  $(SUDO) apt-get update; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $$packages; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when pyproject.toml changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[dev]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: setup lint
	$(PY) -m pytest -q

demo: setup
	$(PY) -m simulator.demo

bench: setup
	$(PY) -m pip install -q -e '.[dev,bench]'
	@for script in benchmarks/*.py; do \
	  [ -e "$$script" ] || continue; \
	  case "$${script##*/}" in _*) continue;; esac; \
	  echo "== $$script"; \
	  $(PY) "$$script"; \
	done

clean:
	rm -rf .mypy_cache .ruff_cache .pytest_cache .hypothesis .import_linter_cache build dist
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) *.egg-info
