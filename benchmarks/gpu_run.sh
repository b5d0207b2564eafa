#!/usr/bin/env bash
# One pass on a CUDA machine: build against the machine's own torch, run the
# GPU tests (and optionally the whole suite), then the CUDA benchmarks.
# Logs and JSON go to $OUT (default benchmarks/out/gpu). Parts are chosen by
# arguments: build gpu alone host adamw muon offload trace lightning profile suite step124
# step124z3 example (default: all, in the order they run). Each part runs under its own time limit (PART_LIMIT, seconds; the
# suite's SUITE_LIMIT), so one that hangs leaves the rest their time, and none runs past
# DEADLINE seconds from the start. The suite runs the CPU tests with the GPU hidden
# (the gpu part runs the GPU tests); SUITE_WORKERS sets its pytest workers and SUITE_ARGS
# adds arguments. Wheels in .whl (the integrations' pinned test dependencies, made by
# benchmarks/gpu_wheels.sh; carry .whl) are installed apart and put first.
# PROFILE12 and PROFILE3 choose the profiled variants (empty: that half is skipped).
#   bash benchmarks/gpu_run.sh build gpu adamw
#   DEADLINE=560 bash benchmarks/gpu_run.sh build gpu suite adamw
# Where one command may run at most 10 minutes, split it over calls to the same
# warm machine (the build stays installed between them), e.g.
#   1) build gpu    2) suite    3) adamw step124 step124z3 example
# The gpu part fits 160 s with GPU_WORKERS=12. How long each part took on earlier runs:
# benchmarks/history.md, "gpu_run.sh: time per part". Results go to $OUT; where only a
# few files may come back, tar the folder.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# a process that dies of a signal prints its Python stack (the 2026-11-26 offload part
# exited after 23 s with no output at all)
export PYTHONFAULTHANDLER=1
parts="${*:-build gpu alone host adamw muon offload trace lightning profile suite step124 step124z3 example}"
LIMIT="${PART_LIMIT:-300}"
# every part ends by DEADLINE seconds after the start (one command's whole budget): a part
# gets what is left, less 10 s for what follows, and is skipped with under 20 s left
DEADLINE="${DEADLINE:-100000}"
has() { [[ " $parts " == *" $1 "* ]]; }
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*"; }
go() {   # go PART [LIMIT]: the part was asked for and has time; its limit in $L
  has "$1" || return 1
  local left=$(( DEADLINE - ($(date +%s) - t0) - 10 )) want="${2:-$LIMIT}"
  if (( left < 20 )); then stamp "skipped $1: ${left}s left before DEADLINE"; return 1; fi
  L=$(( left < want ? left : want ))
}
# Python packages the image lacks or holds in other versions (the integrations' pinned
# test dependencies), carried as wheels in .whl: installed apart, ahead on the path
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zs-site .whl/*.whl \
    && export PYTHONPATH="/tmp/zs-site${PYTHONPATH:+:$PYTHONPATH}"
fi

if go build; then
  stamp "machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/machine.txt"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$OUT/machine.txt"
  stamp "build"
  # Only the machine's own architecture: one nvcc pass instead of two.
  cap=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  TORCH_CUDA_ARCH_LIST="$cap" CMAKE_BUILD_PARALLEL_LEVEL=16 ZEROSHARD_CUDA=ON \
    $PY -m pip install -q --no-build-isolation --no-deps --no-cache-dir \
        -C cmake.define.ZEROSHARD_CUDA=ON . > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  $PY -c "import zeroshard as zs; print(zs.build_info())" 2>&1 | tee -a "$OUT/machine.txt"
  # the built extension comes back too (a later run can carry it instead of building)
  cp "$($PY -c 'import zeroshard._C as c; print(c.__file__)')" "$OUT/" 2>/dev/null || true
fi
if go gpu; then
  stamp "pytest -m gpu"
  # -v: a line per test, so a pass stopped at its limit still says which tests ran. Several
  # pytest workers share the one GPU (GPU_WORKERS): most of the part's time is the examples'
  # and integrations' torchrun processes starting, which the 16 cores run side by side
  timeout "$L" $PY -m pytest -m gpu tests/integration/test_gpu.py tests/integration/test_gpu_integrations.py -p no:cacheprovider -v \
    -n "${GPU_WORKERS:-6}" --dist load --timeout 300 -rfE --durations=25 2>&1 | tee "$OUT/pytest_gpu.log" \
    | grep -v " PASSED" | tail -60
fi
if go alone; then
  stamp "Muon: one step timed alone under the profiler, per variant (where its wall time goes; traces gzipped)"
  timeout "$L" $PY -m benchmarks profile_step --alone --variants ${ALONE12:-adamw+muon,zeroshard-1+muon,zeroshard-2+muon} \
    --out "$OUT/alone" 2>&1 | grep -v "Warn\|^ *warnings\|variant " | tee "$OUT/alone.log"
  timeout "$L" $PY -m benchmarks profile_step --alone --dtype float32 --variants ${ALONE3:-adamw-amp+muon,zeroshard-3+muon} \
    --out "$OUT/alone" 2>&1 | grep -v "Warn\|^ *warnings\|variant " | tee -a "$OUT/alone.log"
fi
if go host; then
  stamp "host time per phase, steps in a row and each alone (where a lone step's host waits for the device)"
  timeout "$L" $PY -m benchmarks profile_step --host --steps 8 \
    --variants ${HOST12:-adamw,zeroshard-2,adamw+muon,zeroshard-1+muon,zeroshard-2+muon} 2>&1 | grep "host \|Error" | tee "$OUT/host.log"
  timeout "$L" $PY -m benchmarks profile_step --host --steps 8 --dtype float32 \
    --variants ${HOST3:-adamw-amp+muon,zeroshard-3+muon} 2>&1 | grep "host \|Error" | tee -a "$OUT/host.log"
fi
if go adamw; then
  stamp "adamw benchmark (calls queued as in training; other launch choices of the kernel as extra rows)"
  # ADAMW_SIZES: only those sizes; LAUNCHES=none: no launch-choice rows
  timeout "$L" $PY -m benchmarks adamw --devices cuda ${ADAMW_SIZES:+--sizes $ADAMW_SIZES} \
    --launches "$( [ "${LAUNCHES:-}" = none ] || echo "${LAUNCHES:-streaming:8,cached:4,streaming:4,cached:16}" )" \
    --json "$OUT/adamw.json" 2>&1 | tee "$OUT/adamw.log" | grep -v " @" | tail -40
  grep " @\|kernel launch" "$OUT/adamw.log"
  stamp "adamw at 256M, single calls (the host's launch work inside each timed call)"
  timeout "$L" $PY -m benchmarks adamw --devices cuda --sizes 2.68435456e8 --queue 1 \
    --json "$OUT/adamw_single_calls.json" 2>&1 | tail -7
fi
GPT2="--world-size 1 --layers 12 --dim 768 --heads 12 --seq 1024 --vocab 50257 --batch 8 --no-comm"
if go muon; then
  stamp "Muon: GPT-2 124M steps through zeroshard against torch.optim.Muon (paired, in one process); AdamW rows beside"
  timeout "$L" $PY -m benchmarks step --device cuda $GPT2 --dtype bfloat16 --rounds 1 --baseline adamw+muon \
    --variants ${MUON12:-adamw,zeroshard-2,adamw+muon,zeroshard-1+muon,zeroshard-2+muon} \
    --json "$OUT/muon124.json" 2>&1 | tee "$OUT/muon124.log" | grep -v Warn | tail -9
  timeout "$L" $PY -m benchmarks step --device cuda $GPT2 --dtype float32 --param-dtype bfloat16 --rounds 1 \
    --baseline adamw-amp+muon --variants ${MUON3:-adamw-amp,zeroshard-3,adamw-amp+muon,zeroshard-3+muon} \
    --json "$OUT/muon124z3.json" 2>&1 | tee "$OUT/muon124z3.log" | grep -v Warn | tail -8
fi
if go offload; then
  stamp "offload: GPT-2 124M stage 2 with offload cpu and nvme against none (bf16 parameters)"
  timeout "$L" $PY -m benchmarks step --device cuda $GPT2 --dtype bfloat16 --rounds 1 --steps 3 --paired 4 \
    --variants zeroshard-2,zeroshard-2+cpu,zeroshard-2+nvme --json "$OUT/offload124.json" 2>&1 | tee "$OUT/offload124.log" | tail -7
  echo "offload part exit status ${PIPESTATUS[0]}"
fi
if go trace; then
  stamp "offload: do the device-to-host gradient copies overlap the backward? (stages 2 and 3, one profiled step)"
  for st in 2 3; do
    timeout "$L" $PY -m benchmarks offload_trace --stage $st --json "$OUT/trace$st/offload_trace.json" 2>&1 | tee "$OUT/trace$st.log" | tail -4
  done
fi
if go lightning; then
  stamp "lightning: ZeroShardStrategy against DDPStrategy, FSDPStrategy and DeepSpeedStrategy on one GPU"
  timeout "$L" $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m benchmarks lightning_front_door --steps 8 \
    --rounds 3 --json "$OUT/lightning_front_door.json" 2>&1 | grep -v Warn | tee "$OUT/lightning.log" | tail -12
fi
if go profile; then
  stamp "profile: phase times, host-device syncs (with their Python stacks) and top operators"
  timeout "$L" $PY -m benchmarks profile_step --stack --variants ${PROFILE12:-adamw,zeroshard-2,adamw+muon,zeroshard-2+muon} \
    --out "$OUT/prof" 2>&1 | grep -v Warn
  [ -n "${PROFILE3-x}" ] && timeout "$L" $PY -m benchmarks profile_step --stack --dtype float32 \
    --variants ${PROFILE3:-adamw-amp,zeroshard-3,zeroshard-3+muon} --out "$OUT/prof" 2>&1 | grep -v Warn
fi
if go suite "${SUITE_LIMIT:-540}"; then
  stamp "whole suite, the GPU hidden"
  # The CPU tests on the CUDA build, as CI runs them: the GPU hidden, since their
  # multi-rank runs would otherwise meet one GPU (Accelerate's barrier asks for GPU
  # <rank>, torchrun'd scripts pick NCCL: the 2026-11-26 run); the GPU tests are the
  # gpu part. Whole test files per worker; a hung gloo test fails after 120 s with its
  # ranks' stacks (tests/_dist.py).
  CUDA_VISIBLE_DEVICES= ZEROSHARD_EXPECT_CUDA_BUILD=1 timeout -s INT -k 20 "$L" $PY -m pytest tests \
    --ignore tests/integration/test_gpu.py --ignore tests/integration/test_gpu_integrations.py -p no:cacheprovider -q \
    -n "${SUITE_WORKERS:-8}" --dist loadfile --timeout 300 -rfE \
    ${SUITE_ARGS:-} 2>&1 | tee "$OUT/pytest_all.log" | tail -25
fi
if go step124; then
  stamp "step GPT-2 124M, bf16 parameters (stages 1/2) against plain bf16 and autocast training; Muon; offload to host"
  timeout "$L" $PY -m benchmarks step --device cuda $GPT2 --dtype bfloat16 --rounds ${ROUNDS:-1} \
    --variants ${STEP124:-adamw,adamw-amp,fsdp2,zeroshard-1,zeroshard-2,zeroshard-2+cpu,adamw+muon,zeroshard-1+muon,zeroshard-2+muon} \
    --json "$OUT/step124.json" 2>&1 | tee "$OUT/step124.log" | tail -12
fi
if go step124z3; then
  stamp "step GPT-2 124M, fp32 shards + bf16 compute (ZeRO-3) against autocast training"
  timeout "$L" $PY -m benchmarks step --device cuda $GPT2 --dtype float32 --param-dtype bfloat16 --rounds ${ROUNDS:-1} \
    --variants ${STEP124Z3:-adamw-amp,fsdp2-3,zeroshard-3,adamw-amp+muon,zeroshard-3+muon} \
    --json "$OUT/step124z3.json" 2>&1 | tee "$OUT/step124z3.log" | tail -9
fi
if go example; then
  stamp "example: stage 1, then ZeRO-3 with checkpoints resumed as ZeRO-2"
  ck=$(mktemp -d)
  run="timeout $L torchrun --standalone --nproc-per-node 1 examples/train_gpt.py --dtype bf16 --out-dir $OUT/example"
  { $run --stage 1 --steps 60 && $run --stage 3 --steps 100 --ckpt-dir "$ck" --ckpt-every 50 &&
    $run --stage 2 --steps 120 --ckpt-dir "$ck" --resume; echo "example exit $?"; } > "$OUT/example.log" 2>&1
  grep -E "^GPT|loss:|checkpoint|resum|peak GPU|example exit|Error" "$OUT/example.log"
fi
stamp "done"
