"""torch's own optimizers over a fully_shard model ([Note: torch optimizers over sharded
parameters]): the FSDP2 script's optimizer line unchanged. One script run with FSDP2's
imports and with zeroshard's, at 2 ranks on gloo: torch's AdamW (single-tensor and foreach),
Adam (fused, with L2 weight decay and two backwards accumulated) and SGD with momentum, with
clip_grad_norm_ and both kinds of zero_grad; then the cases FSDP2 does not reach."""

import io
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from support.launch import launch
from support.titan import initialised, mine

OPTIMIZERS = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.01), {}),
    "adamw-foreach": (lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True), {"set_to_none": False}),
    "adam-fused-l2": (lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True, weight_decay=0.1), {"accumulate": True}),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), {}),
}


def _train(api, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    make_opt, how = OPTIMIZERS[name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model = initialised()
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, mp_policy=mp)
    api.fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, api.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # (FSDP2 on gloo: no AVG)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(3)
    losses, norms = [], []
    for _ in range(4):
        x = mine(torch.randint(0, 50, (8, 5), generator=g))
        if how.get("accumulate"):
            model(x[:, :3]).square().mean().backward()
        loss = model(x).square().mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=how.get("set_to_none", True))
    sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return losses, norms, sd


def _both(name):
    import torch.distributed.fsdp as fsdp

    ours, ref = _train(zs, name), _train(fsdp, name)
    return {
        "losses": (ours[0], ref[0]),
        "norms": (ours[1], ref[1]),
        "err": max((ours[2][k] - v).abs().max().item() for k, v in ref[2].items()),
        "moved": max((ours[2][k] - v).abs().max().item() for k, v in initialised().state_dict().items()),
    }


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_torch_optimizer_steps_the_shards_as_over_fsdp2(name):
    """The optimizer line had to change (a torch optimizer over FullyShard parameters raised at
    step()). Now torch's optimizer steps each rank's pieces, its state sharded like them: the
    losses, clip_grad_norm_'s norms and the parameters equal FSDP2's running the same script."""
    for r in launch("pool", 2).run(_both, name):
        for a, b in zip(*r["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b), r["losses"]
        for a, b in zip(*r["norms"]):
            assert abs(a - b) <= 1e-6 * abs(b), r["norms"]
        assert r["err"] < 1e-6 and r["moved"] > 1e-3, r


class _Branchy(nn.Module):
    """A head only rank 0's batches use, and one no rank uses."""

    def __init__(self):
        super().__init__()
        self.body, self.rare, self.unused = nn.Linear(7, 7), nn.Linear(7, 3), nn.Linear(7, 3)

    def forward(self, x, rare: bool):
        h = self.body(x)
        return h.sum() + (self.rare(h).sum() if rare else 0.0)


def _pieces(model):
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _edges():
    torch.manual_seed(0)
    model = _Branchy()
    zs.fully_shard(model)  # (one unit: a unit some rank never runs would stall FSDP2's reduction too)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    before = _pieces(model)
    model(torch.randn(4, 7), rare=dist.get_rank() == 0).backward()
    out = {"grads": {n: p.grad is not None for n, p in model.named_parameters()}}
    opt.step()
    after = _pieces(model)
    out["unused_kept"] = all(torch.equal(before[n], after[n]) for n in before if n.startswith("unused"))
    out["rare_full"] = model.state_dict()["rare.weight"]  # (the same on every rank if both stepped it)
    # zero_grad(set_to_none=True), then one backward: the gradient is this backward's alone
    opt.zero_grad()
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x, rare=True).backward()
    g1 = model.body.weight.grad.to_local().clone()
    opt.zero_grad()
    model(x, rare=True).backward()
    out["fresh"] = torch.equal(model.body.weight.grad.to_local(), g1)
    out["errors"] = []
    for fn in (
        lambda: pickle.dumps(model.body.weight.grad),
        lambda: model.body.weight.grad.add_(torch.ones(7)),
        lambda: opt.state[model.body.weight]["exp_avg"].add_(opt.state[model.body.bias]["exp_avg"]),
    ):
        try:
            fn()
            out["errors"].append(None)
        except RuntimeError as e:
            out["errors"].append(str(e))
    return out


def test_parameters_some_rank_used_step_on_every_rank_and_errors_name_the_fix():
    """A parameter only rank 0's batch reached had ``p.grad`` on rank 0 alone: torch's optimizer
    would step its pieces there and not on rank 1, splitting the model. Now ``p.grad`` is there
    on every rank where any rank gave a gradient (one small all-gather), None where none did
    (torch skips it: AdamW's weight decay leaves it as it was); ``zero_grad()`` starts the next
    gradient afresh; pickling a piece or mixing pieces is refused naming the tensor and the fix."""
    a, b = launch("pool", 2).run(_edges)
    for r in (a, b):
        assert r["grads"] == {
            "body.weight": True,
            "body.bias": True,
            "rare.weight": True,
            "rare.bias": True,
            "unused.weight": False,
            "unused.bias": False,
        }, r["grads"]
        assert r["unused_kept"] and r["fresh"], r
        pick, plain, mixed = r["errors"]
        assert "cannot be pickled" in pick and "ShardedOptimizer" in pick, pick
        assert "plain tensor of shape (7,)" in plain, plain
        assert "'body.weight'" in mixed and "'body.bias'" in mixed, mixed
    assert torch.equal(a["rare_full"], b["rare_full"])


def _build(api, foreach: bool):
    model = initialised()
    for layer in model.layers:
        api.fully_shard(layer)
    api.fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01, foreach=foreach)


def _steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(mine(torch.randint(0, 50, (8, 5), generator=g))).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full_sd(model):
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def _resumes(api, ddp_habit: bool):
    """Two steps, a checkpoint through torch's helpers (pytorch/examples' FSDP2 checkpointer, its
    DCP path) or DDP's habit (torch.save of both state dicts, loaded before the first step), a
    fresh model and optimizer loading it, two steps more: the final parameters."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = _build(api, foreach=not ddp_habit)  # (the helpers' lr-0 step: foreach, L2 decay)
    _steps(model, opt, 2, 1)
    if ddp_habit:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)  # (collective: every rank)
        sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        model, opt = _build(api, foreach=False)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
    else:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)
        model, opt = _build(api, foreach=True)
        load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, msd, options=load)
        set_optimizer_state_dict(model, opt, osd, options=load)
    _steps(model, opt, 2, 2)
    return _full_sd(model)


def _resume_all():
    import torch.distributed.fsdp as fsdp

    straight = {}
    for foreach in (False, True):
        model, opt = _build(zs, foreach)
        _steps(model, opt, 2, 1)
        _steps(model, opt, 2, 2)
        straight[foreach] = _full_sd(model)
    err = lambda a, b: max((a[k] - v).abs().max().item() for k, v in b.items())  # noqa: E731
    return {
        "dcp_vs_fsdp2": err(_resumes(zs, False), _resumes(fsdp, False)),
        "dcp_vs_straight": err(_resumes(zs, False), straight[True]),
        "ddp_habit_vs_straight": err(_resumes(zs, True), straight[False]),
        "moved": err(straight[False], initialised().state_dict()),
    }


def test_a_torch_optimizers_state_dict_resumes_as_over_fsdp2():
    """A torch optimizer's state_dict() over the pieces: pytorch/examples' FSDP2 checkpointer
    (get_/set_model_state_dict and get_/set_optimizer_state_dict, full state dicts broadcast from
    rank 0) resumes as it does over FSDP2 and as the run that never stopped; DDP's habit
    (torch.save of model.state_dict() and opt.state_dict(), both loaded into a fresh model and
    optimizer before its first step) resumes exactly too."""
    for r in launch("pool", 2).run(_resume_all):
        assert r["dcp_vs_fsdp2"] < 1e-6 and r["dcp_vs_straight"] == 0.0, r
        assert r["ddp_habit_vs_straight"] == 0.0 and r["moved"] > 1e-3, r


def _scaled():
    model, opt = _build(zs, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    out = []
    for step in range(3):
        x = mine(torch.randint(0, 50, (8, 5), generator=torch.Generator().manual_seed(step)))
        scaler.scale(model(x).square().mean()).backward()
        if step == 1 and dist.get_rank() == 0:  # a non-finite gradient element in rank 0's piece alone
            p = next(p for p in model.parameters() if p.grad is not None and p.grad.to_local().numel())
            p.grad.to_local()[0] = float("inf")
        before = _pieces(model)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
        out.append((changed, scaler.get_scale()))
    return out


def test_grad_scaler_skips_a_step_on_every_rank_when_one_rank_finds_inf():
    """torch.amp.GradScaler over a torch optimizer: a non-finite value in one rank's gradient piece
    had left that rank skipping the step while the other stepped, the model split in two. Now the
    check agrees over the ranks (as FSDP2's ShardedGradScaler): both skip it and halve the scale."""
    a, b = launch("pool", 2).run(_scaled)
    assert a == b, (a, b)
    assert [c for c, _ in a] == [True, False, True], a
    assert a[1][1] == a[0][1] / 2, a
