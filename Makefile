# Two commands are the contract: `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The server's address: MMSERVE_HOST / MMSERVE_PORT from the environment (as `mmserve serve` reads
# them), or on the command line (`make run MMSERVE_PORT=50052`); ARGS go to `mmserve serve` as flags.
MMSERVE_HOST ?= 127.0.0.1
MMSERVE_PORT ?= 50051
ARGS   ?=
# `make run` drafts with the demo model's trained assistant (speculative decoding, docs/benchmarks.md)
# unless MMSERVE_SPECULATIVE_MODEL says otherwise: empty (`make run MMSERVE_SPECULATIVE_MODEL=`) serves
# without; another model (MMSERVE_MODEL set, or --model in ARGS) gets none by default, as the demo
# assistant fits only the demo model.
ifeq ($(strip $(MMSERVE_MODEL))$(findstring --model,$(ARGS)),)
MMSERVE_SPECULATIVE_MODEL ?= src/mmserve/demo_assistant
endif
PYTEST_ARGS ?=
# pytest-xdist workers: the suite spends much of its time waiting on servers and subprocesses, so
# two workers on two cores take ~0.6x the serial time; TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: setup run test demo proto lint bench clean

setup: $(STAMP)

# torch first, then the package itself, editable, with the dev tools; one progress line per step (the
# whole takes minutes). Re-runs only when pyproject.toml changes. torch: pip takes a CPU-only 2.13.0 wheel
# where it finds one (this project's machines keep it on disk); elsewhere PyPI's default build, which on
# Linux is the large CUDA one. TORCH_INDEX_URL=<an index of CPU-only wheels> makes pip take torch from
# there (README.md, "Setup").
TORCH_INDEX_URL ?=
$(STAMP): pyproject.toml
	@echo "setup 1/4: virtual environment $(VENV)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setup 2/4: pip"
	@$(BIN)/pip install --quiet --upgrade pip
	@echo "setup 3/4: torch 2.13.0$(if $(TORCH_INDEX_URL), from $(TORCH_INDEX_URL), (a CPU-only wheel if pip finds one; else PyPI's default build: large))"
	@$(BIN)/pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	@echo "setup 4/4: mmserve and its dev tools (editable: pip install -e '.[dev]')"
	@$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)
	@echo "setup done: $(BIN)/mmserve"

run: setup
	$(BIN)/mmserve serve --host $(MMSERVE_HOST) --port $(MMSERVE_PORT) --speculative-model '$(MMSERVE_SPECULATIVE_MODEL)' $(ARGS)

# The FA4 compile check needs the kernels' packages (~1 GB with triton). For a newcomer a failed
# install only makes that check skip with its reason; CI (.ci/run sets MMSERVE_REQUIRE_FA4_CHECK=1)
# fails instead, and the test run then also fails unless the compile tests ran and passed.
$(VENV)/.fa4-check: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,fa4-check]' || { \
	  if [ "$$MMSERVE_REQUIRE_FA4_CHECK" = 1 ]; then echo "FA4 packages did not install (MMSERVE_REQUIRE_FA4_CHECK=1)"; exit 1; fi; \
	  echo "FA4 packages unavailable: its compile check will skip"; }
	touch $@

test: setup $(VENV)/.fa4-check prometheus-for-tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: setup
	$(BIN)/mmserve demo --server $(MMSERVE_HOST):$(MMSERVE_PORT)

proto: setup
	$(BIN)/python -m mmserve.protogen

lint: setup
	$(BIN)/ruff check src tests bench scripts

bench: setup
	$(BIN)/python bench/run_all.py

.PHONY: setup-prometheus prometheus prometheus-for-tests
METRICS_PORT    ?= 9464
PROMETHEUS_PORT ?= 9095

# Debian's prometheus + promtool: the dashboard/alert tests need them (they skip without, except under CI,
# where `make test` must install them through this target) and `make prometheus` runs them. Not root:
# `sudo -n`, which fails instead of asking for a password, so `make test` never stops at a prompt.
setup-prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then exit 0; fi; \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends prometheus

# `make test` tries the install too; for a newcomer without root a failed install only makes those tests
# skip with the command to run; under CI (CI set) it fails.
prometheus-for-tests:
	@$(MAKE) --no-print-directory setup-prometheus || { \
	  if [ -n "$$CI" ]; then echo "prometheus did not install (CI set)"; exit 1; fi; \
	  echo "prometheus unavailable: the real-Prometheus tests will skip"; }

# A Prometheus on 127.0.0.1:$(PROMETHEUS_PORT) scraping a server started with MMSERVE_METRICS_PORT=$(METRICS_PORT),
# with the alert rules loaded; prints the dashboard's queries as links into its UI (docs/operations.md).
prometheus: setup setup-prometheus
	$(BIN)/python scripts/local_prometheus.py --target $(MMSERVE_HOST):$(METRICS_PORT) --port $(PROMETHEUS_PORT)

# The packages a lent GPU machine lacks, as parts under 48 MiB for the lease's calls (scripts/gpu_lease/,
# docs/benchmarks.md): ~157 MB of wheels downloaded once into .gpu_bundle/ (git-ignored).
.PHONY: gpu-bundle
gpu-bundle: setup
	$(BIN)/python scripts/gpu_lease/bundle.py --out .gpu_bundle

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
