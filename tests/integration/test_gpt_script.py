"""A real GPT training script, converted as a new user would (docs/converting-ddp.md).

The script is written in the idioms of the most-copied minimal GPT trainer: the
model's ``configure_optimizers`` picks weight-decay groups by ``p.dim() >= 2``
and builds the optimizer *before* the data-parallel wrap; GradScaler,
``torch.nn.utils.clip_grad_norm_``, gradient accumulation, ``raw_model`` for
the master rank's checkpoint, evaluation, and MFU from ``get_num_params()``.
At stages 1 and 2 and under FullyShard (the optimizer built before or after
the wrap) it must train as it does under DDP + torch.optim.AdamW: parameters
and optimizer state within 1e-5 (fp32), the same parameter count.
"""

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard as zs
from support.launch import job, launch

VOCAB, SEQ, DIM, LAYERS, BATCH, ACCUM, ITERS = 37, 13, 24, 2, 3, 2, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.Linear(DIM, DIM)
        self.c_fc, self.c_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    def get_num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def configure_optimizers(
        self, weight_decay, learning_rate, betas, device_type, optimizer=torch.optim.AdamW, **extra
    ):
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        groups = [
            {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return optimizer(groups, lr=learning_rate, betas=betas, fused=fused, **extra)


def get_batch(it, micro, split="train"):
    g = torch.Generator().manual_seed(1000 * it + 10 * micro + (split == "val"))
    data = torch.randint(0, VOCAB, (dist.get_world_size() * BATCH, SEQ + 1), generator=g)
    rank = dist.get_rank()
    mine = data[rank * BATCH : (rank + 1) * BATCH]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def train_script(mode: str):
    """mode: 'ddp', 'zero1', 'zero2', 'fsdp-before' (optimizer, then FullyShard: the
    script's order), 'fsdp-after' (FullyShard, then the optimizer)."""
    master = dist.get_rank() == 0
    torch.manual_seed(0)
    model = GPT()
    kw = dict(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95), device_type="cpu")
    if mode == "ddp":
        optimizer = model.configure_optimizers(**kw)
        model = DDP(model)
        raw_model = model.module
    elif mode in ("zero1", "zero2"):
        optimizer = model.configure_optimizers(**kw, optimizer=zs.ShardedOptimizer, stage=int(mode[-1]))
        raw_model = model
    elif mode == "fsdp-before":
        optimizer = model.configure_optimizers(**kw, optimizer=zs.ShardedOptimizer)
        model = raw_model = zs.FullyShard(model, wrap={Block})
    else:
        model = raw_model = zs.FullyShard(model, wrap={Block})
        optimizer = raw_model.configure_optimizers(**kw, optimizer=zs.ShardedOptimizer)
    n_params = raw_model.get_num_params()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses = []
    for it in range(ITERS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            if mode == "ddp":
                sync = contextlib.nullcontext() if last else model.no_sync()
            else:
                sync = contextlib.nullcontext() if last else optimizer.no_sync()
            with sync:
                _, loss = model(*get_batch(it, micro))
                scaler.scale(loss / ACCUM).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    # evaluation: on the master rank alone, except under FullyShard (every rank: its forward gathers)
    val = None
    if master or mode.startswith("fsdp"):
        model.eval()
        with torch.no_grad():
            val = model(*get_batch(0, 0, "val"))[1].item()
        model.train()
    # the master rank's checkpoint
    if mode != "ddp":
        optimizer.consolidate_state_dict(to=0)
    model_sd = model.state_dict(to=0) if mode.startswith("fsdp") else raw_model.state_dict()
    if not master:
        return None
    opt_sd = optimizer.state_dict()
    return {
        "params": {k: v.detach().clone() for k, v in model_sd.items()},
        "opt": opt_sd,
        "n_params": n_params,
        "losses": losses,
        "val": val,
    }


def _compare(ours, ddp):
    assert ours["n_params"] == ddp["n_params"]
    assert ours["params"].keys() == ddp["params"].keys()
    for k, v in ddp["params"].items():
        err = (ours["params"][k] - v).abs().max().item()
        assert err <= 1e-5, (k, err)
    assert len(ours["opt"]["state"]) == len(ddp["opt"]["state"])
    for i, st in ddp["opt"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            err = (ours["opt"]["state"][i][name].reshape(st[name].shape) - st[name]).abs().max().item()
            assert err <= 1e-5, (i, name, err)
    assert [g["weight_decay"] for g in ours["opt"]["param_groups"]] == [0.1, 0.0]
    assert [len(g["params"]) for g in ours["opt"]["param_groups"]] == [
        len(g["params"]) for g in ddp["opt"]["param_groups"]
    ]
    assert abs(ours["val"] - ddp["val"]) <= 1e-5


@pytest.mark.timeout(600)
def test_the_script_converted_trains_as_under_ddp(dist_pool):
    ddp = dist_pool.run(train_script, "ddp")[0]
    for mode in ("zero1", "zero2", "fsdp-before", "fsdp-after"):
        _compare(dist_pool.run(train_script, mode)[0], ddp)


def _shapes_and_state_dict():
    torch.manual_seed(0)
    plain = GPT()
    expect = {n: (tuple(p.shape), p.dim(), p.numel()) for n, p in plain.named_parameters()}
    model = zs.FullyShard(plain, wrap={Block})
    got = {n: (tuple(p.shape), p.dim(), p.numel()) for n, p in model.named_parameters()}
    pieces = sum(p.to_local().numel() for p in model.parameters())
    errors = {}
    for what, fn in {
        "module.state_dict": lambda: model.module.state_dict(),
        "block.state_dict": lambda: model.h[0].state_dict(),
        "p.data": lambda: next(model.parameters()).data,
        "torch.save": lambda: torch.save(next(model.parameters()), "/dev/null"),
    }.items():
        try:
            fn()
            errors[what] = None
        except RuntimeError as e:
            errors[what] = str(e)
    return {
        "expect": expect,
        "got": got,
        "pieces": pieces,
        "errors": errors,
        "ndim": [p.ndim for p in model.parameters()],
        "size": [tuple(p.size()) for p in model.parameters()],
    }


def test_fullyshard_parameters_have_the_full_shape_and_refuse_silent_shards(dist_pool):
    res = dist_pool.run(_shapes_and_state_dict)
    for r in res:
        assert r["got"] == r["expect"]
        assert r["ndim"] == [s[1] for s in r["expect"].values()]
        assert r["size"] == [s[0] for s in r["expect"].values()]
        for what, err in r["errors"].items():
            assert err is not None and "model.state_dict(to=0)" in err and "to_local()" in err, (what, err)
        assert (
            "'wte.weight'" in r["errors"]["module.state_dict"] or "'lm_head.weight'" in r["errors"]["module.state_dict"]
        )
    # every element is some rank's: the pieces add up to the model (tied weights once)
    assert sum(r["pieces"] for r in res) == sum(s[2] for s in res[0]["expect"].values())


def _adamw_arguments():
    torch.manual_seed(0)
    out = {}
    for kw in (dict(fused=True), dict(foreach=False), dict(capturable=False, differentiable=False)):
        out[str(kw)] = zs.ShardedOptimizer(GPT().parameters(), lr=1e-3, **kw).fused
    try:
        zs.ShardedOptimizer(GPT().parameters(), lr=1e-3, differentiable=True)
        out["differentiable"] = None
    except NotImplementedError as e:
        out["differentiable"] = str(e)
    results = {}
    for kw in (dict(amsgrad=True), dict(maximize=True)):
        torch.manual_seed(0)
        model = GPT()
        ref = GPT()
        ref.load_state_dict(model.state_dict())
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2, **kw)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False, **kw)
        ddp = DDP(ref)
        for it in range(3):
            x, y = get_batch(it, 0)
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            ddp(x, y)[1].backward()
            ref_opt.step()
            ref_opt.zero_grad()
        results[str(kw)] = (
            opt.fused,
            max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
        )
    out["torch_path"] = results
    return out


def test_torch_adamw_arguments_are_accepted(dist_pool):
    r = dist_pool.run(_adamw_arguments)[0]
    assert r["{'fused': True}"] and r["{'foreach': False}"] and r["{'capturable': False, 'differentiable': False}"]
    assert r["differentiable"] and "differentiable=True" in r["differentiable"]
    for kw, (fused, err) in r["torch_path"].items():
        assert not fused and err <= 1e-6, (kw, err)


# ------------------------------------------------------------ rank-0 code
TRAPS = job("rank0_traps.py")


SCENARIOS = {
    "eval": ("a FullyShard forward without gradients (evaluation)", "state_dict(to=0)"),
    "opt_state_dict": ("ShardedOptimizer.state_dict()", "consolidate_state_dict(to=0)"),
    "save": ("save_checkpoint()", "on every rank"),
}


@pytest.fixture(scope="module")
def trapped(tmp_path_factory):
    """Every scenario's two-rank job, launched at once (each mostly waits: for its
    launch, then for the check-in): {scenario: {rank: its RESULT}} (or the job's output)."""
    import json

    env = {"OMP_NUM_THREADS": "1", "CHECK_IN_SECONDS": "4", "ZEROSHARD_TIMEOUT": None}
    jobs = {}
    for scenario in SCENARIOS:
        d = tmp_path_factory.mktemp(scenario)
        jobs[scenario] = launch(
            "torchrun", TRAPS, 2, [scenario, str(d)], env=dict(env, ZEROSHARD_RECORD_DIR=str(d)), wait=False
        )
    found = {}
    for scenario, proc in jobs.items():
        stdout, stderr = proc.communicate(timeout=240)
        out = {}
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                out[r["rank"]] = r
        found[scenario] = out if sorted(out) == [0, 1] else stdout[-3000:] + stderr[-3000:]
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_collective_call_on_rank_0_alone_fails_fast_on_every_rank_and_moves_no_data(trapped, scenario):
    """Rank 0 alone makes the call while rank 1 trains on: rank 0 raises at the check-in
    (here scaled to 4 s; 60 s by default) naming the call, the missing rank and the
    fix, having issued no collective the other rank could match (its last record is
    the check-in); rank 1 raises as rank 0 leaves, not at the 30-minute timeout."""
    out, names = trapped[scenario], SCENARIOS[scenario]
    assert isinstance(out, dict), out
    r0, r1 = out[0], out[1]
    assert r0["error"] and r0["error"].startswith("CollectiveTimeout"), r0
    for n in names:
        assert n in r0["error"], (n, r0["error"])
    assert "rank(s) [1] did not call it within 4 s" in r0["error"]
    assert 3.5 <= r0["seconds"] <= 30, r0["seconds"]
    assert r0["records"][-1][0] == "check_in" and not r0["records"][-1][2]  # nothing issued after it
    assert r1["error"] and r1["error"].split(":")[0] in ("CollectiveError", "CollectiveTimeout"), r1
    assert r1["seconds"] <= 60, r1["seconds"]


def test_a_check_in_waits_60_seconds_unless_a_timeout_is_set(monkeypatch):
    from zeroshard.comm import watchdog

    monkeypatch.delenv("ZEROSHARD_TIMEOUT", raising=False)
    monkeypatch.setattr(watchdog, "timeout", lambda: 1800.0)
    assert watchdog.checkin_timeout() == 60.0
    monkeypatch.setenv("ZEROSHARD_TIMEOUT", "600")
    monkeypatch.setattr(watchdog, "timeout", lambda: 600.0)
    assert watchdog.checkin_timeout() == 600.0


# ------------------------------------------------ the rest of DDP's behaviour
class BNNet(nn.Module):
    """BatchNorm: running statistics are buffers, which DDP broadcasts from rank 0."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(7, 11, bias=False), nn.BatchNorm1d(11), nn.Linear(11, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _ddp_behaviour(mode, foreach):
    """clip_grad_value_ (then clip_grad_norm_) and BatchNorm buffers, against DDP."""
    rank = dist.get_rank()
    torch.manual_seed(1)
    ours, ref = BNNet(), BNNet()
    ref.load_state_dict(ours.state_dict())
    if mode == 3:
        ours = zs.FullyShard(ours)
    opt = zs.ShardedOptimizer(ours.parameters(), lr=1e-2, **({} if mode == 3 else {"stage": mode}))
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    norms = []
    for it in range(4):
        g = torch.Generator().manual_seed(it)
        x = torch.randn(6 * dist.get_world_size(), 7, generator=g)[rank * 6 : (rank + 1) * 6] * (1 + rank)
        for model, o in ((ours, opt), (ddp, ref_opt)):
            model(x).square().mean().backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.02, foreach=foreach)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
            o.step()
            o.zero_grad()
    sd = ours.state_dict(to=0) if mode == 3 else ours.state_dict()
    if sd is None:
        return None
    ref_sd = ref.state_dict()  # every rank's own: DDP keeps rank 1's buffers equal to rank 0's
    return {
        "errs": {k: (sd[k].double() - v.double()).abs().max().item() for k, v in ref_sd.items()},
        "norms": (norms[0::2], norms[1::2]),
    }


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_clip_grad_value_and_batchnorm_buffers_as_under_ddp(dist_pool, mode):
    for foreach in (None, True):
        for r in [r for r in dist_pool.run(_ddp_behaviour, mode, foreach) if r is not None]:
            ours, theirs = r["norms"]
            assert max(abs(a - b) / b for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)
            assert set(r["errs"]) >= {"bn.running_mean", "bn.running_var", "fc2.weight"}
            for k, err in r["errs"].items():
                assert err <= 1e-5, (k, err)


def _wrap_refusals():
    out = {}
    torch.manual_seed(0)
    plain = GPT()
    opt = zs.ShardedOptimizer(plain.parameters(), lr=1e-3)
    plain(*get_batch(0, 0))[1].backward()  # training has begun
    try:
        zs.FullyShard(plain, wrap={Block})
        out["after_backward"] = None
    except RuntimeError as e:
        out["after_backward"] = str(e)
    plain = GPT()
    opt = zs.ShardedOptimizer(list(plain.parameters()) + [nn.Parameter(torch.ones(3))], lr=1e-3)
    try:
        zs.FullyShard(plain, wrap={Block})
        out["partly"] = None
    except ValueError as e:
        out["partly"] = str(e)
    del opt
    return out


def test_wrapping_after_the_optimizer_is_refused_at_the_wrap_when_it_cannot_work(dist_pool):
    for r in dist_pool.run(_wrap_refusals):
        assert r["after_backward"] and "wrap the model before training" in r["after_backward"]
        assert r["partly"] and "before FullyShard wrapped it" in r["partly"] and "after the wrap" in r["partly"]
