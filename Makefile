# Every target sets up what it needs: .venv is created and the project installed on first use,
# and skipped when pyproject.toml has not changed since.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
UNIT_WORKERS ?= 2

.PHONY: setup demo test test-runs test-fast bench compare lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dstl-ray demo

# the unit tier on two worker processes (pytest-xdist: pure-Python work, no cluster up yet),
# then the tiers that share one Ray cluster and one Spark session, in one process
test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest tests/unit -n $(UNIT_WORKERS)
	$(BIN)/python -m pytest tests --ignore=tests/unit --ignore=tests/runs

# the experiments in CI size, each with a cluster of its own (quick chaos runs, the demo, the
# Flink comparison's dstl-ray side), checked by tests/runs; CI runs it after make test
test-runs: $(STAMP)
	$(BIN)/python -m pytest tests/runs

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -n $(UNIT_WORKERS)

# every experiment writes experiments/results/NAME.json and NAME.png; BENCH_ARGS=--quick
# for a CI-sized run
EXPERIMENTS ?= append_throughput file_flood tree_scale_sim trace_path file_merging large_state lifecycle

bench: $(STAMP)
	for e in $(EXPERIMENTS); do $(BIN)/python -m experiments.$$e $(BENCH_ARGS) || exit 1; done

# dstl-ray vs Flink 2.3's changelog backend at 1/2/4 nodes (Flink runs from its own venv,
# FLINK_VENV, created on first use)
compare: $(STAMP)
	$(BIN)/python -m experiments.vs_flink $(BENCH_ARGS)

lint: $(STAMP)
	$(BIN)/python -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis demo-data
