"""``p.grad`` is what step() uses, at stages 1, 2 and 3, as under DDP + the same torch
optimizer: a parameter whose p.grad the script set to None after the backward is
skipped (no update, no weight decay, its state untouched) and counts in no norm; a
gradient assigned by hand is that parameter's averaged gradient, after a backward or
with none at all; ranks that set p.grad differently get an error before any parameter
moves. And torch's ZeroRedundancyOptimizer details: the closure and keyword arguments
reach optimizer_class's step, keys it adds to its param groups show in ours."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard as zs
from support.models import Residual

BATCH = 12
TINY_BUCKET_MB = 500 / 2**20  # buckets split tensors


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.layers = nn.Sequential(Residual(13), Residual(13))
        self.head = nn.Linear(13, 3)

    def forward(self, x):
        return self.head(self.layers(self.inp(x)))


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)),
}


def build(kind, opt_name, optimizer_class=None, vouch=False, **kw):
    torch.manual_seed(0)
    model = Net()
    cls, hyper = OPTIMIZERS[opt_name]
    hyper = dict(hyper, **kw)
    if kind == "ddp":
        return DDP(model), (optimizer_class or cls)(model.parameters(), **hyper)
    zs_cls = optimizer_class or (None if opt_name == "adamw" else cls)  # AdamW: the fused kernel
    if vouch:
        hyper["elementwise"] = True
    if kind == 3:
        model = zs.FullyShard(model, wrap={Residual})
        return model, zs.ShardedOptimizer(model.parameters(), optimizer_class=zs_cls, **hyper)
    return model, zs.ShardedOptimizer(
        model.parameters(), optimizer_class=zs_cls, stage=kind, bucket_mb=TINY_BUCKET_MB, **hyper
    )


def batches(steps):
    g = torch.Generator().manual_seed(5)
    n = BATCH // dist.get_world_size()
    r = dist.get_rank()
    return [
        (x[r * n : (r + 1) * n], y[r * n : (r + 1) * n])
        for x, y in (
            (torch.randn(BATCH, 7, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(steps)
        )
    ]


def named(kind, model):
    return dict((model.module if kind == "ddp" else model).named_parameters())


def final(kind, model):
    sd = model.state_dict() if kind == 3 else (model.module if kind == "ddp" else model).state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def script(kind, opt_name):
    """Dropped and assigned gradients, with torch's clip_grad_norm_ and the engine's."""
    model, opt = build(kind, opt_name)
    ps = named(kind, model)
    norms = []
    g = torch.Generator().manual_seed(11)
    for k, (x, y) in enumerate(batches(6)):
        opt.zero_grad()
        if k != 3:  # step 3: no backward at all, every gradient made by hand
            F.cross_entropy(model(x), y).backward()
        if k == 1:  # skip two parameters this step (a frozen-for-a-step schedule)
            ps["layers.0.fc.weight"].grad = None
            ps["head.bias"].grad = None
        if k == 2:  # one gradient replaced after reading it (the same on every rank)
            w = ps["layers.1.fc.weight"]
            w.grad = w.grad * 0.5 + 0.01 * torch.randn(w.shape, generator=g)
            ps["inp.bias"].grad = None
        if k == 3:  # half the parameters get a gradient, the rest stay None (skipped)
            for name in ("inp.weight", "layers.1.fc.bias", "head.weight"):
                ps[name].grad = 0.1 * torch.randn(ps[name].shape, generator=g)
        if k == 4 and kind != "ddp":  # the engine's clip after a drop
            ps["inp.weight"].grad = None
            norms.append(opt.clip_grad_norm_(0.3).item())
        elif k == 4:
            ps["inp.weight"].grad = None
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3).item())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3).item())
        opt.step()
    return norms, final(kind, model)


def _compare(stage, opt_name):
    (norms, ours), (ddp_norms, ddp) = script(stage, opt_name), script("ddp", opt_name)
    err = max(((ours[k] - ddp[k]).norm() / ddp[k].norm()).item() for k in ddp)
    norm_err = max(abs(a - b) / b for a, b in zip(norms, ddp_norms))
    return err, norm_err


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_p_grad_set_by_the_script_is_what_step_uses_as_under_ddp(dist_pool, stage, opt_name):
    for err, norm_err in dist_pool.run(_compare, stage, opt_name):
        assert err < 1e-5 and norm_err < 1e-5, (err, norm_err)


def _disagree(stage, how):
    model, opt = build(stage, "adamw")
    ps = named(stage, model)
    x, y = batches(1)[0]
    before = {k: v.clone() for k, v in final(stage, model).items()}
    F.cross_entropy(model(x), y).backward()
    if how == "drop":  # each rank drops another parameter
        ps[["inp.bias", "head.bias"][dist.get_rank() % 2]].grad = None
    else:  # a rank's own (unaveraged) gradient assigned
        ps["head.bias"].grad = torch.full((3,), float(dist.get_rank()))
    try:
        opt.step()
        msg = None
    except RuntimeError as e:
        msg = str(e)
    moved = any(not torch.equal(before[k], v) for k, v in final(stage, model).items())
    return msg, moved


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_that_set_p_grad_differently_are_refused_before_any_parameter_moves(dist_pool, stage):
    for how in ("drop", "assign"):
        for msg, moved in dist_pool.run(_disagree, stage, how):
            assert msg is not None and "set p.grad differently" in msg and "No parameter was updated" in msg, msg
            if how == "assign":
                assert "differ across ranks" in msg and "parameter 7 (shape (3,))" in msg, msg
            assert not moved


class SGDWithNewKey(torch.optim.SGD):
    def step(self, closure=None):
        super().step()
        self.param_groups[0]["new_key"] = 0.1


class SGDWithStepKWArg(torch.optim.SGD):
    def step(self, closure=None, kwarg=None):
        super().step()
        kwarg.append(closure)


class SGDWithoutClosure(torch.optim.SGD):
    def step(self):
        return super().step()


def _inner_step(stage):
    """torch's ZeroRedundancyOptimizer tests' custom classes (vouched elementwise)."""
    out = {}
    for name, cls in (("new_key", SGDWithNewKey), ("kwarg", SGDWithStepKWArg), ("no_closure", SGDWithoutClosure)):
        model, opt = build(stage, "sgd", optimizer_class=cls, momentum=0.0, weight_decay=0.0, vouch=True)
        ref_model, ref = build("ddp", "sgd", optimizer_class=cls, momentum=0.0, weight_decay=0.0)
        x, y = batches(1)[0]
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(ref_model(x), y).backward()
        seen = []
        if name == "kwarg":  # a closure that is not callable reaches the class untouched
            opt.step(0, kwarg=seen)
            ref.step(0, kwarg=[])
        else:
            opt.step()
            ref.step()
        ours, theirs = final(stage, model), final("ddp", ref_model)
        out[name] = (
            seen,
            opt.param_groups[0].get("new_key"),
            max((ours[k] - theirs[k]).abs().max().item() for k in theirs),
        )
    model, opt = build(stage, "sgd")  # a callable closure: run once, its loss returned
    ref_model, ref = build("ddp", "sgd")
    x, y = batches(1)[0]
    calls = []

    def closure(m, o):
        def run():
            calls.append(1)
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            return loss

        return run

    losses = (opt.step(closure(model, opt)).item(), ref.step(closure(ref_model, ref)).item())
    ours, theirs = final(stage, model), final("ddp", ref_model)
    out["closure"] = (len(calls), losses, max((ours[k] - theirs[k]).abs().max().item() for k in theirs))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_inner_optimizer_step_gets_the_closure_and_kwargs_and_its_new_group_keys_show(dist_pool, stage):
    for out in dist_pool.run(_inner_step, stage):
        assert out["new_key"][1] == 0.1 and out["new_key"][2] < 1e-6, out
        assert out["kwarg"][0] == [0] and out["kwarg"][2] < 1e-6, out
        assert out["no_closure"][2] < 1e-6, out
        calls, (ours, ddp), err = out["closure"]
        assert calls == 2 and abs(ours - ddp) < 1e-6 and err < 1e-6, out
