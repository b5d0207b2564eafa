"""The training example (what `make demo` runs under torchrun), on 2 CPU ranks forked in torchrun's environment."""

import os
import re
import subprocess
import sys

import pytest
from support.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")


def _launch(*args, tmp):
    # (forked ranks in torchrun's environment; `make demo` and the quickstart's test run torchrun itself)
    res = launch("forked", SCRIPT, 2, ["--out-dir", str(tmp), *args], env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _table(out):
    """{rank: (total, formula, ddp)} from the memory table."""
    rows = re.findall(r"^(\d)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    return {int(r): tuple(map(float, v)) for r, *v in rows}


@pytest.mark.timeout(600)
def test_train_checkpoint_resume_at_another_stage(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _launch(
        "--stage",
        "3",
        "--steps",
        "24",
        "--accum",
        "2",
        "--clip",
        "1.0",
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        "12",
        tmp=tmp_path,
    )
    first, last = map(float, re.search(r"loss: first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+)", out).groups())
    assert last < first - 0.3, out  # it learns
    assert "checkpoint: step 24" in out and (ckpt / "manifest.json").exists()
    table = _table(out)
    assert sorted(table) == [0, 1]
    for total, formula, ddp in table.values():  # no padding in this model: exact
        assert total == formula and abs(ddp - 2 * formula) < 2e-3  # ZeRO-3 fp32, 2 ranks: 8 vs 16 B/param
    out2 = _launch("--stage", "2", "--steps", "28", "--ckpt-dir", str(ckpt), "--resume", tmp=tmp_path)
    assert "steps 24..28" in out2
    resumed = float(re.search(r"loss: first \d+ steps ([\d.]+)", out2).group(1))
    assert resumed < first - 0.3  # it continued, not restarted
    assert (tmp_path / "memory_by_stage.png").stat().st_size > 10_000 or "matplotlib is not installed" in out2


def test_resume_needs_a_checkpoint_dir(tmp_path):
    res = subprocess.run([sys.executable, SCRIPT, "--resume"], capture_output=True, text=True)
    assert res.returncode == 2 and "--resume needs --ckpt-dir" in res.stderr


@pytest.mark.timeout(600)
def test_a_ddp_script_and_its_conversions_end_with_equal_parameters(tmp_path):
    """examples/ddp_idioms.py (autocast, GradScaler, accumulation, torch's clip, a rank-0
    checkpoint, resume) under DDP and at stages 1, 2 and 3: the same parameters."""
    import torch

    script = os.path.join(ROOT, "examples", "ddp_idioms.py")
    results = {}
    for mode in ("ddp", "1", "2", "3"):  # (2 ranks each, as torchrun starts them: launch("forked"))
        out = tmp_path / f"{mode}.pt"
        res = launch(
            "forked",
            script,
            2,
            ["--mode", mode, "--out", str(out)],
            env={"OMP_NUM_THREADS": "1"},
            cwd=ROOT,
            timeout=240,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        results[mode] = torch.load(out)
    ddp = results["ddp"]["straight"]
    for mode, r in results.items():
        for run in ("straight", "resumed"):
            for k, ref in ddp.items():
                err = ((r[run][k].double() - ref.double()).norm() / ref.double().norm()).item()
                assert err < 1e-5, (mode, run, k, err)
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_idioms", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    init = mod.Net().state_dict()
    assert max(((ddp[k] - init[k]).norm() / init[k].norm()).item() for k in init) > 1e-2  # it trained
