"""Hybrid sharding (shard_size / a 2-D DeviceMesh): ZeRO inside shard groups of
S ranks, replicas across them; against single-process torch AdamW on gloo at
world size 4 (2 replicas x 2 shards) and 6 (3 x 2 for ZeRO-1/2, 2 x 3 for ZeRO-3)."""

import os

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from support.checks import rel_err
from support.ddp_parity import build, compare, compare_unused, full_params, trained_hybrid
from support.flat_net import batches, make_model, param_groups, reference, train_ours
from support.flat_net import local as local_slice
from support.launch import launch
from support.models import Residual, ResidualNet

STEPS = 3


def _pool_and_shard(world_shard):
    world, shard = world_shard
    return launch("pool", world), shard


# world 4 = 2 replicas x 2 shards; ZeRO-1/2 also at 6 = 3 x 2 (three replicas: stage 1's
# correction for several synced backwards takes off two copies), ZeRO-3 at 6 = 2 x 3 (shards
# that do not divide the units evenly)
FLAT = pytest.mark.parametrize("hybrid", [(4, 2), (6, 2)], ids=lambda p: f"world{p[0]}-shard{p[1]}")
UNITS = pytest.mark.parametrize("hybrid", [(4, 2), (6, 3)], ids=lambda p: f"world{p[0]}-shard{p[1]}")


def _train(stage, shard_size, clip, mesh, micro=1):
    kw = dict(shard_size=shard_size)
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        kw = dict(
            device_mesh=init_device_mesh(
                "cpu", (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
            )
        )
    acc = dict(micro=micro, no_sync=micro > 1)  # micro-batches accumulated under no_sync()
    model, opt, norms = train_ours(1, stage, clip=clip, **acc, **kw)
    before = dict(opt.comm_elements)
    train_ours(STEPS - 1, stage, clip=clip, model=model, opt=opt, first_step=1, **acc)
    per_step = {k: (opt.comm_elements[k] - before[k]) / (STEPS - 1) for k in before}
    ref, _ = reference(STEPS, micro=micro)
    err = max(rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    rep = opt.memory_report()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    padded = sum(b.numel for b in opt.layout.buckets)
    return dict(
        err=err, world=opt.world_size, rank=opt.rank, rep=rep, psi=psi, padded=padded, per_step=per_step, norms=norms
    )


# (3 replicas of 2 shards at stage 2 with accumulation; the rest on 2 x 2, whose pool is warm)
@pytest.mark.parametrize(
    "hybrid,stage,micro",
    [((4, 2), 1, 1), ((4, 2), 2, 1), ((4, 2), 2, 2), ((6, 2), 2, 2)],
    ids=["world4-shard2-1-1", "world4-shard2-2-1", "world4-shard2-2-2", "world6-shard2-2-2"],
)
def test_hybrid_equals_single_process_adamw(hybrid, stage, micro):
    pool, shard = _pool_and_shard(hybrid)
    res = pool.run(_train, stage, shard, None, False, micro)
    replicas = pool.world_size // shard
    for r, out in enumerate(res):
        assert out["err"] < 1e-5, (r, out["err"])
        assert out["world"] == shard and out["rank"] == r % shard  # sharded over the shard group
        # communication per step: inside the shard group Ψ (+ padding) each way, across
        # replicas only this rank's shard of it
        ps = out["per_step"]
        assert ps["reduce_scatter"] == out["padded"] and ps["all_gather"] == out["padded"], ps
        assert ps["replica_all_reduce"] == out["padded"] // shard, ps
    # memory: each shard group owns every element exactly once (fp32 model: Adam's two
    # states 8 bytes per owned element, parameters 4Ψ, gradients 4Ψ at stage 1 and 4 per
    # owned element at stage 2: the formulas with S in place of N)
    for first in range(0, pool.world_size, shard):
        owned = [res[r]["rep"]["exp_avg"] // 4 for r in range(first, first + shard)]
        assert sum(owned) == res[0]["psi"], owned
        for r, own in zip(range(first, first + shard), owned):
            rep, psi = res[r]["rep"], res[r]["psi"]
            grads = 4 * psi if stage == 1 else 4 * own
            assert rep["total"] - rep["padding"] == 4 * psi + grads + 8 * own, (r, rep)
    assert replicas > 1


def _train_fully_shard(shard_size, micro):
    import contextlib

    import torch.nn as nn
    import torch.nn.functional as F
    import time

    rank, world, t0 = dist.get_rank(), dist.get_world_size(), time.time()
    model = zs.FullyShard(make_model(), wrap={nn.Linear}, shard_size=shard_size)
    opt = zs.ShardedOptimizer(param_groups(model))
    for mbs in batches(STEPS, micro=micro):
        opt.zero_grad()
        for j, (x, y) in enumerate(mbs):
            with opt.no_sync() if j < micro - 1 else contextlib.nullcontext():
                (F.cross_entropy(model(local_slice(x, rank, world)), local_slice(y, rank, world)) / micro).backward()
        opt.step()
    ref, _ = reference(STEPS, micro=micro)
    full = model.state_dict()
    groups = {
        kind: {r["group"] for r in zs.flight_record() if kind in r["what"] and r["start"] >= t0}
        for kind in ("replica all-reduce", "all-gather")
    }
    return max(rel_err(full[k], v) for k, v in ref.state_dict().items()), model.comm_elements, groups


@UNITS
@pytest.mark.parametrize("micro", [1, 2])
def test_hybrid_fully_shard_equals_single_process_adamw(hybrid, micro):
    pool, shard = _pool_and_shard(hybrid)
    for err, comm_elements, groups in pool.run(_train_fully_shard, shard, micro):
        assert err < 1e-5, err
        assert comm_elements["replica_all_reduce"] > 0
        # the flight record names each collective's group: replicas, and the shard group
        assert len(groups["replica all-reduce"]) == 1 and len(groups["all-gather"]) == 1
        assert groups["replica all-reduce"] != groups["all-gather"]


def test_hybrid_clipping_counts_each_shard_once_and_mesh_equals_shard_size():
    pool = launch("pool", 4)
    clipped = pool.run(_train, 2, 2, 0.05, False)
    meshed = pool.run(_train, 2, 2, 0.05, True)
    ref, ref_norms = reference(1, clip=0.05)
    for a, b in zip(clipped, meshed):
        assert abs(a["norms"][0] - ref_norms[0]) < 1e-5 * ref_norms[0], (a["norms"], ref_norms)
        assert a["norms"] == b["norms"] and abs(a["err"] - b["err"]) < 1e-12


# A DDP script's habits (torch's clip, GradScaler with an overflow on one rank, several
# synced backwards per step, parameters used on one rank only) against DDP itself,
# with 2 replicas of 2 shards; stage 3 is FullyShard(shard_size=2).
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", ["torch_clip", "scaler", "model_zero_grad"])
def test_hybrid_ddp_script_equals_ddp(stage, case):
    for r in launch("pool", 4).run(compare, stage, case, shard_size=2):
        assert r["param_err"] < 1e-5, r
        if case != "model_zero_grad":
            assert r["norm_err"] < 1e-5 and r["pnorm_err"] < 1e-5, r
        ours, ddp = r["scales"]
        assert ours == ddp, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_parameters_used_on_one_replica_only_get_ddps_gradient(stage):
    for err, ours, ddp, same_none in launch("pool", 4).run(compare_unused, stage, shard_size=2):
        assert err < 1e-5
        assert ours == ddp and same_none, (ours, ddp)


def _fully_shard_memory():
    model = zs.FullyShard(ResidualNet(), wrap={Residual}, shard_size=2)
    zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    rep = model.memory_report()
    return rep, sum(p.numel() for p in ResidualNet().parameters()), model.world_size, model.process_group.size()


def test_hybrid_fully_shard_holds_16_psi_over_s_exactly():
    res = launch("pool", 4).run(_fully_shard_memory)
    psi = res[0][1]
    for first in (0, 2):
        group = [res[r][0] for r in (first, first + 1)]
        # fp32 shards, gradients and Adam's two states: 16 bytes per owned element
        assert sum(rep["params"] for rep in group) == 4 * psi
        assert all(rep["total"] - rep["padding"] == 4 * rep["params"] for rep in group), group
    assert [r[2:] for r in res] == [(2, 2)] * 4
    assert res[0][0]["params"] == res[2][0]["params"] and res[1][0]["params"] == res[3][0]["params"]


def _bad(kind):
    model = make_model()
    if kind == "not dividing":
        zs.ShardedOptimizer(model.parameters(), shard_size=3)
    elif kind == "with process_group":
        zs.ShardedOptimizer(model.parameters(), shard_size=2, process_group=dist.group.WORLD)
    elif kind == "3-D mesh":
        from torch.distributed.device_mesh import init_device_mesh

        zs.ShardedOptimizer(model.parameters(), device_mesh=init_device_mesh("cpu", (1, 2, dist.get_world_size() // 2)))
    elif kind == "fully shard":
        zs.FullyShard(model, shard_size=5)


@pytest.mark.parametrize(
    "kind,match",
    [
        (
            "not dividing",
            r"\[rank \d/4\] ShardedOptimizer: shard_size must be a positive integer dividing the world "
            r"size \(4\), got 3",
        ),
        ("with process_group", "pass process_group or shard_size, not both"),
        ("3-D mesh", r"device_mesh must be 1-D \(the ranks to shard over\) or 2-D"),
        ("fully shard", r"FullyShard: shard_size must be a positive integer dividing the world size \(4\), got 5"),
    ],
)
def test_hybrid_misuse_is_a_clear_error(kind, match):
    pool = launch("pool", 4)
    with pytest.raises(AssertionError, match=match):
        pool.run(_bad, kind)


# ------------------------------------------------------------- checkpoints
def _full_state(kind, model, opt):
    opt.consolidate_state_dict(to=None)
    st = opt.state_dict()["state"]
    return full_params(kind, model), {i: {k: v.clone() for k, v in s.items()} for i, s in st.items()}


def _save_hybrid(path, stage):
    model, opt = trained_hybrid(stage, steps=3)
    zs.save_checkpoint(path, model, opt, extra={"rank": dist.get_rank()})
    return _full_state(stage, model, opt)


def _load_flat(path, stage):
    model, opt = build(stage)
    extra = zs.load_checkpoint(path, model, opt)
    return _full_state(stage, model, opt) + (extra,)


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in b) and set(a) == set(b)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hybrid_checkpoint_is_written_once_and_loads_flat_at_3_and_at_1(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    saved = launch("pool", 4).run(_save_hybrid, path, stage)
    params, state = saved[0]
    assert all(_same(p, params) for p, _ in saved)  # the replicas agree
    # each shard written once: the first shard group's two ranks, no replica's duplicate
    assert sorted(f for f in os.listdir(path) if f.startswith("rank")) == ["rank0.safetensors", "rank1.safetensors"]
    for loaded, st, extra in launch("pool", 3).run(_load_flat, path, 2 if stage == 3 else 3):
        assert _same(loaded, params)
        assert st.keys() == state.keys() and all(_same(st[i], state[i]) for i in state)
    assert [e["rank"] for *_, e in launch("pool", 3).run(_load_flat, path, stage)] == [0, 1, 0]
    # one process, no torch.distributed: a plain model and torch's AdamW
    model = ResidualNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    zs.load_checkpoint(path, model, opt)
    assert _same({k: v.float() for k, v in model.state_dict().items()}, params)
    got = opt.state_dict()["state"]
    assert all(_same(got[i], state[i]) for i in state)
