# The two commands of the README, and what they need. Everything installs into ./.venv.
VENV ?= .venv
PY := $(VENV)/bin/python
APT_PACKAGES := openmpi-bin libopenmpi-dev shellcheck prometheus chromium

.PHONY: install system-deps swift-envs rehearsal rehearsal-stage test test-quick kuberay docs

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch for this machine; on GPU machines the image's torch is used instead.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# OpenMPI (MPI-through-Ray tests), shellcheck (launcher tests), Prometheus (`a4ray local up`'s metrics) and
# Chromium (the dashboard tests, headless) come from Debian's packages.
system-deps:
	@missing=""; for tool in mpirun shellcheck prometheus chromium; do command -v $$tool >/dev/null || missing="yes"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then (apt-get install -y -q $(APT_PACKAGES) || (apt-get update -q && apt-get install -y -q $(APT_PACKAGES))) >/dev/null; \
	  else echo "install as root: apt-get install -y $(APT_PACKAGES)"; exit 1; fi; fi

# The main job, rehearsed on an embedded local Ray cluster of simulated A4 nodes (jobs/qwen3_next_local.yaml):
# stage the tiny stand-ins, convert natively (verified), preflight, train with the Megatron trainer on 2 nodes
# from the converted checkpoint; then the A4 commands. Run it again: every step is cached.
rehearsal: install
	$(PY) -m a4ray.qwen3_next

# Only the stage step of the rehearsal: make the stand-ins and stage them (run it again: all cached).
rehearsal-stage: install
	$(VENV)/bin/a4ray standins
	$(VENV)/bin/a4ray stage -f jobs/qwen3_next_local.yaml

# ms-swift at the versions a4ray supports, each in its own venv (.venv-swift/<version>), installed once: the
# tests parse a4ray's swift commands with ms-swift's own argument classes (tests/test_swift_contract.py).
SWIFT_VERSIONS := $(patsubst tests/swift_envs/ms-swift-%.txt,%,$(wildcard tests/swift_envs/ms-swift-*.txt))
swift-envs:
	@for v in $(SWIFT_VERSIONS); do bash tests/swift_envs/install.sh $$v || exit 1; done

# Two pytest-xdist workers, whole modules each, the longest first (tests/conftest.py): one leaves a core idle while
# its test waits on Ray or a subprocess; two keep both busy (1.9 cores on average over a whole run, measured
# 2026-11-28). PYTEST_WORKERS= runs it in one process.
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

# The one-time installs are timed apart from the suite (pytest's own time is what must stay under 12 minutes).
# a4ray's own modules are compiled once, before: where PYTHONDONTWRITEBYTECODE is set (this sandbox, CI), no process
# writes them, and each of the suite's hundreds of drivers, node actors and launchers compiled what it imported
# (0.2 CPU-s a process; pip compiled the installed packages already).
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory system-deps install swift-envs || exit 1; \
	echo "make test: one-time installs (system-deps, install, swift-envs) took $$(( $$(date +%s) - start ))s"
	$(PY) -m compileall -q a4ray
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_WORKERS)  # the venv's `ray` CLI too, as in an activated venv

# The inner loop: the unit, spec, contract, parser and render tests, no Ray cluster (under 3 minutes on 2 cores). It
# fails where a test it runs starts a Ray cluster (tests/suite_guard.py): such a test is marked slow.
test-quick:
	@$(MAKE) --no-print-directory system-deps install swift-envs
	$(PY) -m compileall -q a4ray
	A4RAY_TEST_NO_CLUSTERS=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_WORKERS) -m "not slow"

# The rendered KubeRay manifests in kuberay/ (see kuberay/manifests.txt); a test keeps them current.
kuberay: install
	grep -v '^#' kuberay/manifests.txt | while IFS= read -r line; do \
	  file=$${line%%:*}; args=$${line#*: }; what=$${args%% *}; rest=$${args#* }; \
	  eval "$(PY) -m a4ray.cli render $$what -o kuberay/$$file $$rest" || exit 1; done

# The docs site: the reference pages regenerated from the code (docs/gen_reference.py), then the site built into
# site/, strictly (a broken link fails it; tests/test_docs.py holds both). `$(VENV)/bin/mkdocs serve` shows it live.
docs: install
	$(PY) docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
