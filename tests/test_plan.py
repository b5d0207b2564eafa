"""The memory planner: the seeds' worked examples, the CLI, and agreement with memory_report()."""
import subprocess
import sys

import pytest
import torch

import zeroshard as zs
from zeroshard.plan import model_state_bytes

GB = 1e9


@pytest.mark.parametrize("params,world,dtype,totals", [
    (7e9, 4, "bf16", (112, 49, 38.5, 28)),     # seed 003's table (mixed precision, 16 bytes)
    (7e9, 8, "fp32", (112, 63, 38.5, 14)),     # seed 000's fp32 arithmetic
    (1.5e9, 1, "fp16", (24, 24, 24, 24)),      # seed 002: a 1.5B model needs ~24 GB
])
def test_seed_examples(params, world, dtype, totals):
    rows = model_state_bytes(params, world, dtype)
    assert [round(rows[s]["total"] / GB, 6) for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")] == list(totals)


def test_seed_003_breakdown():
    r = model_state_bytes(7e9, 4, "bf16")
    assert (r["ZeRO-2"]["params"], r["ZeRO-2"]["grads"], r["ZeRO-2"]["optimizer"]) == (14 * GB, 3.5 * GB, 21 * GB)


def test_cli_prints_the_table_and_rejects_bad_input():
    out = subprocess.run([sys.executable, "-m", "zeroshard.plan", "--params", "7e9", "--world-size", "4"],
                         capture_output=True, text=True, check=True).stdout
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert lines["DDP"][4] == "112.00" and lines["ZeRO-2"][4] == "38.50"
    assert lines["DDP"][5:] == ["no", "no", "no", "yes"]            # 24 / 40 / 80 / 141 GB cards
    assert lines["ZeRO-1"][5:] == ["no", "no", "yes", "yes"]        # seed 003: fits on 80, not 40
    assert lines["ZeRO-2"][5:] == ["no", "yes", "yes", "yes"]
    bad = subprocess.run([sys.executable, "-m", "zeroshard.plan", "--params", "7e9", "--world-size", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--world-size must be >= 1" in bad.stderr


def _reports(stage, dtype):
    from test_fully_shard import Block, make_gpt
    model = make_gpt()
    if stage == 3:
        model = zs.FullyShard(model, wrap={Block})
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-3)
        n = sum(q.numel for u in model._units for q in u.params)
    else:
        model.to(dtype)
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-3, stage=stage, bucket_mb=0.004)
        n = sum(p.numel() for p in model.parameters())
    return n, opt.memory_report()


@pytest.mark.parametrize("stage,dtype,conv", [(1, torch.float32, "fp32"), (2, torch.float32, "fp32"),
                                              (1, torch.bfloat16, "bf16"), (2, torch.bfloat16, "bf16"),
                                              (3, torch.float32, "fp32")])
def test_formula_matches_what_the_ranks_hold(dist_pool, stage, dtype, conv):
    """Replicated categories equal the formula on every rank; sharded ones sum to it over the ranks."""
    res = dist_pool.run(_reports, stage, dtype)
    n, world = res[0][0], dist_pool.world_size
    want = model_state_bytes(n, world, conv)[f"ZeRO-{stage}"]
    got = {k: [r[k] for _, r in res] for k in res[0][1]}
    optimizer = [m + a + s for m, a, s in zip(got["master"], got["exp_avg"], got["exp_avg_sq"])]
    assert sum(optimizer) == world * want["optimizer"]
    if stage == 3:
        assert sum(got["params"]) == world * want["params"] and sum(got["grads"]) == world * want["grads"]
    else:
        assert got["params"] == [want["params"]] * world
        grads = got["grads"] if stage == 1 else [sum(got["grads"]) / world] * world
        assert grads == [want["grads"]] * world
