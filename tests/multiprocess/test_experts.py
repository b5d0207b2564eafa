"""Expert parallelism at stages 1/2: a mixture-of-experts model whose experts are spread
over the ranks of an expert-parallel group (each rank its own experts, tokens exchanged
with the other ranks of its ep group), the experts in a param group sharded over their
expert-data-parallel group (``"device_mesh": mesh["edp"]``), against one process training
the whole model on the whole batch with torch's AdamW. 4 gloo ranks: edp 2 x ep 2."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from support.checks import Refusals
from support.launch import launch
from zeroshard.plan import model_state_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
from moe import E, TOKENS, Expert, Net, global_name, split  # (examples/moe.py's model)

STEPS = 3


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, 5, generator=g), torch.randn(TOKENS, 3, generator=g)


def _reference(top_k: int, world: int, micro: int, clip, starve: bool, steps: int = STEPS):
    """One process, every expert, every rank's tokens: parameters and clip norms after ``steps``."""
    torch.manual_seed(0)
    model = Net(top_k, call_every_expert=not starve)
    model.moe.unrouted = [E - 1] if starve else []  # the last expert never gets a token
    dense, experts = split(model)
    opt = torch.optim.AdamW([{"params": dense}, {"params": experts, "weight_decay": 0.3}], lr=1e-2)
    norms, first = [], None
    for step in range(steps):
        for m in range(micro):
            xs, ys = zip(*(_data(step * micro + m, r) for r in range(world)))
            (F.mse_loss(model(torch.cat(xs)), torch.cat(ys)) / micro).backward()
        first = first or {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return model, norms, first


def _train(stage: int, top_k: int, ep: int, micro: int = 1, clip=None, starve: bool = False, torch_clip=False):
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    ref, ref_norms, ref_grads = _reference(top_k, world, micro, clip, starve)
    torch.manual_seed(0)
    full = Net(top_k, call_every_expert=not starve)
    net = model = Net(top_k, mesh["ep"].get_group(), call_every_expert=not starve)
    net.moe.unrouted = [E - 1] if starve else []
    with torch.no_grad():  # the whole model's values: this rank's experts among them
        for name, p in model.named_parameters():
            p.copy_(full.get_parameter(global_name(net, name)))
    if stage == 3:  # each expert a unit over its edp group, the rest over every rank
        model = zs.FullyShard(net, expert_modules={Expert: mesh["edp"]})
        dense, experts = split(model)
        opt = zs.ShardedOptimizer([{"params": dense}, {"params": experts, "weight_decay": 0.3}], lr=1e-2)
    else:
        dense, experts = split(model)
        opt = zs.ShardedOptimizer(
            [{"params": dense}, {"params": experts, "weight_decay": 0.3, "device_mesh": mesh["edp"]}],
            lr=1e-2,
            stage=stage,
        )
    norms, grad_err = [], 0.0
    for step in range(STEPS):
        for m in range(micro):
            x, y = _data(step * micro + m, rank)
            ctx = opt.no_sync() if m < micro - 1 else torch.enable_grad()
            with ctx:
                (F.mse_loss(model(x), y) / micro).backward()
        for name, p in model.named_parameters() if step == 0 else ():
            # the averaged gradient one process takes: an expert's summed over its edp group
            # and divided by the whole data-parallel size (not its group's)
            # (a collective read: every rank reads each p.grad that is not None; an expert that got
            # no token has one where another ep group's expert at its place did, all zeros)
            want = ref_grads.get(global_name(net, name))
            got = p.grad.full_tensor() if p.grad is not None else None
            if got is not None and want is None:
                grad_err = max(grad_err, got.abs().max().item())
            elif got is not None:
                grad_err = max(grad_err, ((got - want).norm() / want.norm()).item())
        if clip:
            norms.append(
                float(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    if torch_clip
                    else opt.clip_grad_norm_(clip)
                )
            )
        opt.step()
        opt.zero_grad()
    err, moved = 0.0, False
    for name, p in model.state_dict().items():  # (FullyShard: gathered, each rank's own experts)
        q = ref.get_parameter(global_name(net, name))
        err = max(err, ((p - q).norm() / q.norm()).item())
        if global_name(net, name).startswith(f"moe.experts.{E - 1}."):  # the starved expert, where held
            moved = moved or not torch.equal(p, full.get_parameter(global_name(net, name)))
    rep = opt.memory_report()
    n_experts = sum(p.numel() for n, p in ref.named_parameters() if n.startswith("moe.experts."))
    n_dense = sum(p.numel() for n, p in ref.named_parameters() if not n.startswith("moe.experts."))
    return dict(
        err=err,
        grad_err=grad_err,
        norms=norms,
        ref_norms=ref_norms,
        rep=rep,
        psi=(n_dense, n_experts),
        moved=moved,
        starved_here=(E - 1) in net.moe.ids,
        stage=stage,
        ep=mesh["ep"].size(),
    )


def _check(results, clip=None):
    for r, out in enumerate(results):
        assert out["err"] < 2e-5 and out["grad_err"] < 1e-5, (r, out["err"], out["grad_err"])
        if clip:
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(out["norms"], out["ref_norms"])), out
    # each expert's state is held once in each ep group's ranks, sharded over its edp group:
    # over all ranks, exp_avg is 4 bytes per parameter of the whole model, exactly
    n_dense, n_experts = results[0]["psi"]
    assert sum(out["rep"]["exp_avg"] for out in results) == 4 * (n_dense + n_experts)
    # and the planner's formulas (python -m zeroshard.plan --ep --experts) say what the ranks hold
    # between them, category by category (fp32: params, grads, and exp_avg + exp_avg_sq)
    world, stage = len(results), results[0]["stage"]
    plan = model_state_bytes(n_dense + n_experts, world, "fp32", ep=results[0]["ep"], experts=n_experts)
    row = plan[f"ZeRO-{stage}"]
    held = {k: sum(out["rep"][k] for out in results) for k in ("params", "grads", "exp_avg", "exp_avg_sq", "master")}
    assert (held["params"], held["grads"]) == (world * row["params"], world * row["grads"]), (held, row)
    assert held["exp_avg"] + held["exp_avg_sq"] + held["master"] == world * row["optimizer"], (held, row)


@pytest.mark.parametrize("stage,top_k", [(1, 2), (2, 1), (3, 2)])
def test_expert_parallel_equals_one_process(stage, top_k):
    _check(launch("pool", 4).run(_train, stage, top_k, 2, clip=0.05), clip=0.05)


def test_accumulation_torch_clip_and_a_starved_expert():
    """no_sync() micro-batches; torch's clip_grad_norm_ (every expert counted once, the same
    on every rank); stage 2: an expert no rank routes a token to (and the model does not
    run) is not stepped, as torch's AdamW skips a parameter without a gradient."""
    res = launch("pool", 4).run(_train, 2, 1, 2, micro=2, clip=0.05, starve=True, torch_clip=True)
    _check(res, clip=0.05)
    held = [out["moved"] for out in res if out["starved_here"]]
    assert held and not any(held), held
    _check(launch("pool", 4).run(_train, 3, 1, 2, micro=2, clip=0.05, torch_clip=True), clip=0.05)


def _muon_over_experts(stage: int, adafactor: bool = False):
    """Muon (fp32 Newton-Schulz; or torch's Adafactor) over the experts' matrices (in a param
    group over the edp group; at stage 3 in FullyShard's expert units), AdamW over the rest,
    against one process doing the same over the whole model: the largest relative parameter
    difference, and the Muon state bytes this rank holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from support.optimizers import Muon32

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("edp", "ep"))

    def groups(model):
        dense, experts = split(model)
        return dense, [p for p in experts if p.dim() == 2], [p for p in experts if p.dim() != 2]

    torch.manual_seed(0)
    ref = Net(2)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    dense, mats, vecs = groups(ref)
    cls, kw = (
        (torch.optim.Adafactor, dict(lr=0.01))
        if adafactor
        else (Muon32, dict(lr=0.02, weight_decay=0.05, adjust_lr_fn="match_rms_adamw"))
    )
    ref_opts = [cls(mats, **kw), torch.optim.AdamW(dense + vecs, lr=1e-2)]
    net = Net(2, mesh["ep"].get_group())
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(start[global_name(net, name)])
    vouch = {} if adafactor else dict(whole_tensor=True)
    if stage == 3:  # each expert a unit over its edp group: its parameters carry their ranks
        model = zs.FullyShard(net, expert_modules={Expert: mesh["edp"]})
        dense, mats, vecs = groups(model)
        opts = [
            zs.ShardedOptimizer(mats, optimizer_class=cls, **vouch, **kw),
            zs.ShardedOptimizer(dense + vecs, lr=1e-2),
        ]
    else:
        model, (dense, mats, vecs), edp = net, groups(net), mesh["edp"]
        opts = [
            zs.ShardedOptimizer(
                [{"params": mats, "device_mesh": edp}], optimizer_class=cls, **vouch, **kw, stage=stage
            ),
            zs.ShardedOptimizer([{"params": dense}, {"params": vecs, "device_mesh": edp}], lr=1e-2, stage=stage),
        ]
    for step in range(STEPS):
        xs, ys = zip(*(_data(step, r) for r in range(world)))
        F.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        F.mse_loss(model(xs[rank]), ys[rank]).backward()
        for o in ref_opts + opts:
            o.step()
            o.zero_grad()
    err = max(
        ((p - ref.get_parameter(global_name(net, n))).norm() / p.norm()).item() for n, p in model.state_dict().items()
    )  # (FullyShard: each rank's own experts, whole)
    return err, opts[0].memory_report()["optimizer_state"]


@pytest.mark.parametrize("stage,adafactor", [(1, False), (2, False), (2, True), (3, False)])
def test_whole_tensor_optimizers_over_experts_equal_one_process(stage, adafactor):
    """Each expert matrix's owner is one of its edp group's ranks (stages 1/2: an expert param
    group; stage 3: FullyShard's expert units laid out again for those owners): every expert
    is stepped (and holds Muon's momentum) once in the job, and the model ends where one
    process's does (Muon, and torch's Adafactor)."""
    res = launch("pool", 4).run(_muon_over_experts, stage, adafactor)
    assert max(err for err, _ in res) < 2e-5, res
    whole = Net(2)
    if not adafactor:
        assert sum(b for _, b in res) == 4 * sum(
            p.numel() for n, p in whole.named_parameters() if n.startswith("moe.experts.") and p.dim() == 2
        )


def _expert_parallel(stage: int, ep: int, mesh_world: int, decay: float = 0.3):
    """A fresh model and optimizer at ``stage`` with ``ep`` ranks per expert-parallel group,
    its experts named as in the whole model (for checkpoints), weight decay ``decay`` on them."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (mesh_world // ep, ep), mesh_dim_names=("edp", "ep"))
    net = Net(2, mesh["ep"].get_group() if ep > 1 else None)
    if stage == 3:
        model = zs.FullyShard(net, expert_modules={Expert: mesh["edp"]}, expert_names=lambda n: global_name(net, n))
        dense, experts = split(model)
        return net, model, zs.ShardedOptimizer([{"params": dense}, {"params": experts, "weight_decay": decay}], lr=1e-2)
    named = [(global_name(net, n), p) for n, p in net.named_parameters()]  # (torch: every group named)
    dense = [e for e in named if not e[0].startswith("moe.experts.")]
    experts = [e for e in named if e[0].startswith("moe.experts.")]
    return (
        net,
        net,
        zs.ShardedOptimizer(
            [{"params": dense}, {"params": experts, "weight_decay": decay, "device_mesh": mesh["edp"]}],
            lr=1e-2,
            stage=stage,
        ),
    )


def _steps(model, steps, per_rank: int):
    """Train ``steps``, this rank's tokens those of ``per_rank`` consecutive ranks of 4."""
    rank = dist.get_rank()
    for step in steps:
        xs, ys = zip(*(_data(step, r) for r in range(rank * per_rank, (rank + 1) * per_rank)))
        F.mse_loss(model[0](torch.cat(xs)), torch.cat(ys)).backward()
        model[1].step()
        model[1].zero_grad()


def _error(net, model, ref) -> float:
    return max(
        ((p - ref.get_parameter(global_name(net, n))).norm() / p.norm()).item() for n, p in model.state_dict().items()
    )


def _checkpoint_across_layouts(tmp: str, save: bool, layouts):
    """Save after one step at stage 2, edp 2 x ep 2 (``save``), then for each (stage, ep) of
    ``layouts`` load it into a model of that layout over every rank and train the other steps:
    each ends where one process training the whole model does."""
    world = dist.get_world_size()
    ref = _reference(2, 4, 1, None, False)[0]
    torch.manual_seed(0)
    path, errors = os.path.join(tmp, "moe"), {}
    if save:
        start = Net(2)  # the reference's start (seed 0)
        net, model, opt = _expert_parallel(2, 2, world)
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(start.get_parameter(global_name(net, name)))
        _steps((model, opt), [0], 1)
        zs.save_checkpoint(path, model, opt)
    for stage, ep in layouts:
        net, model, opt = _expert_parallel(stage, ep, world, decay=0.0)  # (the checkpoint's: 0.3)
        zs.load_checkpoint(path, model, opt)
        _steps((model, opt), range(1, STEPS), 4 // world)
        errors[(stage, ep)] = _error(net, model, ref)
    return errors


def test_checkpoints_resume_at_another_expert_parallel_degree_and_world_size(tmp_path):
    """Saved at edp 2 x ep 2 (stage 2, its expert group's parameters named as in the whole
    model), loaded and trained on at ep 4 (one expert a rank; FullyShard with expert_names),
    ep 1 (every expert on every rank; stage 1), and on 2 ranks at ep 2 (stage 3): each ends
    where one process does; the export is the whole model's state dict."""
    from safetensors.torch import load_file

    for errors in launch("pool", 4).run(_checkpoint_across_layouts, str(tmp_path), True, [(3, 4), (1, 1)]):
        assert max(errors.values()) < 2e-5, errors
    for errors in launch("pool", 2).run(_checkpoint_across_layouts, str(tmp_path), False, [(3, 2)]):
        assert max(errors.values()) < 2e-5, errors
    zs.export_full_state_dict(tmp_path / "moe", tmp_path / "full.safetensors")
    full = load_file(str(tmp_path / "full.safetensors"))
    want = _reference(2, 4, 1, None, False, steps=1)[0].state_dict()
    assert set(full) == set(want)  # every expert once, under the whole model's names
    assert max(((full[n] - w).norm() / w.norm()).item() for n, w in want.items()) < 2e-5


def _stream_experts():
    """zeroshard.full_tensors of a FullyShard model with expert units (edp 2 x ep 2, experts
    named as in the whole model): the whole model's tensors, each expert once, on every rank
    (unit by unit) and on rank 1 only (parameter by parameter: a bucket smaller than any)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    whole = Net(2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    net = Net(2, mesh["ep"].get_group())
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(whole.get_parameter(global_name(net, name)))
    model = zs.FullyShard(net, expert_modules={Expert: mesh["edp"]}, expert_names=lambda n: global_name(net, n))
    want = whole.state_dict()
    out = []
    for kw in (dict(), dict(to=1, bucket_mb=100 / 2**20)):
        got = {n: t.clone() for n, t in zs.full_tensors(model, dtype=None, **kw)}
        if kw.get("to", dist.get_rank()) != dist.get_rank():
            out.append(got == {})
        else:
            out.append(sorted(got) == sorted(want) and all(torch.equal(got[n], w) for n, w in want.items()))
    return out


def test_full_tensors_streams_every_expert_under_its_whole_model_name():
    for rank, res in enumerate(launch("pool", 4).run(_stream_experts)):
        assert res == [True, True], (rank, res)


def _skips_everywhere():
    """GradScaler: a non-finite gradient in an expert held by one ep group skips the step on
    every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("edp", "ep"))
    torch.manual_seed(0)
    model = Net(1, mesh["ep"].get_group())
    dense, experts = split(model)
    opt = zs.ShardedOptimizer([{"params": dense}, {"params": experts, "device_mesh": mesh["edp"]}], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _data(0, rank)
    if rank == 3:  # an overflow in one expert's gradient on this rank only (before its reduction)
        model.moe.experts[0].up.weight.register_hook(lambda g: g * float("inf"))
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale(), all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_grad_scaler_skips_on_every_rank():
    for scale, unchanged in launch("pool", 4).run(_skips_everywhere):
        assert scale == 2.0 and unchanged


def _refusals(tmp):
    """What expert parallelism does not do yet is refused on every rank, saying so."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("edp", "ep"))
    msgs = Refusals()
    catch = msgs.catch
    net = Net(1, mesh["ep"].get_group())
    dense, experts = split(net)
    opt = zs.ShardedOptimizer([{"params": dense}, {"params": experts, "device_mesh": mesh["edp"]}], stage=2)
    catch("save2", lambda: zs.save_checkpoint(os.path.join(tmp, "a"), net, opt))  # (experts not named)
    catch("model_only", lambda: zs.save_checkpoint(os.path.join(tmp, "c"), net))
    catch("state_dict", opt.state_dict)
    catch(
        "hybrid",
        lambda: zs.ShardedOptimizer([{"params": Net(1).parameters(), "device_mesh": mesh["edp"]}], shard_size=2),
    )
    model = zs.FullyShard(Net(1, mesh["ep"].get_group()), expert_modules={Expert: mesh["edp"]})
    opt3 = zs.ShardedOptimizer(model.parameters())
    catch("save3", lambda: zs.save_checkpoint(os.path.join(tmp, "b"), model, opt3))
    catch("stream", lambda: list(zs.full_tensors(model)))  # (experts not named)
    net = Net(1, mesh["ep"].get_group())
    named = zs.FullyShard(net, expert_modules={Expert: mesh["edp"]}, expert_names=lambda n: global_name(net, n))
    catch("dcp", lambda: zs.checkpoint.dcp_state_dict(named, zs.ShardedOptimizer(named.parameters())))
    big = split(Net(1, mesh["ep"].get_group()))[1]  # an expert matrix larger than a bucket
    catch(
        "muon_split",
        lambda: zs.ShardedOptimizer(
            [{"params": [p for p in big if p.dim() == 2], "device_mesh": mesh["edp"]}],
            bucket_mb=40 / 2**20,
            optimizer_class=torch.optim.Muon,
            stage=2,
        ),
    )
    net = Net(1, mesh["ep"].get_group())
    net.moe.experts[0].up.weight.requires_grad_(False)  # frozen when wrapped, unfrozen after
    model = zs.FullyShard(net, expert_modules={Expert: mesh["edp"]})
    model.moe.experts[0].up.weight.requires_grad_(True)
    catch("thaw", lambda: model(torch.randn(3, 5)))
    return msgs


def test_what_is_not_supported_yet_is_refused(tmp_path):
    want = {
        "save2": ("moe.experts.0.up.weight", "(whole_model_name, p)"),
        "model_only": ("Pass that optimizer",),
        "state_dict": ("NotImplementedError", "own ranks"),
        "muon_split": ("larger than a bucket", "raise bucket_mb"),
        "hybrid": ("hybrid sharding",),
        "save3": ("moe.experts.0.up.weight", "expert_names=fn"),
        "stream": ("full_tensors", "moe.experts.0.up.weight", "expert_names=fn"),
        "dcp": ("not supported yet", "save_checkpoint"),
        "thaw": ("an expert unit over its own ranks",),
    }
    for msgs in launch("pool", 4).run(_refusals, str(tmp_path)):
        for key, parts in want.items():
            assert all(part in msgs.get(key, "") for part in parts), (key, msgs.get(key))
