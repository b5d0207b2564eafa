"""torch.compile over zeroshard models, on gloo at world sizes 2 and 3: per-block
compile under FullyShard (one graph for every block, no recompiles), the
whole FullyShard model compiled, and stages 1/2 under torch.compile(model),
each equal to the same training run eagerly."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from support.launch import launch
from support.models import Residual, ResidualNet


def _train(stage, how, layers=4, backend="aot_eager", steps=3):
    """Parameters after ``steps`` steps, and dynamo's counters for the run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = ResidualNet(layers)
    if how == "per_block":
        for b in model.blocks:
            b.compile(backend=backend)
    if stage == 3:
        model = zs.FullyShard(model, wrap={Residual})
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    else:
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_mb=700 / 2**20)
    run = torch.compile(model, backend=backend) if how == "whole" else model
    g = torch.Generator().manual_seed(5)
    n = 12 // dist.get_world_size()
    r = dist.get_rank()
    for _ in range(steps):
        x, y = torch.randn(12, 11, generator=g), torch.randint(0, 3, (12,), generator=g)
        F.cross_entropy(run(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]).backward()
        opt.step()
        opt.zero_grad()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    stats = {"graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values())}
    return sd, stats


def _per_block():
    eager, _ = _train(3, "eager")
    compiled, stats4 = _train(3, "per_block")
    _, stats2 = _train(3, "per_block", layers=2)
    err = max((eager[k] - compiled[k]).abs().max().item() for k in eager)
    return err, stats4, stats2


def test_per_block_compile_under_fully_shard_is_one_graph_for_every_block(dist_pool):
    for err, stats4, stats2 in dist_pool.run(_per_block):
        assert err < 1e-6
        assert stats4 == stats2 == {"graphs": 1, "recompiles": 0}, (stats4, stats2)


def _whole(stage, backend):
    eager, _ = _train(stage, "eager")
    compiled, stats = _train(stage, "whole", backend=backend)
    return max((eager[k] - compiled[k]).abs().max().item() for k in eager), stats


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_whole_model_compile_equals_eager(dist_pool, stage):
    for err, stats in dist_pool.run(_whole, stage, "aot_eager"):
        assert err < 1e-6 and stats["graphs"] >= 1 and stats["recompiles"] == 0, (err, stats)


@pytest.mark.timeout(600)
def test_whole_fully_shard_model_compiles_with_inductor():
    for err, stats in launch("pool", 2).run(_whole, 3, "inductor"):
        assert err < 1e-5 and stats["graphs"] >= 1, (err, stats)
