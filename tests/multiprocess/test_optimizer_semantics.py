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
from conftest import get_pool

WORLDS = pytest.mark.parametrize("world", [1, 2, 3], ids=lambda n: f"world{n}")


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(6, 7, generator=g)
    r, w = dist.get_rank(), dist.get_world_size()
    return x[r * 6 // w:(r + 1) * 6 // w]


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
    pool = get_pool(world)
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
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.1, optimizer_class=ScaledSGD, elementwise=True,
                                  **({} if stage == 3 else {"stage": stage}))
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
    pool = get_pool(world)
    ref = pool.run(_kwargs_and_keys, "ddp")
    for stage in (1, 2, 3):
        for (sd, built_steps, tag), (rsd, _, rtag) in zip(pool.run(_kwargs_and_keys, stage), ref):
            assert built_steps == 0, stage          # construction never calls the class's step()
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
    return out


def test_sparse_parameters_and_gradients_are_refused_by_name():
    pool = get_pool(2)
    for r in pool.run(_sparse):
        assert "parameter 0" in r["param"] and "sparse" in r["param"], r
        assert "parameter 0" in r["grad"] and "sparse=False" in r["grad"], r
        assert "'0'" in r["fully_shard"] and "sparse=False" in r["fully_shard"], r
    for msg in pool.run(_fused_refuses_step_kwargs):
        assert "keyword arguments ['scale']" in msg, msg


def _hyper_round_trip(stage, kwargs):
    """Train, save the state dict, load it into a fresh optimizer over the same model, train on:
    the saved hyperparameters (amsgrad, maximize) come back and the run ends as DDP's."""
    model = make()
    if stage == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        build = lambda: torch.optim.AdamW(model.parameters(), lr=0.05, **kwargs)   # noqa: E731
    else:
        if stage == 3:
            model = zs.FullyShard(model, wrap={nn.Linear})
        extra = {} if stage == 3 else {"stage": stage}
        build = lambda: zs.ShardedOptimizer(model.parameters(), lr=0.05, **kwargs, **extra)   # noqa: E731
    opt = build()
    for it in range(4):
        if it == 2:
            sd = opt.state_dict()
            del opt                          # (zeroshard refuses two live optimizers over one parameter)
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
    pool = get_pool(world)
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
    DDP + Join's parameters and buffers on every rank, at stages 1 and 2."""
    pool = get_pool(world)
    ref = pool.run(_uneven, "ddp", buffers)[-1]       # the last rank to join trained every iteration
    for stage in (1, 2):
        for rank, sd in enumerate(pool.run(_uneven, stage, buffers)):
            assert sd.keys() == ref.keys()
            err = max((sd[k].double() - v.double()).abs().max().item() for k, v in ref.items())
            assert err < 1e-5, (stage, rank, err)


def _join_with_fully_shard():
    from torch.distributed.algorithms.join import Join
    model = zs.FullyShard(make(), wrap={nn.Linear})
    opt = zs.ShardedOptimizer(model.parameters(), lr=0.05)
    try:
        with Join([opt]):
            pass
    except NotImplementedError as e:
        return str(e)
    return None


def test_join_with_fully_shard_parameters_is_refused_by_name():
    for msg in get_pool(2).run(_join_with_fully_shard):
        assert msg is not None and "Join with FullyShard" in msg and "DistributedSampler" in msg, msg


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
            "clone": g.clone(), "abs_max": g.abs().max(), "positive": (g > 0), "equal_self": torch.equal(g, g.clone()),
            "allclose_zero": torch.allclose(g, torch.zeros_like(g.clone())), "finite": torch.isfinite(g).all(),
            "sum": g.sum(), "norm": g.norm(), "scaled": g * 2 - 1, "first": g.reshape(-1)[0].item()}
        torch.testing.assert_close(g, g.clone())      # (a subclass compared with its own values)
    del opt     # (alive to here: an optimizer dropped before the backward's end puts no placeholder in p.grad)
    return out


@WORLDS
def test_reading_p_grad_gives_ddps_values(world):
    pool = get_pool(world)
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
