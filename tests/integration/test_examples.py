"""The documentation's examples (examples/*.py, one per page), each launched on CPU processes as
torchrun launches it (launch("forked"), tests/support/forked.py: the ranks forked from a process that imported torch
once, in torchrun's environment): each must exit 0 (each ends with its own check, an assert
that fails if its feature breaks) and print its summary line. One of them also runs under
torchrun itself, as its page says to launch it."""

import os
import re
import subprocess
import sys

import pytest
from support.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (script, ranks, extra environment)
EXAMPLES = [  # (quickstart.py: under torchrun itself, below)
    ("fully_shard.py", 2, {}),
    ("fully_shard_habits.py", 2, {}),
    ("fsdp2_port.py", 2, {}),
    ("optimizers.py", 2, {}),
    ("uneven_inputs.py", 2, {}),
    ("muon.py", 2, {}),
    ("mixed_precision.py", 2, {}),
    ("offload.py", 2, {}),
    ("hybrid.py", 4, {}),
    ("compressed.py", 4, {}),
    ("moe.py", 4, {}),
    ("tensor_parallel.py", 4, {}),
    ("checkpoints.py", 2, {}),
    ("dcp_interop.py", 2, {}),
    ("llama_zero3.py", 2, {}),
    ("generation.py", 2, {}),
    ("finetune.py", 2, {}),
    ("deepspeed_config.py", 2, {}),
    ("lightning_gpt.py", 2, {}),
    ("plan_memory.py", 2, {}),
    ("hangs.py", 2, {}),
    ("hangs.py", 2, {"ZEROSHARD_DEBUG": "1"}),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,ranks,env", EXAMPLES, ids=[s[:-3] + ("-debug" if e else "") for s, _, e in EXAMPLES])
def test_example(script, ranks, env, tmp_path):
    env = dict(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), ZEROSHARD_RECORD_DIR=str(tmp_path), **env)
    res = launch("forked", os.path.join(ROOT, "examples", script), ranks, env=env, cwd=ROOT, timeout=240)
    _check(script, env, res.returncode, res.stdout, res.stderr)


def _check(script, env, code, out, err):
    assert code == 0, out[-3000:] + err[-3000:]
    name = script[:-3]
    assert re.search(rf"^{name}: ", out, re.MULTILINE), out[-3000:]
    if name == "hangs":
        kind = "CollectiveMismatch" if env.get("ZEROSHARD_DEBUG") == "1" else "CollectiveTimeout"
        assert f"rank 0 caught zeroshard.{kind}" in out, out[-3000:]


@pytest.mark.timeout(300)
def test_quickstart_under_torchrun(tmp_path):
    """The quickstart as its page launches it: torchrun --standalone --nproc-per-node 2."""
    env = dict(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), ZEROSHARD_RECORD_DIR=str(tmp_path))
    res = launch("torchrun", os.path.join(ROOT, "examples", "quickstart.py"), 2, env=env, cwd=ROOT, timeout=240)
    _check("quickstart.py", env, res.returncode, res.stdout, res.stderr)


def test_plan_memory_runs_without_torchrun(tmp_path):
    """plan_memory.py's second launch command: plain python, a process group of one."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "plan_memory.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "plan_memory: the planner's state bytes equal memory_report() at stages 1-3 on 1 ranks" in res.stdout


def test_rehearse_scale_runs_as_one_process(tmp_path):
    """rehearse_scale.py: plain python, rank 0 of 4096 over the no-op process group."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "rehearse_scale.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(
        r"^rehearse_scale: at 4096 ranks the same \d+ collectives per step as at 8", res.stdout, re.MULTILINE
    ), res.stdout
