"""ShardedOptimizer by torch's own optimizer semantics, against DDP + the same torch optimizer at
world sizes 1, 2 and 3: a step with no gradient is a no-op, step() passes keyword arguments to
the class (whose step() is never called while building), the class's param-group keys are
visible, sparse parameters and gradients are refused by name, and torch's Join over uneven
inputs ends as DDP + Join does."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from support.launch import launch

# one rank and three (uneven chunks); two ranks as well cost about 16 s a run of the suite
WORLDS = pytest.mark.parametrize("world", [1, 3], ids=lambda n: f"world{n}")


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(6, 7, generator=g)
    r, w = dist.get_rank(), dist.get_world_size()
    return x[r * 6 // w : (r + 1) * 6 // w]


def _no_gradient_steps(stage):
    """Every other iteration steps with no backward since zero_grad() (a gradient-accumulation
    loop written that way); the LR scheduler steps every iteration."""
    model = make()
    if stage == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    elif stage == 3:
        model = zs.FullyShard(model, wrap={nn.Linear})
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.05)
    else:
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.05, stage=stage)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for it in range(6):
        opt.zero_grad()
        if it % 2 == 0:
            model(batch(it)).square().mean().backward()
        opt.step()
        sched.step()
    sd = (model.module if stage == "ddp" else model).state_dict()
    return {k: v.clone() for k, v in sd.items()}, opt.param_groups[0]["lr"]


@WORLDS
def test_a_step_with_no_gradient_is_a_noop(world):
    pool = launch("pool", world)
    ref = pool.run(_no_gradient_steps, "ddp")
    for stage in (1, 2, 3):
        for (sd, lr), (rsd, rlr) in zip(pool.run(_no_gradient_steps, stage), ref):
            assert lr == rlr
            assert max((sd[k] - v).abs().max().item() for k, v in rsd.items()) < 1e-5, stage


class ScaledSGD(torch.optim.SGD):
    """An elementwise class whose step needs a keyword argument and whose __init__ adds a key
    of its own to every param group."""

    steps_called = 0

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr)
        for g in self.param_groups:
            g.setdefault("tag", "scaled")

    @torch.no_grad()
    def step(self, closure=None, *, scale):
        type(self).steps_called += 1
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] * scale)


def _kwargs_and_keys(stage):
    model = make()
    ScaledSGD.steps_called = 0
    if stage == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        opt = ScaledSGD(model.parameters(), lr=0.1)
    else:
        if stage == 3:
            model = zs.FullyShard(model, wrap={nn.Linear})
        opt = zs.ShardedOptimizer(
            model.parameters(),
            lr=0.1,
            optimizer_class=ScaledSGD,
            elementwise=True,
            **({} if stage == 3 else {"stage": stage}),
        )
    built_steps = ScaledSGD.steps_called
    tag = opt.param_groups[0]["tag"]
    for it in range(3):
        model(batch(it)).square().mean().backward()
        opt.step(scale=0.5 + it)
        opt.zero_grad()
    sd = (model.module if stage == "ddp" else model).state_dict()
    return {k: v.clone() for k, v in sd.items()}, built_steps, tag


@WORLDS
def test_step_keyword_arguments_reach_the_class_and_its_group_keys_are_visible(world):
    pool = launch("pool", world)
    ref = pool.run(_kwargs_and_keys, "ddp")
    for stage in (1, 2, 3):
        for (sd, built_steps, tag), (rsd, _, rtag) in zip(pool.run(_kwargs_and_keys, stage), ref):
            assert built_steps == 0, stage  # construction never calls the class's step()
            assert tag == rtag == "scaled"
            assert max((sd[k] - v).abs().max().item() for k, v in rsd.items()) < 1e-6, stage


def _fused_refuses_step_kwargs():
    opt = zs.ShardedOptimizer(make().parameters(), lr=0.1)
    try:
        opt.step(scale=2.0)
    except TypeError as e:
        return str(e)
    return "no error"


def _sparse():
    out = {}
    try:
        zs.ShardedOptimizer([nn.Parameter(torch.eye(3).to_sparse())], lr=0.1)
    except ValueError as e:
        out["param"] = str(e)
    emb = nn.Embedding(11, 4, sparse=True)
    opt = zs.ShardedOptimizer(emb.parameters(), lr=0.1)
    try:
        emb(torch.tensor([1, 2])).sum().backward()
    except RuntimeError as e:
        out["grad"] = str(e)
    del opt
    try:
        zs.FullyShard(nn.Sequential(nn.Embedding(11, 4, sparse=True), nn.Linear(4, 2)))
    except ValueError as e:
        out["fully_shard"] = str(e)
    # a tensor-parallel model's parameter (a DTensor): refused, never flattened as if whole
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = nn.Linear(4, 6)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), init_device_mesh("cpu", (2,)), [Shard(0)]))
    for kind, build in (
        ("dtensor", lambda: zs.ShardedOptimizer(tp.parameters(), lr=0.1, stage=2)),
        ("dtensor_fully_shard", lambda: zs.FullyShard(nn.Sequential(tp))),
    ):
        try:
            build()
        except ValueError as e:
            out[kind] = str(e)
    return out


def test_sparse_parameters_and_gradients_are_refused_by_name():
    pool = launch("pool", 2)
    for r in pool.run(_sparse):
        assert "parameter 0" in r["param"] and "sparse" in r["param"], r
        assert "parameter 0" in r["grad"] and "sparse=False" in r["grad"], r
        assert "'0'" in r["fully_shard"] and "sparse=False" in r["fully_shard"], r
        # (its mesh is the ranks the optimizer would shard over: the other axis is the fix)
        assert "share ranks" in r["dtensor"] and "device_mesh=mesh['dp']" in r["dtensor"], r
        assert "share ranks" in r["dtensor_fully_shard"] and "device_mesh=mesh['dp']" in r["dtensor_fully_shard"], r
    for msg in pool.run(_fused_refuses_step_kwargs):
        assert "keyword arguments ['scale']" in msg, msg


def _hyper_round_trip(stage, kwargs):
    """Train, save the state dict, load it into a fresh optimizer over the same model, train on:
    the saved hyperparameters (amsgrad, maximize) come back and the run ends as DDP's."""
    model = make()
    if stage == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        build = lambda: torch.optim.AdamW(model.parameters(), lr=0.05, **kwargs)  # noqa: E731
    else:
        if stage == 3:
            model = zs.FullyShard(model, wrap={nn.Linear})
        extra = {} if stage == 3 else {"stage": stage}
        build = lambda: zs.ShardedOptimizer(model.parameters(), lr=0.05, **kwargs, **extra)  # noqa: E731
    opt = build()
    for it in range(4):
        if it == 2:
            sd = opt.state_dict()
            del opt  # (zeroshard refuses two live optimizers over one parameter)
            opt = build()
            opt.load_state_dict(sd)
        model(batch(it)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    flags = {k: opt.param_groups[0][k] for k in kwargs}
    sd = (model.module if stage == "ddp" else model).state_dict()
    return {k: v.clone() for k, v in sd.items()}, flags


@WORLDS
@pytest.mark.parametrize("kwargs", [{"amsgrad": True}, {"maximize": True}], ids=lambda k: next(iter(k)))
def test_hyperparameters_the_optimizer_runs_round_trip_through_its_state_dict(world, kwargs):
    pool = launch("pool", world)
    ref = pool.run(_hyper_round_trip, "ddp", kwargs)
    for stage in (1, 2, 3):
        for (sd, flags), (rsd, _) in zip(pool.run(_hyper_round_trip, stage, kwargs), ref):
            assert flags == kwargs, (stage, flags)
            assert max((sd[k] - v).abs().max().item() for k, v in rsd.items()) < 1e-5, stage


class WithNorm(nn.Module):
    """A model with buffers (BatchNorm's running statistics): DDP and ShardedOptimizer
    broadcast them before each training forward, a collective the joined ranks shadow."""

    def __init__(self):
        super().__init__()
        # (no bias before the norm: its gradient is zero up to rounding, which AdamW would amplify)
        self.inp, self.norm, self.out = nn.Linear(7, 13, bias=False), nn.BatchNorm1d(13), nn.Linear(13, 5)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _uneven(stage, buffers):
    """Rank r trains on 2 + 2r batches inside torch's Join (the others shadow the rest)."""
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    model = WithNorm() if buffers else make()
    if stage == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        opt, joinables = torch.optim.AdamW(model.parameters(), lr=0.05), [net]
    elif stage == 3:
        net = model = zs.FullyShard(model, wrap={nn.Linear})
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.05)
        joinables = [opt]
    else:
        net = model
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.05, stage=stage, bucket_mb=0.0002)
        joinables = [opt]
    with Join(joinables):
        for it in range(2 + 2 * dist.get_rank()):
            opt.zero_grad()
            x = torch.randn(8, 7, generator=torch.Generator().manual_seed(1000 * dist.get_rank() + it))
            net(x).square().mean().backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world,buffers", [(2, False), (3, True)], ids=["world2-plain", "world3-buffers"])
def test_uneven_inputs_under_join_end_as_ddp_does(world, buffers):
    """torch's Join([opt]) over ranks with different numbers of batches finishes (no hang) with
    DDP + Join's parameters and buffers on every rank, at stages 1 and 2; at ZeRO-3 DDP's
    parameters (a FullyShard model broadcasts its buffers once, at wrapping, as FSDP2)."""
    pool = launch("pool", world)
    ref = pool.run(_uneven, "ddp", buffers)[-1]  # the last rank to join trained every iteration
    for stage in (1, 2, 3):
        for rank, sd in enumerate(pool.run(_uneven, stage, buffers)):
            assert sd.keys() == ref.keys()
            keys = [k for k in ref if stage != 3 or "running" not in k and "tracked" not in k]
            err = max((sd[k].double() - ref[k].double()).abs().max().item() for k in keys)
            assert err < 1e-5, (stage, rank, err)


def _join_with_two_models():
    from torch.distributed.algorithms.join import Join

    a, b = zs.FullyShard(make(), wrap={nn.Linear}), zs.FullyShard(make(1), wrap={nn.Linear})
    opt = zs.ShardedOptimizer(list(a.parameters()) + list(b.parameters()), lr=0.05)
    try:
        with Join([opt]):
            pass
    except NotImplementedError as e:
        return str(e)
    return None


def test_join_over_two_fully_shard_models_is_refused_by_name():
    for msg in launch("pool", 2).run(_join_with_two_models):
        assert msg is not None and "2 FullyShard models" in msg and "DistributedSampler" in msg, msg


def _grad_reads(stage):
    """What a script reads off p.grad after a backward: every read gives DDP's value."""
    model = make()
    if stage == "ddp":
        net, opt = nn.parallel.DistributedDataParallel(model), None
    elif stage == 3:
        net = model = zs.FullyShard(model, wrap={nn.Linear})
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.05)
    else:
        net = model
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.05, stage=stage, bucket_mb=0.0002)
    net(batch(0)).square().mean().backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = {
            "clone": g.clone(),
            "abs_max": g.abs().max(),
            "positive": (g > 0),
            "equal_self": torch.equal(g, g.clone()),
            "allclose_zero": torch.allclose(g, torch.zeros_like(g.clone())),
            "finite": torch.isfinite(g).all(),
            "sum": g.sum(),
            "norm": g.norm(),
            "scaled": g * 2 - 1,
            "first": g.reshape(-1)[0].item(),
        }
        torch.testing.assert_close(g, g.clone())  # (a subclass compared with its own values)
    del opt  # (alive to here: an optimizer dropped before the backward's end puts no placeholder in p.grad)
    return out


@WORLDS
def test_reading_p_grad_gives_ddps_values(world):
    pool = launch("pool", world)
    ref = pool.run(_grad_reads, "ddp")
    for stage in (1, 2, 3):
        for ours, theirs in zip(pool.run(_grad_reads, stage), ref):
            for name, reads in theirs.items():
                for k, v in reads.items():
                    got = ours[name][k]
                    if isinstance(v, torch.Tensor):
                        assert got.shape == v.shape and got.dtype == v.dtype, (stage, name, k)
                        assert torch.allclose(got.double(), v.double(), atol=1e-6, rtol=1e-5), (stage, name, k)
                    else:
                        assert got == v or abs(got - v) < 1e-6, (stage, name, k, got, v)


ELEMENTWISE_CASES = {
    "adamw-amsgrad-maximize": (torch.optim.AdamW, dict(amsgrad=True, maximize=True)),
    "sgd-momentum": (torch.optim.SGD, dict(momentum=0.9, nesterov=True)),
    "nadam": (torch.optim.NAdam, dict(decoupled_weight_decay=True, weight_decay=0.1)),
}


def _elementwise_run(case, stage, path, phase):
    """Six steps of the case's optimizer: DDP + the torch class ("ddp"), or zeroshard at
    ``stage`` saving after three ("save") or loading that checkpoint into a model and
    optimizer of other initial values and training the last three ("resume")."""
    cls, kwargs = ELEMENTWISE_CASES[case]
    model = make(seed=7 if phase == "resume" else 0)
    if stage == "ddp":
        net, opt = nn.parallel.DistributedDataParallel(model), cls(model.parameters(), lr=0.05, **kwargs)
    else:
        net = model = zs.FullyShard(model, wrap={nn.Linear}) if stage == 3 else model
        extra = {} if stage == 3 else {"stage": stage, "bucket_mb": 0.0002}
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.05, optimizer_class=cls, **kwargs, **extra)
    steps = range(6) if phase == "ddp" else range(3) if phase == "save" else range(3, 6)
    if phase == "resume":
        zs.load_checkpoint(path, model, opt)
    for it in steps:
        opt.zero_grad()
        net(batch(it)).square().mean().backward()
        opt.step()
    if phase == "save":
        zs.save_checkpoint(path, model, opt)
    return {k: v.clone() for k, v in model.state_dict().items()}, {k: opt.param_groups[0][k] for k in kwargs}


def _fused_loads(path):
    model = make()
    try:
        zs.load_checkpoint(path, model, zs.ShardedOptimizer(model.parameters(), lr=0.05))
    except zs.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", sorted(ELEMENTWISE_CASES))
def test_an_elementwise_optimizers_checkpoint_resumes_at_another_world_size_and_stage(tmp_path, case):
    """Saved at world 2 (stage 2 or ZeRO-3), resumed at world 3 (ZeRO-3 or stage 1): the class's
    whole state (per-element keys and scalars) and its hyperparameters come back, and the run
    ends as DDP + the same class uninterrupted."""
    ref, _ = launch("pool", 2).run(_elementwise_run, case, "ddp", None, "ddp")[0]
    for saved_at, resumed_at in ((2, 3), (3, 1)):
        path = str(tmp_path / f"ckpt{saved_at}")
        launch("pool", 2).run(_elementwise_run, case, saved_at, path, "save")
        for sd, flags in launch("pool", 3).run(_elementwise_run, case, resumed_at, path, "resume"):
            assert flags == ELEMENTWISE_CASES[case][1], flags
            err = max((sd[k] - v).abs().max().item() for k, v in ref.items())
            assert err < 1e-5, (saved_at, resumed_at, err)
    if case.startswith("adamw"):  # the fused AdamW cannot run it: refused before anything is read
        for msg in launch("pool", 2).run(_fused_loads, str(tmp_path / "ckpt2")):
            assert msg is not None and "amsgrad=True and maximize=True" in msg, msg


def _buffers_at_construction(how):
    """Each rank's BatchNorm statistics differ; right after the wrapper or optimizer is
    built (no forward yet), what each rank holds."""
    torch.manual_seed(0)
    model = WithNorm()
    with torch.no_grad():
        model.norm.running_mean.fill_(float(dist.get_rank() + 1))
        model.norm.num_batches_tracked.fill_(dist.get_rank())
    if how == "ddp":
        keep = nn.parallel.DistributedDataParallel(model)
    elif how == "fully_shard":
        keep = zs.FullyShard(model, wrap={nn.Linear})
    elif how == "groups":
        keep = zs.ShardedOptimizer(
            [
                {"params": model.inp.parameters()},
                {"params": model.out.parameters(), "lr": 0.1},
                {"params": model.norm.parameters()},
            ],
            lr=0.05,
            stage=1,
        )
    else:
        keep = zs.ShardedOptimizer(model.parameters(), lr=0.05, stage=2)
    out = {k: v.clone() for k, v in model.named_buffers()}
    del keep
    return out


@pytest.mark.parametrize("world", [2, 3], ids=lambda n: f"world{n}")
def test_buffers_are_rank_zeros_once_the_optimizer_is_built(world):
    """As DDP's constructor: ShardedOptimizer over model.parameters() (or param groups of
    submodules' generators) and FullyShard make every rank's buffers rank 0's before any forward."""
    pool = launch("pool", world)
    ref = pool.run(_buffers_at_construction, "ddp")
    assert all(r["norm.running_mean"].eq(1).all() for r in ref)
    for how in ("params", "groups", "fully_shard"):
        for got, want in zip(pool.run(_buffers_at_construction, how), ref):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], v) for k, v in want.items()), how


class Headed(nn.Module):
    """A body, a head added to the optimizer later, and a bf16-free tail frozen at first."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.tail = nn.Linear(7, 13), nn.Linear(13, 11), nn.Linear(11, 5)

    def forward(self, x):
        return self.tail(torch.tanh(self.head(torch.tanh(self.body(x)))))


def _new_params(stage, cls):
    """Iterations 0-1 train the body (the tail frozen, in the optimizer); at 2 the head joins by
    add_param_group (lr 0.02); at 4 the tail is unfrozen, before zero_grad() (ZeRO-3: after it,
    so its next forward lays it out). Eight iterations."""
    torch.manual_seed(0)
    model = Headed()
    model.tail.requires_grad_(False)
    kw = dict(lr=0.05, **({} if cls is torch.optim.AdamW else {"momentum": 0.9}))
    groups = [{"params": list(model.body.parameters()) + list(model.tail.parameters())}]
    if stage == "ddp":
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = cls(groups, **kw)
    else:
        net = model = zs.FullyShard(model, wrap={nn.Linear}) if stage == 3 else model
        if stage == 3:
            groups = [{"params": list(model.body.parameters()) + list(model.tail.parameters())}]
        extra = {} if stage == 3 else {"stage": stage, "bucket_mb": 0.0002}
        opt = zs.ShardedOptimizer(groups, optimizer_class=None if cls is torch.optim.AdamW else cls, **kw, **extra)
    for it in range(8):
        if it == 2:
            opt.add_param_group({"params": model.head.parameters(), "lr": 0.02})
        if it == 4 and stage != 3:
            model.tail.requires_grad_(True)
            if stage == "ddp":  # (DDP averages only what was trainable when it was built)
                net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt.zero_grad()
        if it == 4 and stage == 3:  # (after zero_grad(): the forward lays its unit out again)
            model.tail.requires_grad_(True)
        net(batch(it)).square().mean().backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, [g["lr"] for g in opt.param_groups]


@WORLDS
def test_add_param_group_and_unfreezing_train_as_torchs_optimizer(world):
    """A group added after construction is laid out, sharded and stepped from the next step, and
    a parameter frozen at construction trains once unfrozen (laid out by zero_grad()), at
    stages 1, 2 and 3, with the fused AdamW and with SGD: as DDP + the torch optimizer."""
    pool = launch("pool", world)
    for cls in (torch.optim.AdamW, torch.optim.SGD):
        ref = pool.run(_new_params, "ddp", cls)
        for stage in (1, 2, 3):
            for (sd, lrs), (rsd, rlrs) in zip(pool.run(_new_params, stage, cls), ref):
                assert lrs == rlrs == [0.05, 0.02]
                err = max((sd[k] - v).abs().max().item() for k, v in rsd.items())
                assert err < 1e-5, (cls.__name__, stage, err)


def _carried(stage, cls, path):
    from zeroshard.checkpoint import read_full_state_dict

    """bf16 parameters, tiny buckets: the fp32 masters (read from a checkpoint) and the full
    optimizer state of the first group, before and after add_param_group; the new group's
    parameters (different on each rank) after it."""
    torch.manual_seed(0)
    model = Headed().to(torch.bfloat16)
    kw = {} if cls is None else {"optimizer_class": cls, "momentum": 0.9}
    opt = zs.ShardedOptimizer(
        [{"params": model.body.parameters()}, {"params": model.tail.parameters()}],
        lr=0.05,
        stage=stage,
        bucket_mb=0.0001,
        **kw,
    )
    for it in range(2):
        opt.zero_grad()
        model(batch(it).bfloat16()).float().square().mean().backward()
        opt.step()
    seen = []
    for k in range(2):
        if k == 1:
            with torch.no_grad():
                model.head.weight.fill_(float(dist.get_rank()))
            opt.add_param_group({"params": model.head.parameters(), "lr": 0.02})
        zs.save_checkpoint(f"{path}{k}", model, opt)
        sd = opt.state_dict()
        seen.append(
            (
                {n: t.tolist() for n, t in read_full_state_dict(f"{path}{k}", torch.float32)},
                {
                    i: {key: torch.as_tensor(v).tolist() for key, v in st.items()}
                    for i, st in sd["state"].items()
                    if i < 4
                },
            )
        )
    return seen, model.head.weight.float().tolist()  # (lists: many small tensors cost the pool a descriptor each)


@pytest.mark.parametrize("stage", [1, 2])
def test_add_param_group_carries_the_masters_and_state_exactly(tmp_path, stage):
    """What the first groups hold (fp32 masters of bf16 parameters, the AdamW or SGD state)
    is bit-identical after add_param_group re-lays everything out; the new group's
    parameters are rank 0's on every rank, as DDP's constructor makes them."""
    for cls in (None, torch.optim.SGD):
        for rank, ((before, after), head) in enumerate(
            launch("pool", 3).run(_carried, stage, cls, str(tmp_path / f"c{stage}{cls is None}"))
        ):
            (mb, sb), (ma, sa) = before, after
            for name in ("body.weight", "body.bias", "tail.weight", "tail.bias"):
                assert mb[name] == ma[name], (cls, name)
            assert sb.keys() == sa.keys() and len(sb) == 4
            assert sb == sa, cls
            assert torch.tensor(head).eq(0).all(), rank
