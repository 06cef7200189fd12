# `make run`: install into .venv and run the demo (two nights captured -> ingest -> top launch call sites -> report).
# `make test`: install and run the whole suite on every CPython 3.10-3.13 found.
PYTHON ?= python3
VENV ?= .venv
# Extra interpreters for the test matrix; pyenv's are found by version.
MATRIX_VERSIONS ?= 3.10 3.12 3.13
# Those of them that also run the Spark tests (with PySpark installed). None by default: the Spark
# lake's tests run on the default interpreter, and on every version they would cost a JVM's minute
# or more each, past CI's 20 minutes; `make test-matrix MATRIX_SPARK_VERSIONS="3.12 3.13"` adds them.
MATRIX_SPARK_VERSIONS ?=
# The package's extras a venv gets.
EXTRAS ?= test,spark,mutate
PIP_FLAGS ?= -q --disable-pip-version-check

NATIVE_SOURCES := $(wildcard native/*.cpp native/*.h native/testing/*.cpp native/torch_observer/*.cpp) CMakeLists.txt pyproject.toml

.PHONY: install run test lint format test-default test-matrix bench mutate mutate-native clean

# C/C++ sources under clang-format (test fixtures whose line numbers the oracles read stay as written).
CLANG_FORMAT_SOURCES := $(wildcard native/*.cpp native/*.h native/testing/*.cpp native/torch_observer/*.cpp tests/cupti_double/*.c)

install: $(VENV)/.installed

$(VENV)/.installed: $(NATIVE_SOURCES)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	# The development install also builds tbpipe._native_test, the suite's extension; a plain
	# `pip install .` (the wheel users get) leaves it out.
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[$(EXTRAS)]' --config-settings=cmake.define.TBPIPE_BUILD_TESTING=ON
	# torch (a local CPU wheel, for 3.11 only here) is the anchor some tests compare
	# against and the torch-ops source's subject; Triton's launch hooks are tested
	# against the real package.
	if $(VENV)/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
		$(VENV)/bin/pip install $(PIP_FLAGS) torch==2.13.0 triton==3.9.0; fi
	# The torch-ops source's RecordFunction observer, compiled against that torch now rather than
	# on its first use (into $$TBPIPE_CACHE_DIR or ~/.cache/tbpipe); without it the source falls
	# back to its slower dispatch mode.
	if $(VENV)/bin/python -c 'import torch' 2>/dev/null; then \
		$(VENV)/bin/python -m tbpipe.capture.torch_observer build; fi
	touch $@

run: install
	$(VENV)/bin/tbpipe demo --out demo-runs

test: lint test-default test-matrix

# Style as configured in pyproject.toml (ruff) and .clang-format; `make format` applies it.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CLANG_FORMAT_SOURCES)

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CLANG_FORMAT_SOURCES)

# The suite runs in a random order (modules shuffled, and the tests within each), so a test that
# leans on another's leftovers fails sooner or later; TEST_SEED=N repeats the order of a run.
ifndef TEST_SEED
TEST_SEED := $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
endif

# Two workers (pytest-xdist), each taking whole test files, so a module's fixtures are built once;
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
TEST_SELECTION ?=

test-default: install
	@echo "test order seed $(TEST_SEED) (make test TEST_SEED=$(TEST_SEED) repeats it)"
	$(VENV)/bin/python -m pytest -q -p random_order --random-order-seed=$(TEST_SEED) \
		-n $(TEST_WORKERS) --dist loadfile $(TEST_SELECTION) tests

# The same suite on the other supported CPython versions, each in its own venv, less the tests
# marked default_interpreter_only: the Spark lake's slower cases, whose work is the JVM's, and the
# pages, reports and exports checked in Chromium or by Go's pprof (the same files on every version).
# The Spark tests left (one Spark ingest against the DuckDB one: the lake's steps in Spark's Python
# workers) run on MATRIX_SPARK_VERSIONS only; the other versions get no PySpark.
test-matrix:
	@for version in $(MATRIX_VERSIONS); do \
		interpreter=$$(ls -d $$HOME/.pyenv/versions/$$version.*/bin/python 2>/dev/null | tail -n 1); \
		if [ -z "$$interpreter" ]; then interpreter=$$(command -v python$$version); fi; \
		if [ -z "$$interpreter" ]; then echo "CPython $$version not found: install it (pyenv install $$version)"; exit 1; fi; \
		case " $(MATRIX_SPARK_VERSIONS) " in \
			*" $$version "*) extras=test,spark; selection="not default_interpreter_only";; \
			*) extras=test; selection="not default_interpreter_only and not spark";; \
		esac; \
		$(MAKE) --no-print-directory test-default PYTHON=$$interpreter VENV=.venv-$$version EXTRAS=$$extras \
			TEST_SELECTION="-m '$$selection'" || exit 1; \
	done

# Mutation testing (docs/testing.md), not part of `make test`: each group of modules in
# tests/mutation/groups.toml gets MUTATE_BUDGET minutes; MUTATE_GROUPS picks groups (all by default).
MUTATE_BUDGET ?= 10
MUTATE_GROUPS ?=
MUTATE_FLAGS ?=

mutate: install
	$(VENV)/bin/python tests/mutation/mutate.py --budget $(MUTATE_BUDGET) $(MUTATE_FLAGS) $(MUTATE_GROUPS)

# The extension's rules (docs/testing.md): the hand-planted mutants of native/ listed in
# tests/mutation/native_mutants.toml, each built into build/mutate/native and run against its tests,
# within MUTATE_NATIVE_BUDGET minutes in all; MUTATE_NATIVE_MUTANTS picks mutants by name.
MUTATE_NATIVE_BUDGET ?= 40
MUTATE_NATIVE_MUTANTS ?=

mutate-native: install
	$(VENV)/bin/python tests/mutation/native.py --budget $(MUTATE_NATIVE_BUDGET) $(MUTATE_NATIVE_MUTANTS)

bench: install
	$(VENV)/bin/python bench/capture.py
	$(VENV)/bin/python bench/symbolize.py
	$(VENV)/bin/python bench/ingest.py
	$(VENV)/bin/python bench/report.py
	$(VENV)/bin/python bench/serve.py
	$(VENV)/bin/python bench/history.py
	$(VENV)/bin/python bench/export.py
	$(VENV)/bin/python bench/torch_overhead.py
	$(VENV)/bin/python bench/compile_overhead.py
	$(VENV)/bin/python bench/gpu_activity.py

clean:
	rm -rf build .venv .venv-* demo-runs
