# Developer workspace for keras.layers.LinearAttention (see README.md).
# The two commands: `make test` and `make demo`. Both set everything up.

SHELL := /bin/bash
# pipefail: `git ls-files | xargs ruff` must fail when git does, not lint
# nothing and pass.
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
BACKENDS ?= tensorflow jax torch numpy openvino
# The benchmark compares the training backends.
BENCH_BACKENDS ?= tensorflow jax torch
# The test runs of the backends go one per CPU core at a time (JOBS=N sets
# how many); SERIAL=1 runs them one after the other (see tools/run_tests.sh).
SERIAL ?= 0
# restore-upstream needs no venv: any Python >= 3.11 runs the tool.
TOOL_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

.DEFAULT_GOAL := test
.PHONY: setup lint format test test-tools demo bench bench-recall bench-lm \
	wheel clean \
	distclean restore-upstream pr-check

# The venv is rebuilt only when requirements.txt changes; the upstream tree
# and the API exports are checked on every run (about a second).
setup: $(STAMP)
	@$(PY) tools/venv_link.py
	@$(PY) tools/upstream.py sync

$(STAMP): requirements.txt
	@test -x $(PY) || { \
	  $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and \
	    "Python >= 3.11 is needed: make PYTHON=python3.11 ...")' && \
	  $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q -r requirements.txt
	@# pip brings PyPI's keras back with tensorflow: out again, before lint.
	@$(PY) tools/venv_link.py
	@touch $@

# Lint only the project's own files: the ones tracked in git.
lint: $(STAMP)
	git ls-files -z '*.py' | xargs -0 -r $(VENV)/bin/ruff check
	git ls-files -z '*.py' | xargs -0 -r $(VENV)/bin/ruff format --check

format: $(STAMP)
	git ls-files -z '*.py' | xargs -0 -r $(VENV)/bin/ruff check --fix
	git ls-files -z '*.py' | xargs -0 -r $(VENV)/bin/ruff format

test: setup lint
	@BACKENDS="$(BACKENDS)" SERIAL="$(SERIAL)" PY=$(PY) tools/run_tests.sh

test-tools: setup
	$(PY) -m pytest tools/tests

demo: setup
	$(PY) examples/linear_attention_demo.py
	$(PY) examples/linear_attention_hybrid_demo.py

# All three backends, one after the other (each in its own process), then
# the targets table of all three. `make bench BENCH_ARGS=--quick` takes
# under two minutes per backend (one run of the script; PyTorch, the
# slowest, took 66 s on a quiet machine).
bench: setup
	@for backend in $(BENCH_BACKENDS); do \
	  KERAS_BACKEND=$$backend $(PY) benchmarks/linear_attention_benchmark.py \
	    $(BENCH_ARGS) || exit 1; \
	done
	$(PY) benchmarks/linear_attention_benchmark.py --summary

# Associative recall (MQAR) of every LinearAttention configuration against
# MultiHeadAttention, on one backend; `make bench-recall RECALL_ARGS=--quick`
# is a smoke run (see benchmarks/README.md, "Recall benchmark").
RECALL_BACKEND ?= jax
bench-recall: setup
	KERAS_BACKEND=$(RECALL_BACKEND) $(PY) benchmarks/linear_attention_recall.py \
	  $(RECALL_ARGS)

# Byte-level language modelling on packed documents (the standard library's
# .py files by default), every configuration against MultiHeadAttention, on
# one backend; a full run takes hours (`LM_ARGS=--resume` picks up an
# interrupted one), `make bench-lm LM_ARGS=--quick` is a smoke run (see
# benchmarks/README.md, "Language-model benchmark").
LM_BACKEND ?= jax
bench-lm: setup
	KERAS_BACKEND=$(LM_BACKEND) $(PY) benchmarks/linear_attention_lm.py \
	  $(LM_ARGS)

# The contribution as a pull request: copied into a scratch copy of a
# keras-team/keras checkout (or `git archive` tarball), checked with its
# api_gen.py, ruff settings and pytest on all five backends.
KERAS_REPO ?= ../shared/upstream/keras-master.tar
pr-check: setup
	$(PY) tools/pr_check.py $(KERAS_REPO)

wheel: setup
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .
	@ls -1 dist/*.whl

restore-upstream:
	$(TOOL_PY) tools/upstream.py restore

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache benchmarks/results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune \
	  -exec rm -rf {} +

# Also remove the laid upstream files and the venv.
distclean: clean
	$(TOOL_PY) tools/upstream.py clean
	rm -rf $(VENV)
