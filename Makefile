# Every target sets up what it needs: .venv is created and the project installed on first use,
# and skipped when pyproject.toml has not changed since.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dstl-ray demo

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit

# every experiment writes experiments/results/NAME.json and NAME.png; BENCH_ARGS=--quick
# for a CI-sized run
EXPERIMENTS ?= append_throughput file_flood tree_scale_sim trace_path

bench: $(STAMP)
	for e in $(EXPERIMENTS); do $(BIN)/python -m experiments.$$e $(BENCH_ARGS) || exit 1; done

lint: $(STAMP)
	$(BIN)/python -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis demo-data
