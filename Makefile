# Two commands for a fresh machine (see README):
#   make demo   the main job: examples/train_gpt.py, a rank per GPU (NCCL) where there are 2+, else 2 CPU ranks (gloo)
#   make test   the whole test suite (C++ unit tests + pytest: every tier)
# and, for a developer, one tier of tests/ at a time:
#   make test-unit          pure, single-process tests (seconds)
#   make test-multiprocess  gloo ranks on this machine (the library's behaviour)
#   make test-integration   whole scripts, torchrun jobs, the tools zeroshard plugs into
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
DEV_DEPS := "scikit-build-core>=0.10" "pytest>=7" pytest-timeout hypothesis ninja numpy safetensors matplotlib

SOURCES := $(shell find csrc python -type f -not -name '*.pyc' 2>/dev/null) CMakeLists.txt pyproject.toml

.PHONY: all demo test test-cpp test-py build bench bench-quick bench-deps clean

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

$(VENV)/.built: $(VENV)/.deps $(SOURCES) | sysdeps
	$(PIP) install -q --no-build-isolation --no-deps .
	@touch $@

build: $(VENV)/.built

# The system library the build links: liburing (the offload I/O engine's io_uring queue,
# csrc/io_engine.h). Installed with apt-get where it is missing and make runs as root;
# elsewhere the command to run is printed and make stops.
.PHONY: sysdeps
LIBURING_CHECK := printf '\#include <liburing.h>\nint main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0); }\n' | \
  $(CC) -x c - -o /dev/null -luring 2>/dev/null
sysdeps:
	@$(LIBURING_CHECK) || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing liburing-dev (io_uring, for the offload I/O engine)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q liburing-dev >/dev/null 2>&1 || { \
	      apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q liburing-dev >/dev/null; }; \
	  fi; \
	  $(LIBURING_CHECK) || { \
	    echo "zeroshard needs liburing (io_uring): install it with 'sudo apt-get install liburing-dev' (Debian, Ubuntu) or 'sudo dnf install liburing-devel' (Fedora), then run make again" >&2; \
	    exit 1; }; }

test-cpp: sysdeps
	cmake -S . -B build/core-tests -DZEROSHARD_CORE_TESTS_ONLY=ON -DCMAKE_BUILD_TYPE=Release > /dev/null
	cmake --build build/core-tests -j 2
	cd build/core-tests && ctest --output-on-failure

# the tiers fastest first (and test_compile's graph count before the DeepSpeed and GPT-script
# tests have run in the same pool of gloo ranks: after both, one more graph is counted)
test-py: build
	$(PY) -m pytest tests/unit tests/multiprocess tests/integration

.PHONY: test-unit test-multiprocess test-integration
test-unit: build test-deps
	$(PY) -m pytest tests/unit
test-multiprocess: build test-deps
	$(PY) -m pytest tests/multiprocess
test-integration: build test-deps
	$(PY) -m pytest tests/integration

test: build test-cpp test-py

# DeepSpeed, the test-only peer of tests/*/test_deepspeed_*.py (zeroshard.initialize side by
# side with deepspeed.initialize; never a runtime dependency): pinned, installed without its
# dependency resolution so torch stays the pinned one, then its own dependencies.
TEST_DS := deepspeed==0.19.8
# Lightning, the test-only peer of tests/integration/test_lightning.py (ZeroShardStrategy beside its own
# DDPStrategy): pinned, installed with the pinned torch named so pip keeps it.
TEST_LIGHTNING := lightning==2.6.6
# Hugging Face, the test-only peers of tests/integration/test_hf.py (ZeroShardTrainer beside the Trainer's own
# DDP, the Accelerate recipe beside Accelerate's, TRL's SFTTrainer through the mixin): pinned to
# the range zeroshard.integrations.hf checks at import (peft: LoRA); their wheels (and their dependencies')
# are kept in the wheelhouse with torch's, so a fresh clone installs them offline.
TEST_HF := transformers==5.24.0 accelerate==1.15.0 trl==1.16.0 peft==0.21.2
.PHONY: test-deps
test-py: test-deps
test-deps: $(VENV)/.deps
	@$(PY) -c "import deepspeed" 2>/dev/null || { $(PIP) install -q --no-deps "$(TEST_DS)" && \
	  $(PIP) install -q $(BENCH_DEPS_OF_DS); }
	@$(PY) -c "import lightning" 2>/dev/null || $(PIP) install -q "$(TEST_LIGHTNING)" "$(TORCH_SPEC)"
	@$(PY) -c "import transformers, accelerate, trl, peft" 2>/dev/null || { \
	  $(PIP) install -q --no-index --find-links "$(WHEELHOUSE)" $(TEST_HF) "$(TORCH_SPEC)" 2>/dev/null || { \
	    $(PIP) download -q -d "$(WHEELHOUSE)" --find-links "$(WHEELHOUSE)" $(TEST_HF) "$(TORCH_SPEC)" && \
	    $(PIP) install -q --no-index --find-links "$(WHEELHOUSE)" $(TEST_HF) "$(TORCH_SPEC)"; }; }

# One rank per visible GPU (NCCL) where CUDA sees 2 or more, else two ranks on the
# CPU (gloo): DEMO_RANKS asks torch, when a recipe runs (after `build`). Stages
# 0-2 run briefly for their memory tables, then ZeRO-3 trains with checkpoints
# and the run resumes from the last one as ZeRO-2. The memory picture is
# examples/out/memory_by_stage.png.
DEMO_RANKS = $(shell $(PY) -c "import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; print(n if n >= 2 else 2)")
DEMO = OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(DEMO_RANKS) examples/train_gpt.py

demo: build
	rm -rf examples/out
	for s in 0 1 2; do $(DEMO) --stage $$s --steps 40 || exit 1; done
	$(DEMO) --stage 3 --steps 300 --ckpt-dir examples/out/ckpt --ckpt-every 100
	$(DEMO) --stage 2 --steps 340 --ckpt-dir examples/out/ckpt --resume

# DeepSpeed, a benchmark-only peer (never a runtime dependency): installed without
# its dependency resolution so torch stays the pinned one. It runs on CPU with
# DS_ACCELERATOR=cpu; its CPU Adam op compiles on first use (about two minutes).
BENCH_DEPS := "deepspeed>=0.19,<0.20"
BENCH_DEPS_OF_DS := einops hjson msgpack psutil py-cpuinfo "pydantic>=2" tqdm

bench-deps: $(VENV)/.deps
	@$(PY) -c "import deepspeed" 2>/dev/null || { $(PIP) install -q --no-deps $(BENCH_DEPS) && \
	  $(PIP) install -q $(BENCH_DEPS_OF_DS); }

# The benchmark set (benchmarks/__main__.py's SET: adamw, step, checkpoint, checkpoint
# --paired 9), then the report: plots, docs/benchmarks/index.md and benchmarks/RESULTS.md
# from the JSON in benchmarks/out/. One benchmark: `$(PY) -m benchmarks NAME [options]`
# (`--list` names them). bench-quick runs the set at small sizes into a temporary
# directory: a check that the runner works, not figures.
bench: build bench-deps
	$(PY) -m benchmarks all

bench-quick: build
	$(PY) -m benchmarks all --quick

# The documentation site (mkdocs.yml, docs/) into site/: DOCS_DEPS are installed
# into .venv when missing (or at other versions); --strict fails on any warning.
# ruff: mkdocstrings lays out long signatures with it; `make lint` runs the same one.
RUFF_SPEC := ruff==0.17.6
DOCS_DEPS := mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 \
             mkdocstrings-python==2.0.11 pymdown-extensions==13.1.2 $(RUFF_SPEC)

.PHONY: docs
docs: $(PY)
	@$(PY) -c "import sys, importlib.metadata as m; sys.exit(any(m.version(n) != v for n, v in (a.split('==') for a in sys.argv[1:])))" \
	  $(DOCS_DEPS) 2>/dev/null || $(PIP) install -q $(DOCS_DEPS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The linter: ruff (RUFF_SPEC) over the Python sources, configured in pyproject.toml
# ([tool.ruff]); installed into .venv when missing (or at another version). CI runs it.
LINTED := python tests benchmarks examples

.PHONY: lint
lint: $(PY)
	@$(PY) -c "import sys, importlib.metadata as m; sys.exit(m.version('ruff') != sys.argv[1].split('==')[1])" \
	  $(RUFF_SPEC) 2>/dev/null || $(PIP) install -q $(RUFF_SPEC)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

clean:
	rm -rf build $(VENV)/.built
