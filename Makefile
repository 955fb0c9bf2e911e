# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-bench bench bench-quick bench-startup compat clean soak concurrency

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is installed first, pinned to the CPU build, so the range in pyproject.toml
# never pulls a multi-GB CUDA wheel on CI; on GPU hosts install your CUDA torch first.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The demo always trains from scratch (a re-run of a finished run would resume and train nothing).
demo: $(STAMP)
	rm -rf runs/quickstart
	$(VENV)/bin/raytrain-ddp train examples/configs/quickstart.yaml
	$(VENV)/bin/raytrain-ddp plot runs/quickstart

# Two test processes (pytest-xdist), one file at a time each, the tiers cluster, Ray, local in
# that order (tests/conftest.py). A third
# (TEST_JOBS=3) fills the Ray tier's clock waits and ends sooner idle, but beside one busy
# process per core it failed tests that two pass (docs/design.md#where-the-suites-time-goes).
# TEST_JOBS=0 runs in this process, as a debugger wants. The slowest tests and
# every failure land in CI's log too. A test process that dies ends the run at once
# (--max-worker-restart=0): with file groups, a replacement process was never handed the dead
# one's files and the run waited forever.
# The whole benchmark run (smoke preset) is test-bench's; make test runs each section at toy size.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --max-worker-restart=0 --durations=30 -rfE -m "not bench_smoke" tests

# The fault-sequence soak (not in `make test`): one row per seed, docs/reliability.md#fault-sequences.
SEEDS ?= 0-19
KINDS ?= s3,load,late,node
soak: $(STAMP)
	$(PY) -m benchmarks.soak --seeds $(SEEDS) --kinds $(KINDS)

# Many jobs on one machine (issue #56): 3 fits and a 2-trial sweep at once, ROUNDS times.
ROUNDS ?= 10
concurrency: $(STAMP)
	$(PY) -m benchmarks.concurrency --rounds $(ROUNDS)

# The tier without Ray (tests/local; tests/ray and tests/cluster start Ray), less the bench sections.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15 -m "not bench" tests/local

test-bench: $(STAMP)
	$(PY) -m pytest -q -n 0 -rfE -m bench_smoke tests/local/bench tests/ray/bench

# Not in CI's default path: one venv per torch version (the declared floor first, then the
# newest this project allows), `test-fast` in each; then one venv per Ray version (floor,
# ceiling; with the floor torch), the Ray tier's compatibility subset in each. Others:
#   make compat COMPAT_TORCH="2.8.0 2.15.0"   (widen pyproject's range first; CUDA wheels are GBs)
#   make compat COMPAT_TORCH= COMPAT_RAY="2.60.0"   (only Ray versions; torch 2.11.0)
# PIP_CONFIG_FILE=/dev/null: the torch venvs ignore pip's configuration files (a machine's
# constraints file may cap torch below the versions named here); the system file stays.
COMPAT_TORCH ?= 2.11.0 2.15.0
COMPAT_RAY   ?= 2.59.0 2.60.0
COMPAT_RAY_TESTS ?= tests/local/unit/test_ray_compat.py tests/ray/unit/test_ray_compat_live.py tests/local/unit/test_fault_pieces.py tests/local/unit/test_node_loss.py \
  tests/ray/e2e/test_train.py tests/ray/e2e/test_interrupt.py tests/ray/elastic/test_replica_recovery.py \
  tests/ray/reliability/test_network_exposure.py
compat:
	@set -e; for v in $(COMPAT_TORCH); do \
	  venv=.venv-torch-$$v; echo "== torch $$v in $$venv"; \
	  [ -x $$venv/bin/python ] || $(PYTHON) -m venv $$venv; \
	  PIP_CONFIG_FILE=/dev/null $$venv/bin/python -m pip install -q "torch==$$v"; \
	  PIP_CONFIG_FILE=/dev/null $$venv/bin/python -m pip install -q -e ".[dev]" "torch==$$v"; \
	  $$venv/bin/python -c "import torch; print('torch', torch.__version__)"; \
	  $$venv/bin/python -m pytest -q -n $(TEST_JOBS) --dist loadfile tests/local; \
	done; \
	torch=$(firstword $(COMPAT_TORCH) 2.11.0); \
	for v in $(COMPAT_RAY); do \
	  venv=.venv-ray-$$v; echo "== ray $$v (torch $$torch) in $$venv"; \
	  [ -x $$venv/bin/python ] || $(PYTHON) -m venv $$venv; \
	  $$venv/bin/python -m pip install -q "torch==$$torch"; \
	  $$venv/bin/python -m pip install -q -e ".[dev]" "ray[default,train,data]==$$v" "torch==$$torch"; \
	  $$venv/bin/python -c "import ray; print('ray', ray.__version__)"; \
	  $$venv/bin/python -m pytest -q $(COMPAT_RAY_TESTS); \
	done

# Each run is published as benchmarks/results/<preset>-<date>.{json,md,png}: the docs cite it.
bench: $(STAMP)
	$(VENV)/bin/raytrain-ddp bench

bench-quick: $(STAMP)
	$(VENV)/bin/raytrain-ddp bench --quick

bench-startup: $(STAMP)
	$(PY) -m benchmarks.startup

clean:
	rm -rf $(VENV) .venv-torch-* .venv-ray-* runs build *.egg-info
