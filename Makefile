# Two commands for a fresh machine (see README):
#   make demo   the main job (for now: the fused AdamW benchmark table)
#   make test   the whole test suite (C++ unit tests + pytest)
# Both create/refresh .venv, install torch if it is missing (pip keeps the
# wheel in its cache, so a fresh clone does not download it again), build the
# extension when its sources changed, and can be run again at any time.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Pinned so a fresh clone reuses the cached wheels; override to change it.
TORCH_SPEC ?= torch==2.15.0
# torch and its CUDA libraries are several GB. They are downloaded once into
# this wheelhouse (outside the clone) and installed from it offline after
# that, so a fresh clone does not download them again. (pip's own HTTP cache
# is not relied on: index responses that forbid caching leave it empty.)
WHEELHOUSE ?= $(HOME)/.cache/zeroshard/wheels
DEV_DEPS := "scikit-build-core>=0.10" "pytest>=7" pytest-timeout hypothesis ninja numpy safetensors

SOURCES := $(shell find csrc python -type f -not -name '*.pyc' 2>/dev/null) CMakeLists.txt pyproject.toml

.PHONY: all demo test test-cpp test-py build bench clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: $(PY) Makefile
	@$(PY) -c "import torch" 2>/dev/null || { \
	  $(PIP) install -q --no-index --find-links "$(WHEELHOUSE)" "$(TORCH_SPEC)" 2>/dev/null || { \
	    echo "downloading $(TORCH_SPEC) into $(WHEELHOUSE) (once)"; \
	    $(PIP) download -q -d "$(WHEELHOUSE)" --find-links "$(WHEELHOUSE)" "$(TORCH_SPEC)" && \
	    $(PIP) install -q --no-index --find-links "$(WHEELHOUSE)" "$(TORCH_SPEC)"; }; }
	$(PIP) install -q $(DEV_DEPS)
	@touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps .
	@touch $@

build: $(VENV)/.built

test-cpp:
	cmake -S . -B build/core-tests -DZEROSHARD_CORE_TESTS_ONLY=ON -DCMAKE_BUILD_TYPE=Release > /dev/null
	cmake --build build/core-tests -j 2
	cd build/core-tests && ctest --output-on-failure

test-py: build
	$(PY) -m pytest tests

test: build test-cpp test-py

demo: build
	$(PY) benchmarks/adamw.py --quick

bench: build
	$(PY) benchmarks/adamw.py
	$(PY) benchmarks/step.py
	$(PY) benchmarks/checkpoint.py

clean:
	rm -rf build $(VENV)/.built
