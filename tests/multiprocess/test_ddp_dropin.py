"""A DDP training loop converted with the README's lines behaves exactly like
DDP + torch.optim.AdamW: torch's clip_grad_norm_, GradScaler (an overflow on
one rank), p.grad norms, model.zero_grad() and accumulation over several
syncing backwards; at stages 1, 2 and 3, on gloo at world sizes 2 and 3."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard as zs
from support.checks import piece_of, rel_err
from support.ddp_parity import TINY_BUCKET_MB, branchy, build, compare, compare_unused, data, full_params, local
from support.launch import launch
from support.models import Branchy, Residual, ResidualNet
from support.records import Timeline
from support.fixtures import dist_pool_at_3  # noqa: F401 (this module at 3 ranks: the suite's time)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", ["torch_clip", "opt_clip", "scaler", "model_zero_grad", "scaler_opt_clip"])
def test_a_converted_ddp_script_equals_ddp(dist_pool, stage, case):
    for r in dist_pool.run(compare, stage, case):
        assert r["param_err"] < 1e-5, r
        if case != "model_zero_grad":
            assert r["norm_err"] < 1e-5 and r["pnorm_err"] < 1e-5, r
        ours, ddp = r["scales"]
        assert ours == ddp, r  # the overflow step is skipped everywhere; same scale after it
        if case in ("scaler", "scaler_opt_clip"):
            assert ddp[2] < ddp[1], ddp  # the injected overflow did back the scale off


def _grad_misuse(stage):
    model, opt = build(stage)
    x, y = data(1)[0]
    F.cross_entropy(model(local(x)), local(y)).backward()
    p = next(iter(model.parameters()))
    try:
        p.grad.add_(1.0)  # an in-place change the shards cannot take (reads gather: [Note: gradient reads])
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = None
    shown = repr(p.grad)
    opt.step()
    return msg, shown


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reading_a_sharded_gradient_wrongly_raises_a_clear_error(dist_pool, stage):
    for rank, (msg, shown) in enumerate(dist_pool.run(_grad_misuse, stage)):
        assert msg is not None and f"[rank {rank}/" in msg and "parameter 0" in msg, msg
        assert "clip_grad_norm_" in msg and "GradScaler" in msg and "full_tensor()" in msg, msg
        assert "ShardedGrad" in shown and "full_tensor()" in shown


def _train_steps(kind, steps=3):
    model, opt = build(kind)
    for x, y in data(steps):
        opt.zero_grad()
        F.cross_entropy(model(local(x)), local(y)).backward()
        opt.step()
    return model, opt


def _consolidate(stage):
    _, ddp_opt = _train_steps("ddp")
    _, opt = _train_steps(stage)
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() != 0:  # rank 0 holds it: elsewhere an error at once, not a hang
        with pytest.raises(RuntimeError, match="consolidated onto rank 0"):
            opt.state_dict()
        return None
    sd, ref = opt.state_dict(), ddp_opt.state_dict()  # no communication on rank 0
    plain = torch.optim.AdamW(ResidualNet().parameters())  # plain torch loads it
    plain.load_state_dict(sd)
    return max(
        rel_err(sd["state"][i][k], ref["state"][i][k]) for i in ref["state"] for k in ("exp_avg", "exp_avg_sq")
    ), [float(sd["state"][i]["step"]) for i in sorted(sd["state"])]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidate_then_state_dict_on_rank_0_alone(dist_pool, stage):
    res = dist_pool.run(_consolidate, stage)
    err, steps = res[0]
    assert err < 1e-5 and set(steps) == {3.0}, res[0]
    assert all(r is None for r in res[1:])


def _rank0_only(stage, timeout):
    import os

    model, opt = _train_steps(stage, steps=1)
    os.environ["ZEROSHARD_TIMEOUT"] = str(timeout)
    errors = []
    try:
        if dist.get_rank() == 0:
            for call in (opt.state_dict, model.state_dict):  # each would wait forever for the others
                try:
                    call()
                except RuntimeError as e:
                    errors.append(str(e))
    finally:
        del os.environ["ZEROSHARD_TIMEOUT"]
    dist.barrier()
    opt.consolidate_state_dict(to=1)  # the ranks are still in step afterwards
    return errors, opt.state_dict() is not None if dist.get_rank() == 1 else None


@pytest.mark.parametrize("stage", [2, 3])
def test_state_dict_on_rank_0_alone_errors_instead_of_hanging(stage):
    import time

    dist_pool = launch("pool", 2)  # (world 3 names its ranks alike: test_hangs.py runs both)
    t0 = time.time()
    res = dist_pool.run(_rank0_only, stage, 2)
    errors = res[0][0]
    expected = 2 if stage == 3 else 1  # stages 1/2: model.state_dict() is local, as under DDP
    assert len(errors) == expected, errors
    others = list(range(1, dist_pool.world_size))
    assert all(f"rank(s) {others} did not call it" in e and "[rank 0/" in e for e in errors), errors
    assert "consolidate_state_dict(to=0)" in errors[0]
    assert res[1][1] is True
    assert time.time() - t0 < 30


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_without_gradient_are_left_alone_as_by_ddp_and_adamw(dist_pool, stage):
    for err, ours, ddp, same_none in dist_pool.run(compare_unused, stage):
        assert err < 1e-5
        assert ours == ddp, (ours, ddp)  # per-parameter step counts
        assert sorted(set(ddp.values())) == [5.0, 7.0], ddp  # the extra layer stepped 5 times of 7
        assert same_none  # p.grad is None exactly where DDP leaves it None


def _accumulated_branch(kind, steps=4):
    """Two synced backwards a step, no zero_grad in between; the extra layer is used
    on rank 0 alone in the first and on every rank in the second, so the second adds
    this rank's gradient to a reduced one that other ranks' gradients made."""
    net, opt = branchy(kind)
    rank = dist.get_rank()
    for x, y in data(steps):
        opt.zero_grad()
        for j in range(2):
            use = j == 1 or rank == 0
            (F.cross_entropy(net(local(x) * (j + 1), use_extra=use), local(y)) / 2).backward()
        opt.step()
    return full_params(kind, net)


def _compare_accumulated_branch(stage):
    ours, ddp = _accumulated_branch(stage), _accumulated_branch("ddp")
    return max(rel_err(ours[k], ddp[k]) for k in ddp if ddp[k].norm() > 0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulating_onto_a_gradient_other_ranks_reduced_as_ddp(dist_pool, stage):
    for err in dist_pool.run(_compare_accumulated_branch, stage):
        assert err < 1e-5, err


def _frozen_midway(kind, steps=7, **zs_kw):
    """Fine-tuning's habit: parameters frozen after the optimizer was built (steps 2
    and 3), then trained again (from step 4): one of a ZeRO-3 block's, one of the
    root unit's, and every one of a block's (its unit takes no gradient at all)."""
    net, opt = branchy(kind, **zs_kw)
    params = dict(net.named_parameters())
    names = [
        n for n in params if n.endswith(("blocks.0.fc.weight", "inp.bias", "blocks.1.fc.weight", "blocks.1.fc.bias"))
    ]
    assert len(names) == 4, list(params)
    grads_none = []
    for k, (x, y) in enumerate(data(steps)):
        for n in names:
            params[n].requires_grad_(k not in (2, 3))
        opt.zero_grad()
        F.cross_entropy(net(local(x), use_extra=True), local(y)).backward()
        grads_none.append([p.grad is None for p in net.parameters()])
        opt.step()
    if kind != "ddp":
        opt.consolidate_state_dict(to=None)
    steps_of = {i: float(st["step"]) for i, st in opt.state_dict()["state"].items()}
    return full_params(kind, net), steps_of, grads_none


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_frozen_after_construction_are_left_alone_and_train_again_as_under_ddp(dist_pool, stage):
    for ours, ddp in zip(dist_pool.run(_frozen_midway, stage), dist_pool.run(_frozen_midway, "ddp")):
        assert max(rel_err(ours[0][k], ddp[0][k]) for k in ddp[0]) < 1e-5
        assert ours[1] == ddp[1] and sorted(set(ddp[1].values())) == [5.0, 7.0], (ours[1], ddp[1])
        assert ours[2] == ddp[2]  # p.grad is None exactly where DDP leaves it None


def _partly_frozen_unit_events():
    net, opt = branchy(3)
    net.module.blocks[0].fc.weight.requires_grad_(False)  # after wrapping; its bias still trains
    timeline, block0 = Timeline(), net.units[[u.name for u in net.units].index("blocks.0")]
    for u in net.units:  # each unit's gradients arriving (and, at the root's, where blocks.0 is)
        timeline.grad_hooks((u.name, q.full) for q in u.trainable)
        if u.is_root:
            for q in u.trainable:
                q.full.register_post_accumulate_grad_hook(lambda p: timeline.mark("blocks.0", block0.state.value))
    x, y = data(1)[0]
    F.cross_entropy(net(local(x), use_extra=True), local(y)).backward()
    opt.step()
    return timeline.events()


def test_a_unit_with_a_parameter_frozen_after_wrapping_is_reduced_when_the_rest_arrived(dist_pool):
    """Not held to the end of backward waiting for the frozen one's gradient (it would stay
    gathered all through backward, and its reduction would overlap nothing)."""
    for ev in dist_pool.run(_partly_frozen_unit_events):
        ev = ev[ev.index(("grad", "blocks.1")) :]  # the backward
        last_root_grad = len(ev) - 1 - ev[::-1].index(("grad", ""))
        assert ev[last_root_grad + 1] == ("blocks.0", "sharded"), ev  # resharded by then
        assert ev.index(("reduce_scatter", "blocks.0")) < last_root_grad, ev


def _launched_before_last_grad(stage):
    """Reduce-scatters a backward launched before its last gradient arrived: with all
    parameters trainable, then with one frozen after construction."""
    net, opt = branchy(stage)
    x, y = data(1)[0]
    counts, timeline = [], Timeline()
    timeline.grad_hooks(net.named_parameters())
    for frozen in (False, False, True):  # (the first backward learns the launch order)
        net.blocks[1].fc.weight.requires_grad_(not frozen)
        opt.zero_grad()
        start = len(timeline.events())
        F.cross_entropy(net(local(x), use_extra=True), local(y)).backward()
        ev = timeline.events()[start:]
        last_grad = max(k for k, e in enumerate(ev) if e[0] == "grad")
        counts.append(sum(e[0] == "reduce_scatter" for e in ev[:last_grad]))
        opt.step()
    return counts[1:]


@pytest.mark.parametrize("stage", [1, 2])
def test_buckets_with_a_parameter_frozen_after_construction_are_reduced_during_backward(dist_pool, stage):
    for trainable, frozen in dist_pool.run(_launched_before_last_grad, stage):
        assert trainable > 0 and frozen >= trainable, (trainable, frozen)


def _unfrozen_after_construction(stage):
    torch.manual_seed(0)
    model = ResidualNet()
    model.inp.weight.requires_grad_(False)
    net = zs.FullyShard(model, wrap={Residual}) if stage == 3 else model
    opt = zs.ShardedOptimizer(net.parameters(), lr=1e-2, **({} if stage == 3 else dict(stage=stage)))
    x, y = data(1)[0]
    for p in net.parameters():
        p.requires_grad_(True)
    F.cross_entropy(net(local(x)), local(y)).backward()
    before = [piece_of(p).clone() for p in net.parameters()]
    msg, unchanged = None, True
    if stage == 3:  # the forward laid its unit out again: this backward averaged its gradient
        opt.step()
    else:
        with pytest.raises(RuntimeError) as e:  # its gradient was not averaged: refused, naming the fix
            opt.step()
        msg = str(e.value)
        unchanged = all(torch.equal(a, piece_of(p)) for a, p in zip(before, net.parameters()))
        opt.zero_grad()  # lays it out: it trains from this backward on
        F.cross_entropy(net(local(x)), local(y)).backward()
        opt.step()
    trained = opt.param_steps[0] == 1
    groups = len(opt.param_groups)
    try:  # transfer learning's other habit: a new head
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "lr": 1e-3})
        added = None
    except ValueError as err:  # (ZeRO-3: not a FullyShard parameter)
        added = str(err)
    return msg, unchanged, trained, added, len(opt.param_groups) - groups


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unfreezing_a_parameter_frozen_at_construction_and_adding_a_group(dist_pool, stage):
    """A parameter frozen at construction and unfrozen trains: at stage 3 from the next forward
    (which lays its unit out again), at stages 1/2 once zero_grad() laid it out (a step after a
    backward that gave it an unaveraged gradient is refused first, naming zero_grad());
    add_param_group adds a plain parameter at stages 1/2, and refuses one that is not a
    FullyShard parameter at stage 3, leaving the groups as they were."""
    for rank, (msg, unchanged, trained, added, new_groups) in enumerate(
        dist_pool.run(_unfrozen_after_construction, stage)
    ):
        if stage != 3:
            assert f"[rank {rank}/" in msg and "parameter 0 " in msg and "opt.zero_grad()" in msg, msg
        assert unchanged and trained
        if stage == 3:
            assert added is not None and "not a FullyShard parameter" in added and new_groups == 0, added
        else:
            assert added is None and new_groups == 1


def _converted_after_construction(stage, dtype):
    model, opt = build(stage)
    if dtype is None:  # the same dtype and device (as model.cuda() on a GPU run): was silent
        model.head.bias.data = model.head.bias.data.clone()
    else:
        model.to(dtype)  # replaces every p.data: the model would train a copy no step writes
    x, y = data(1)[0]
    with pytest.raises(RuntimeError) as e:
        F.cross_entropy(model(local(x).to(dtype or torch.float32)), local(y)).backward()
    return str(e.value)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [None, torch.float64], ids=["p.data=", "model.to"])
def test_converting_the_model_after_building_the_optimizer_is_a_clear_error(dist_pool, stage, dtype):
    for rank, msg in enumerate(dist_pool.run(_converted_after_construction, stage, dtype)):
        assert f"[rank {rank}/" in msg and "before building" in msg, msg
        assert f"now {dtype or torch.float32} on cpu" in msg and "parameter " in msg, msg


OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=1e-2)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
}


def _other_optimizer(kind, name, steps=5):
    cls, kw = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = Branchy()
    if kind == "ddp":
        net, opt = DDP(model, find_unused_parameters=True), cls(model.parameters(), foreach=False, **kw)
    elif kind == 3:
        net = zs.FullyShard(model, wrap={Residual})
        opt = zs.ShardedOptimizer(net.parameters(), optimizer_class=cls, **kw)
    else:
        net, opt = (
            model,
            zs.ShardedOptimizer(model.parameters(), optimizer_class=cls, stage=kind, bucket_mb=TINY_BUCKET_MB, **kw),
        )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rank = dist.get_rank()
    for k, (x, y) in enumerate(data(steps)):
        opt.zero_grad()
        F.cross_entropy(net(local(x), use_extra=(k % 3 == 0 and rank == 0)), local(y)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        sched.step()
    if kind == "ddp":
        return full_params(kind, net), opt.state_dict()
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict() if rank == 0 else None
    if rank == 0:  # plain torch loads it
        cls(Branchy().parameters(), **kw).load_state_dict(sd)
    return full_params(kind, net), sd, opt.memory_report()


def _compare_optimizer(stage, name):
    ours, sd, rep = _other_optimizer(stage, name)
    ref, ref_sd = _other_optimizer("ddp", name)
    err = max(rel_err(ours[k], ref[k]) for k in ref)
    state_err = None
    if sd is not None:
        assert sd["state"].keys() == ref_sd["state"].keys(), (sd["state"].keys(), ref_sd["state"].keys())
        state_err = max(
            (rel_err(v, ref_sd["state"][i][k]) if v.dim() else abs(float(v) - float(ref_sd["state"][i][k])))
            for i, st in sd["state"].items()
            for k, v in st.items()
        )
    return err, state_err, rep


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_any_elementwise_torch_optimizer_equals_ddp_with_it(dist_pool, stage, name):
    for rank, (err, state_err, rep) in enumerate(dist_pool.run(_compare_optimizer, stage, name)):
        assert err < 1e-5, (rank, err)
        assert rank != 0 or state_err < 1e-5, state_err
        assert rep["exp_avg"] == rep["exp_avg_sq"] == 0 and rep["optimizer_state"] > 0, rep


class Custom(torch.optim.SGD):
    """A class zeroshard cannot know to be elementwise or whole-tensor."""


def _refused():
    model = ResidualNet()
    out = []
    for cls, kw in ((torch.optim.LBFGS, {}), (Custom, {})):
        try:
            zs.ShardedOptimizer(model.parameters(), optimizer_class=cls, lr=0.1, **kw)
        except ValueError as e:
            out.append(str(e))
    try:
        zs.ShardedOptimizer(model.parameters(), lr=0.1, momentum=0.9)
    except TypeError as e:
        out.append(str(e))
    # a class the user vouches for runs
    opt = zs.ShardedOptimizer(model.parameters(), optimizer_class=torch.optim.Adafactor, elementwise=True, lr=0.1)
    try:
        opt.sharded_state_dict()
    except NotImplementedError as e:
        out.append(str(e))
    return out


def test_non_elementwise_optimizers_are_refused_unless_vouched_for(dist_pool):
    for msgs in dist_pool.run(_refused):
        assert len(msgs) == 4, msgs
        assert "LBFGS" in msgs[0] and "elementwise=True" in msgs[0] and "whole_tensor=True" in msgs[0]
        assert "Custom" in msgs[1]
        assert "optimizer_class" in msgs[2]
        assert "Adafactor" in msgs[3] and "save_checkpoint" in msgs[3] and "consolidate_state_dict" in msgs[3]


def _unused_ckpt_save(stage, path):
    model, opt = branchy(stage, seed=0)
    for k, (x, y) in enumerate(data(4)):
        opt.zero_grad()
        F.cross_entropy(model(local(x), use_extra=k == 1), local(y)).backward()
        opt.step()
    zs.save_checkpoint(path, model, opt)
    return opt.param_steps


def _unused_ckpt_load(stage, path):
    model, opt = branchy(stage, seed=1)
    zs.load_checkpoint(path, model, opt)
    opt.consolidate_state_dict(to=None)
    return opt.param_steps, {i: float(st["step"]) for i, st in opt.state_dict()["state"].items()}


def test_per_parameter_step_counts_survive_a_checkpoint_at_another_world_size_and_stage(tmp_path):
    saved = launch("pool", 2).run(_unused_ckpt_save, 2, str(tmp_path / "ck"))[0]
    assert sorted(set(saved)) == [0, 1, 4], saved  # never used / used in one step / every step
    for stage in (1, 3):
        steps, state = launch("pool", 3).run(_unused_ckpt_load, stage, str(tmp_path / "ck"))[0]
        assert steps == saved, (stage, steps, saved)
        assert sorted(set(state.values())) == [1.0, 4.0] and 0 not in state.values()


def _statistics_in_flight(stage):
    """(ended after backward, ended after step) of each step's statistics all-reduce."""
    torch.manual_seed(0)
    model = Branchy()
    model.never.requires_grad_(False)  # (frozen: not a parameter that lacks a gradient)
    if stage == 3:
        net = zs.FullyShard(model, wrap={Residual})
        opt = zs.ShardedOptimizer(net.parameters(), lr=1e-2)
    else:
        net, opt = model, zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_mb=TINY_BUCKET_MB)
    rank, seen = dist.get_rank(), []

    def last():
        return [r for r in zs.flight_record() if r["what"] == "gradient statistics"][-1]

    for k, (x, y) in enumerate(data(3)):
        opt.zero_grad()
        use = k != 1 or rank == 0  # step 1: the extra layer gets a gradient on rank 0 only
        F.cross_entropy(net(local(x), use_extra=use), local(y)).backward()
        after_backward = last()["end"] is not None
        opt.step()
        seen.append((after_backward, last()["end"] is not None))
    return seen


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_statistics_all_reduce_stays_in_flight_until_the_step_needs_it(dist_pool, stage):
    """Every parameter got a gradient on this rank: the statistics' all-reduce is not
    waited for at the end of backward (the update runs while it is in flight) but by
    the end of step(). A parameter without a gradient here: p.grad must say whether
    another rank gave it one, so backward waits for it."""
    for rank, seen in enumerate(dist_pool.run(_statistics_in_flight, stage)):
        want = [(False, True), (rank != 0, True), (False, True)]
        assert seen == want, (rank, seen)
