#!/usr/bin/env bash
# The Python packages a GPU machine's image lacks or holds in other versions, as wheels
# in .whl (git-ignored through .git/info/exclude) for gpu_run.sh, which installs them
# apart and puts them first on the path. Run here, where PyPI is reachable, before the
# device call, and name .whl in its carry list (about 20 MB).
#   bash benchmarks/gpu_wheels.sh          # then: device run ... carry [".whl"]
# The set: the integrations' pinned test dependencies (Makefile's TEST_HF and TEST_DS)
# and what they need beyond the image (a Python 3.12 image with transformers 5.17,
# accelerate 1.15, lightning 2.6.6, no datasets, deepspeed or pydantic; 2026-11-26).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
mkdir -p .whl
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d .whl \
  transformers==5.24.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
  hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
# DeepSpeed is published as source only: its pure-Python wheel (no ops built ahead; it
# compiles what it needs on first use), built against this venv's torch
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
ls -la .whl
du -sh .whl
