# The README's commands. Everything lives in .venv; each target sets it up first and a second
# run only re-installs when pyproject.toml, the sidebar's sources or TORCH changed.
#   make lab    JupyterLab on notebooks/, bound to 127.0.0.1
#   make test   lint + the whole test suite
#   make bench  the benchmarks in benchmarks/
# TORCH picks the torch build: the default is the CPU wheel this machine has on disk. For ROCm:
#   make lab TORCH="torch --index-url https://download.pytorch.org/whl/rocm6.4"
PYTHON ?= python3
TORCH ?= torch==2.13.0
# Triton, where the torch build brought none (the CPU build): CUDA builds depend on it and ROCm
# builds ship it as pytorch-triton-rocm, which a second install would overwrite. The same
# requirement as pyproject.toml's `kernels` extra.
TRITON := triton>=3.1; platform_system == 'Linux'
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.monarch-installed
# What the install depends on: the torch build, the project file and the sidebar's sources.
WANT = $(TORCH) | $(shell cat pyproject.toml extension/package.json \
	$$(find extension/src extension/style extension/schema -type f | sort) | cksum)

.PHONY: setup lab test lint bench browser slurm clean

setup:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$$(cat $(STAMP) 2>/dev/null)" != "$(WANT)" ]; then \
		set -e; \
		$(PY) -m pip install -q -U pip; \
		$(PY) -m pip install -q $(TORCH); \
		$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q "$(TRITON)"; \
		$(PY) -m pip install -q -e '.[dev]'; \
		echo "$(WANT)" > $(STAMP); \
	fi

lab: setup
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=notebooks \
		$(if $(filter 0,$(shell id -u)),--allow-root)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd extension && npx tsc --noEmit

# The browser tests drive Debian's Chromium (never a downloaded browser).
browser:
	@test -x /usr/bin/chromium || (apt-get update -q && apt-get install -y -q chromium)

# The Slurm test starts Debian's slurmctld, slurmd and munged itself (tests/_slurm.py).
slurm:
	@test -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmd -a -x /usr/sbin/munged || \
		(apt-get update -q && apt-get install -y -q slurm-wlm munge)

# Two pytest processes (pytest-xdist), a test file each at a time: most tests wait on workers,
# kernels and the browser rather than compute. Then, alone, the tests that add links to this
# machine's network (a browser beside them sees the network change and drops its requests).
test: lint browser slurm
	$(PY) -m pytest -n 2 --dist loadfile -m "not netns"
	$(PY) -m pytest -m netns

bench: setup
	@$(PY) -c "import ipyparallel, monarch.actor" 2>/dev/null || $(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) benchmarks/bench_dispatch.py --workers 2 4 --cells 200
	$(PY) benchmarks/bench_actors.py
	$(PY) benchmarks/bench_training.py
	$(PY) benchmarks/bench_parallel.py
	$(PY) benchmarks/bench_telemetry.py
	$(PY) benchmarks/bench_stacks.py
	$(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_sync.py
	$(PY) benchmarks/bench_ranks.py
	$(PY) benchmarks/bench_fanout.py --real 4 64
	$(PY) benchmarks/controller_path.py
	$(PY) -m monarch_kernels.bench

clean:
	rm -rf $(VENV)
