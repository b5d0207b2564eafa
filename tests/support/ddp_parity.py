"""The DDP comparisons: a training loop in the idioms of common DDP scripts run under DDP +
torch AdamW and under a zeroshard stage on the same ResidualNet (or Branchy) and data, and
what differs between the two runs' parameters, norms, loss scales and step counts."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard as zs
from .checks import rel_err
from .models import Branchy, Residual, ResidualNet

BATCH = 12


TINY_BUCKET_MB = 700 / 2**20  # buckets split tensors


def data(steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 11, generator=g) * 2, torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(steps)]


def local(t):
    n = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def build(kind, **zs_kw):
    """(model to call, optimizer) for "ddp" or a zeroshard stage (``zs_kw``: e.g. shard_size)."""
    torch.manual_seed(0)
    model = ResidualNet()
    if kind == "ddp":
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    if kind == 3:
        model = zs.FullyShard(model, wrap={Residual}, **zs_kw)
        return model, zs.ShardedOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, zs.ShardedOptimizer(
        model.parameters(), lr=1e-2, weight_decay=0.1, stage=kind, bucket_mb=TINY_BUCKET_MB, **zs_kw
    )


def full_params(kind, model):
    sd = model.state_dict() if kind == 3 else (model.module if kind == "ddp" else model).state_dict()
    return {k: v.detach().clone().float() for k, v in sd.items()}


def script(kind, case, steps=6, overflow_at=2, **zs_kw):
    """One training loop in the idioms of common DDP scripts; returns what to compare."""
    model, opt = build(kind, **zs_kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    scaled = case in ("scaler", "scaler_opt_clip")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) if scaled else None
    out = {"norms": [], "scales": [], "pnorms": []}
    for k, (x, y) in enumerate(data(steps)):
        if case in ("model_zero_grad", "scaler_opt_clip"):  # (the Hugging Face Trainer's habit)
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        micro = 2 if case == "model_zero_grad" else 1
        for j in range(micro):  # several syncing backwards accumulate, as under DDP
            loss = F.cross_entropy(model(local(x) * (j + 1)), local(y)) / micro
            if scaler is not None and k == overflow_at and rank == world - 1:
                loss = loss * float("inf")  # overflow on one rank only
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if case in ("torch_clip", "scaler", "opt_clip", "scaler_opt_clip"):
            out["pnorms"].append([p.grad.norm().item() for p in model.parameters()])
            if case in ("opt_clip", "scaler_opt_clip") and kind != "ddp":  # the optimizer's own (no pass over
                # the gradients); after a skipped step its coefficient must not reach the next one
                out["norms"].append(opt.clip_grad_norm_(0.5).item())
            else:
                out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        else:
            opt.step()
    out["params"] = full_params(kind, model)
    return out


def compare(stage, case, **zs_kw):
    """``script`` under stage ``stage`` and under DDP: the largest parameter, norm and per-parameter
    norm errors, and both runs' loss scales."""
    ours, ddp = script(stage, case, **zs_kw), script("ddp", case)
    res = {
        "param_err": max(rel_err(ours["params"][k], ddp["params"][k]) for k in ddp["params"]),
        "scales": (ours["scales"], ddp["scales"]),
    }
    if ddp["norms"]:
        res["norm_err"] = max(abs(a - b) / b for a, b in zip(ours["norms"], ddp["norms"]))
        res["pnorm_err"] = max(
            abs(a - b) / max(b, 1e-12) for pa, pb in zip(ours["pnorms"], ddp["pnorms"]) for a, b in zip(pa, pb)
        )
    return res


def branchy(kind, seed=0, **zs_kw):
    """(model to call, optimizer) over a Branchy: DDP with find_unused_parameters, or a stage."""
    torch.manual_seed(seed)
    model = Branchy()
    if kind == "ddp":
        return DDP(model, find_unused_parameters=True), torch.optim.AdamW(
            model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False
        )
    if kind == 3:
        net = zs.FullyShard(model, wrap={Residual}, **zs_kw)
        return net, zs.ShardedOptimizer(net.parameters(), lr=1e-2, weight_decay=0.1)
    return model, zs.ShardedOptimizer(
        model.parameters(), lr=1e-2, weight_decay=0.1, stage=kind, bucket_mb=TINY_BUCKET_MB, **zs_kw
    )


def unused(kind, steps=7, **zs_kw):
    """A Branchy trained ``steps`` steps, its extra layer used by some ranks in some steps: (its
    parameters, each parameter's optimizer step count, where p.grad was None each step)."""
    net, opt = branchy(kind, **zs_kw)
    rank = dist.get_rank()
    grads_none = []
    for k, (x, y) in enumerate(data(steps)):
        opt.zero_grad()
        # step 0, 3, 6: rank 0 only; 1, 4: every rank; 2, 5: no rank
        use = (k % 3 == 0 and rank == 0) or k % 3 == 1
        F.cross_entropy(net(local(x), use_extra=use), local(y)).backward()
        grads_none.append([p.grad is None for p in net.parameters()])
        opt.step()
    if kind == "ddp":
        state = opt.state_dict()
    else:
        opt.consolidate_state_dict(to=None)
        state = opt.state_dict()
    steps_of = {i: float(st["step"]) for i, st in state["state"].items()}
    return full_params(kind, net), steps_of, grads_none


def compare_unused(stage, **zs_kw):
    """``unused`` under stage ``stage`` and under DDP: the largest parameter error, both runs'
    per-parameter step counts, and whether p.grad is None in the same places."""
    (ours, our_steps, our_none), (ddp, ddp_steps, ddp_none) = unused(stage, **zs_kw), unused("ddp")
    return (
        max(rel_err(ours[k], ddp[k]) if ddp[k].norm() > 0 else (ours[k] - ddp[k]).abs().max().item() for k in ddp),
        our_steps,
        ddp_steps,
        our_none == ddp_none,
    )


def trained_hybrid(stage, steps):
    """Stage ``stage`` with shard_size=2, after ``steps`` steps."""
    model, opt = build(stage, shard_size=2)
    for x, y in data(steps):
        opt.zero_grad()
        F.cross_entropy(model(local(x)), local(y)).backward()
        opt.step()
    return model, opt
