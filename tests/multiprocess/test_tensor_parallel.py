"""Tensor parallelism (DTensor parameters over mesh["tp"]) with ZeRO-1/2/3 over mesh["dp"]: a
small GPT parallelized with torch's parallel styles and sequence parallelism
(examples/tensor_parallel.py's), against one process training the whole model on every dp
rank's batch with torch's AdamW. 4 gloo ranks: dp 2 x tp 2."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from support.checks import Refusals
from support.launch import launch
from zeroshard.plan import model_state_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
from tensor_parallel import GPT, V, Block, batch, loss_of, parallelize  # (examples/tensor_parallel.py's model)

STEPS = 3


SGD = dict(optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)  # (an elementwise optimizer_class)


def _reference(dp: int, micro: int, clip, steps: int = STEPS, sgd: bool = False):
    """One process, the whole model, every dp rank's batch: parameters and clip norms."""
    torch.manual_seed(0)
    model = GPT()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if sgd
        else torch.optim.AdamW(model.parameters(), lr=1e-2)
    )
    norms = []
    for step in range(steps):
        for m in range(micro):
            xs, ys = zip(*(batch(step * micro + m, d, "cpu") for d in range(dp)))
            (loss_of(model, torch.cat(xs), torch.cat(ys)) / micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)))
        opt.step()
        opt.zero_grad()
    return model, norms


def _train(
    stage: int,
    micro: int = 1,
    clip=None,
    torch_clip: bool = False,
    bucket_mb: float = 25,
    dtype=torch.float32,
    sgd: bool = False,
    vocab_parallel: bool = False,
):
    """``sgd``: torch's SGD with momentum through optimizer_class; ``vocab_parallel``: the
    logits split over the vocabulary, the loss under torch's loss_parallel()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, ref_norms = _reference(2, micro, clip, sgd=sgd)
    torch.manual_seed(0)
    model = parallelize(GPT(), mesh["tp"], loss_parallel=vocab_parallel).to(dtype)
    kw = SGD if sgd else dict(lr=1e-2)
    if stage == 3:  # each block a unit: its tp pieces sharded over dp, gathered for its compute
        model = zs.FullyShard(
            model,
            wrap={Block},
            device_mesh=mesh["dp"],
            mixed_precision=zs.MixedPrecision(param_dtype=dtype) if dtype != torch.float32 else None,
        )
        opt = zs.ShardedOptimizer(model.parameters(), **kw)
    else:
        opt = zs.ShardedOptimizer(model.parameters(), stage=stage, device_mesh=mesh["dp"], bucket_mb=bucket_mb, **kw)
    norms, dp_rank = [], mesh["dp"].get_local_rank()
    for step in range(STEPS):
        for m in range(micro):
            with (
                opt.no_sync() if m < micro - 1 else torch.enable_grad(),
                loss_parallel() if vocab_parallel else torch.enable_grad(),
            ):
                (loss_of(model, *batch(step * micro + m, dp_rank, "cpu")) / micro).backward()
        if torch_clip:  # torch's own, over DTensor parameters of two meshes' worth of sharding
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        else:
            norms.append(float(opt.clip_grad_norm_(clip or math.inf)))
        opt.step()
        opt.zero_grad()
    # (the whole model's tensors: gathered over tp; FullyShard's state_dict over dp and tp)
    whole = model.state_dict() if stage == 3 else {n: p.full_tensor() for n, p in model.named_parameters()}
    err = max(((whole[n].float() - p).norm() / p.norm()).item() for n, p in ref.named_parameters())
    from torch.distributed.tensor import Shard

    tp_sharded = sum(
        p.numel()
        for p in parallelize(GPT(), mesh["tp"]).parameters()
        if any(isinstance(pl, Shard) for pl in p.placements)
    )
    return dict(
        err=err,
        norms=norms,
        ref_norms=ref_norms,
        rep=opt.memory_report(),
        stage=stage,
        psi=(tp_sharded, sum(p.numel() for p in ref.parameters()) - tp_sharded),
    )


def _check_plan(results):
    """The planner's formulas (python -m zeroshard.plan --tp --replicated) say what the ranks
    hold between them, category by category (fp32: params, grads, exp_avg + exp_avg_sq)."""
    psi_s, psi_r = results[0]["psi"]
    world, stage = len(results), results[0]["stage"]
    row = model_state_bytes(psi_s + psi_r, world, "fp32", tp=2, replicated=psi_r)[f"ZeRO-{stage}"]
    held = {k: sum(out["rep"][k] for out in results) for k in ("params", "grads", "exp_avg", "exp_avg_sq", "master")}
    assert (held["params"], held["grads"]) == (world * row["params"], world * row["grads"]), (held, row)
    assert held["exp_avg"] + held["exp_avg_sq"] + held["master"] == world * row["optimizer"], (held, row)


def _built(stage: int, tp: int, seed: int = 1, replicas: int = 0):
    """A fresh model (tensor-parallel over ``tp`` ranks of the world; dp the rest) and its
    optimizer at ``stage``; this rank's dp place; the whole model's tensors (collective).
    ``seed`` 0: the reference's start; another: values a load must replace. ``replicas``:
    hybrid sharding on the dp axis, a (replicate, shard) mesh of that many replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = dist.get_world_size() // tp
    if replicas:
        mesh = init_device_mesh("cpu", (replicas, dp // replicas, tp), mesh_dim_names=("rep", "shard", "tp"))
        dp_mesh = mesh["rep", "shard"]
        dp_rank = mesh["rep"].get_local_rank() * (dp // replicas) + mesh["shard"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, dp_rank = mesh["dp"], mesh["dp"].get_local_rank()
    torch.manual_seed(seed)
    model = parallelize(GPT(), mesh["tp"]) if tp > 1 else GPT()
    if stage == 3:
        model = zs.FullyShard(model, wrap={Block}, device_mesh=dp_mesh)
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    else:
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, device_mesh=dp_mesh)

    def whole():
        if stage == 3:
            return model.state_dict()
        return {n: p.full_tensor() if tp > 1 else p.detach() for n, p in model.named_parameters()}

    return model, opt, dp_rank, whole


def _steps(model, opt, dp_rank: int, steps, clip=None):
    for step in steps:
        loss_of(model, *batch(step, dp_rank, "cpu")).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


def _across_tp_degrees(tmp: str, phase: str):
    """``save`` (4 ranks): one step at stage 2, dp 2 x tp 2, saved; loaded at stage 3 on the same
    mesh and trained on. ``tp1`` (2 ranks): loaded without tensor parallelism at stage 1 (tp 2
    to 1), saved again, trained on. ``tp2`` (4 ranks): that save loaded at stage 2, dp 2 x tp 2
    (tp 1 to 2), trained on. Each ends where one process does (the largest relative difference)."""
    ref = _reference(2, 1, None)[0]
    path, errors = os.path.join(tmp, "tp"), []
    if phase == "save":
        model, opt, dp_rank, _ = _built(2, 2, seed=0)
        _steps(model, opt, dp_rank, [0])
        zs.save_checkpoint(path, model, opt)
    stage, tp = {"save": (3, 2), "tp1": (1, 1), "tp2": (2, 2)}[phase]
    model, opt, dp_rank, whole = _built(stage, tp)
    zs.load_checkpoint(path if phase != "tp2" else path + "1", model, opt)
    if phase == "tp1":
        zs.save_checkpoint(path + "1", model, opt)
    _steps(model, opt, dp_rank, range(1, STEPS))
    got = whole()
    errors.append(max(((got[n].float() - p).norm() / p.norm()).item() for n, p in ref.named_parameters()))
    return errors


def _hybrid(tmp: str):
    """Hybrid sharding on the dp axis of dp 2 x tp 2: stage 3 over 2 replicas of one rank each
    (the replicas all-reduce the shards), stage 1 over one replica of 2 ranks; stage 2 over 2
    replicas saved after a step and resumed at stage 3 without hybrid sharding. The largest
    relative difference from one process of each (clipping at 0.5: the global norm)."""
    ref, errors = _reference(2, 1, 0.5)[0], []
    for stage, replicas in ((3, 2), (1, 1), (2, 2)):
        model, opt, dp_rank, whole = _built(stage, 2, seed=0, replicas=replicas)
        _steps(model, opt, dp_rank, range(STEPS) if stage != 2 else [0], clip=0.5)
        if stage == 2:
            zs.save_checkpoint(os.path.join(tmp, "hybrid"), model, opt)
            model, opt, dp_rank, whole = _built(3, 2)
            zs.load_checkpoint(os.path.join(tmp, "hybrid"), model, opt)
            _steps(model, opt, dp_rank, range(1, STEPS), clip=0.5)
        got = whole()
        errors.append(max(((got[n].float() - p).norm() / p.norm()).item() for n, p in ref.named_parameters()))
    return errors


def test_hybrid_sharding_on_the_dp_axis_beside_tensor_parallelism(tmp_path):
    for errors in launch("pool", 4).run(_hybrid, str(tmp_path)):
        assert max(errors) < 2e-5, errors


def test_checkpoints_resume_at_another_stage_and_tensor_parallel_degree(tmp_path):
    """Saved at stage 2 on dp 2 x tp 2: resumed at stage 3 on the same mesh, at stage 1 without
    tensor parallelism on 2 ranks (tp 2 to 1) and, saved there, at stage 2 on dp 2 x tp 2 again
    (tp 1 to 2); each ends where one process does; the export is the whole model's state dict
    after the first step."""
    from safetensors.torch import load_file

    for phase, world in (("save", 4), ("tp1", 2), ("tp2", 4)):
        for errors in launch("pool", world).run(_across_tp_degrees, str(tmp_path), phase):
            assert max(errors) < 2e-5, (phase, errors)
    zs.export_full_state_dict(tmp_path / "tp", tmp_path / "full.safetensors")
    full, want = load_file(str(tmp_path / "full.safetensors")), _reference(2, 1, None, steps=1)[0].state_dict()
    assert set(full) == set(want)
    assert max(((full[n] - w).norm() / w.norm()).item() for n, w in want.items()) < 2e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_over_dp_of_a_tensor_parallel_model_equals_one_process(stage):
    """Sequence parallelism (Partial norm gradients), a vocab-sharded embedding (37 rows over 2 tp
    ranks: 19 and 18), clipping at every step: parameters and norms as one process's; the state
    the ranks hold as the planner's --tp formulas say."""
    results = launch("pool", 4).run(_train, stage, 1, 0.5, False, 25)
    for out in results:
        assert out["err"] < 2e-5, out["err"]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(out["norms"], out["ref_norms"])), out
    _check_plan(results)


def test_accumulation_loss_parallel_torch_clip_sgd_and_bf16():
    """no_sync() micro-batches with torch's clip_grad_norm_ over the DTensor parameters (the
    global norm, every element once: FSDP2 + TP raises here), at stage 2 with buckets of 2 KB
    that split tensors and torch's SGD with momentum as the optimizer_class, and at stage 3
    with loss parallelism (the logits split over the vocabulary); then bf16 parameters (fp32
    masters) within bf16's rounding."""
    for args in ((2, 2, 0.5, True, 2 / 1024, torch.float32, True), (3, 2, 0.5, True, 25, torch.float32, False, True)):
        for out in launch("pool", 4).run(_train, *args):
            assert out["err"] < 2e-5, (args, out["err"])
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(out["norms"], out["ref_norms"])), out
    for out in launch("pool", 4).run(_train, 1, 1, None, False, 25, torch.bfloat16):
        assert out["err"] < 3e-2, out["err"]
        assert all(math.isclose(a, b, rel_tol=3e-2) for a, b in zip(out["norms"], out["ref_norms"])), out


def _skips_and_refusals(tmp: str):
    """GradScaler skips everywhere on an overflow on one rank; what is not supported yet is
    refused, saying so."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize(GPT(), mesh["tp"])
    opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=2, device_mesh=mesh["dp"])
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.full_tensor() for p in model.parameters()]
    if dist.get_rank() == 3:  # an overflow in one tp piece on one rank (dp 1, tp 1), before reduction
        model.blocks[0].up.weight.register_hook(lambda g: g * float("inf"))
    scaler.scale(loss_of(model, *batch(0, mesh["dp"].get_local_rank(), "cpu"))).backward()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() == 2.0 and all(
        torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters())
    )
    msgs = Refusals()
    catch = msgs.catch
    catch("model_only", lambda: zs.save_checkpoint(os.path.join(tmp, "tp"), model))  # (its optimizer left out)
    catch("dcp", lambda: zs.checkpoint.dcp_state_dict(model, opt))
    catch("state_dict", opt.state_dict)
    catch("fully_shard", lambda: zs.FullyShard(parallelize(GPT(), mesh["tp"])))  # (over every rank)
    net = parallelize(GPT(), mesh["tp"])
    sgd = zs.ShardedOptimizer(
        net.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9, device_mesh=mesh["dp"], stage=2
    )
    catch("sgd_save", lambda: zs.save_checkpoint(os.path.join(tmp, "sgd"), net, sgd))
    catch("world", lambda: zs.ShardedOptimizer(parallelize(GPT(), mesh["tp"]).parameters()))
    mats = [p for p in parallelize(GPT(), mesh["tp"]).parameters() if p.dim() == 2]
    catch("muon", lambda: zs.ShardedOptimizer(mats, optimizer_class=torch.optim.Muon, device_mesh=mesh["dp"], stage=2))
    return skipped, dict(msgs)


def test_grad_scaler_skips_everywhere_and_what_is_not_supported_yet_is_refused(tmp_path):
    want = {
        "model_only": ("'embed.weight' is tensor-parallel", "no ShardedOptimizer steps it"),
        "dcp": ("tensor-parallel model is not supported yet", "save_checkpoint"),
        "state_dict": ("tensor-parallel",),
        "sgd_save": ("SGD's is not supported yet",),
        "fully_shard": ("share ranks", "FullyShard(model, device_mesh=mesh['dp'])"),
        "world": ("share ranks", "device_mesh=mesh['dp']"),
        "muon": ("whole-tensor optimizer", "tp pieces"),
    }
    for skipped, msgs in launch("pool", 4).run(_skips_and_refusals, str(tmp_path)):
        assert skipped
        for key, parts in want.items():
            assert all(part in msgs.get(key, "") for part in parts), (key, msgs.get(key))


def _norm_with_a_plain_parameter():
    """A plain parameter beside the DTensors (the same on every tp rank): the total norm counts it
    once, as the norm of the gradients read whole says. (our norm, the whole gradients' norm)"""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model, scale = parallelize(GPT(), mesh["tp"]), torch.nn.Parameter(torch.full((V,), 1.5))
    params = list(model.parameters()) + [scale]
    opt = zs.ShardedOptimizer(params, lr=1e-2, stage=2, device_mesh=mesh["dp"])
    x, y = batch(0, mesh["dp"].get_local_rank(), "cpu")
    torch.nn.functional.cross_entropy((model(x) * scale).reshape(-1, V), y.reshape(-1)).backward()
    whole = torch.stack([p.grad.full_tensor().norm() for p in params]).norm()  # (collective reads)
    return float(opt.clip_grad_norm_(math.inf)), float(whole)


def test_a_plain_parameter_beside_the_dtensors_is_counted_once():
    for ours, whole in launch("pool", 4).run(_norm_with_a_plain_parameter):
        assert math.isclose(ours, whole, rel_tol=1e-5), (ours, whole)


def _runs_cover_the_local_pieces():
    """Placed.runs: every range of every rank's flattened local piece, as ranges of the global
    tensor, holds the same elements (3 tp ranks: uneven and empty pieces); the mismatches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from zeroshard.core.tensor_parallel import placed_of

    mesh, bad = init_device_mesh("cpu", (3,)), 0
    for shape, pl in [
        ((11, 3), Shard(0)),
        ((3, 10), Shard(1)),
        ((2, 5, 3), Shard(1)),
        ((2, 3, 5), Shard(2)),
        ((4, 3), Replicate()),
        ((2, 2), Shard(1)),
        ((7,), Shard(0)),
    ]:
        g = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        dt = distribute_tensor(g, mesh, [pl])
        local, placed = dt.to_local().reshape(-1), placed_of(dt)
        for s in range(local.numel()):
            for n in range(local.numel() - s + 1):
                runs = placed.runs(s, n)
                bad += sum(r[2] for r in runs) != n
                bad += sum(not torch.equal(g.reshape(-1)[a : a + k], local[s + o : s + o + k]) for a, o, k in runs)
    return bad


def test_a_local_piece_maps_onto_the_global_tensor():
    assert launch("pool", 3).run(_runs_cover_the_local_pieces) == [0, 0, 0]
