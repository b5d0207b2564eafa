"""Rank-side code of tests/integration/test_deepspeed_engine.py's helper tests: DeepSpeed's
user-facing helpers called the same way on a DeepSpeed engine and a zeroshard one built from
the same model, in the same gloo process group (DeepSpeed on CPU, as that file sets it up).

``helpers(stage)``: GatheredParameters with a modifier rank, then the ``deepspeed.utils``
getters compared and setters applied alike at an accumulation boundary, the step, and the
parameters compared; attribute forwarding and empty_partition_cache on the way.
``client_optimizers()``: torch's Adam (L2 decay: elementwise; none: the fused AdamW) with CPU
offload, an untested optimizer class with and without ``zero_allow_untested_optimizer``,
LRRangeTest. ``second_initialize(stage)``: a second initialize over the first engine's model.
"""

import copy
import functools

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.integrations import deepspeed as zsds
from support.ds import Net, base, batch, ds_setup

NAMES = [
    "inp.weight",
    "inp.bias",
    "blocks.0.weight",
    "blocks.0.bias",
    "blocks.1.weight",
    "blocks.1.bias",
    "out.weight",
    "out.bias",
]


class Tagged(Net):
    """The test model with an attribute and a method of its own (engine.<attribute> forwarding)."""

    def __init__(self):
        super().__init__()
        self.id = "tagged-net"

    def width(self):
        return self.inp.out_features


class SignSGD(torch.optim.Optimizer):
    """An elementwise optimizer neither DeepSpeed nor zeroshard knows."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-g["lr"])


def _api(ds):
    """(initialize, GatheredParameters, utils) of DeepSpeed (``ds``) or zeroshard (None)."""
    if ds is not None:
        import deepspeed.utils

        return ds.initialize, ds.zero.GatheredParameters, deepspeed.utils
    return zeroshard.initialize, zsds.zero.GatheredParameters, zsds.utils


def _engine(init, cfg, model=None, optimizer=None):
    if model is None:
        torch.manual_seed(0)
        model = Tagged()
    opt = optimizer(model.parameters()) if optimizer is not None else None
    return init(model=model, model_parameters=model.parameters(), optimizer=opt, config=copy.deepcopy(cfg))[0]


def _accumulate(engine, step):
    """Every micro-batch of ``step`` through engine.backward, engine.step() after all but the
    last: the next engine.step() is the accumulation boundary."""
    rank, world, gas = dist.get_rank(), dist.get_world_size(), engine.gradient_accumulation_steps()
    for m in range(gas):
        x, y = batch(step, m, rank, world, engine.train_micro_batch_size_per_gpu())
        engine.backward(((engine(x) - y) ** 2).mean())
        if m < gas - 1:
            engine.step()


def _steps(engine, first, n):
    for s in range(first, first + n):
        _accumulate(engine, s)
        engine.step()


def _named(engine):
    return dict(engine.module.named_parameters())


def full_params(engine, utils):
    return {n: utils.safe_get_full_fp32_param(p).clone() for n, p in _named(engine).items()}


def _gathered_values(engine, gp, names):
    """The named parameters' values read inside a read-only GatheredParameters, on every rank."""
    named = _named(engine)
    with gp([named[n] for n in names]):
        inside = dict(engine.module.named_parameters())
        return {n: inside[n].detach().float().clone() for n in names}


def _set_full(utils, stage, deepspeed: bool, name: str):
    """``utils``' full setter ``name``; DeepSpeed's at stage 3 through its local setter, its
    partition cut from the value: its full setters narrow the value by the padded partition
    size, past the end on the last rank where the size is not a multiple of the world's."""
    if not (deepspeed and stage == 3):
        return getattr(utils, name)
    local = getattr(utils, name.replace("full", "local"))

    def set_(p, value, *key):
        part, rank = p.ds_tensor.numel(), dist.get_rank()
        flat = torch.zeros(part * dist.get_world_size())
        flat[: value.numel()] = value.reshape(-1).float()
        local(p, flat[rank * part : (rank + 1) * part], *key)

    return set_


def _edit(engine, gp, utils, stage, deepspeed: bool):
    """blocks.0.weight halved and out.bias + 1 on the last rank inside GatheredParameters(modifier_rank=it).
    DeepSpeed's engine also gets the edit into its fp32 master (safe_set_full_fp32_param), and at
    stages 1/2 (where its GatheredParameters does nothing) on every rank: the run both then train."""
    last, named = dist.get_world_size() - 1, _named(engine)
    target = {
        "blocks.0.weight": utils.safe_get_full_fp32_param(named["blocks.0.weight"]) * 0.5,
        "out.bias": utils.safe_get_full_fp32_param(named["out.bias"]) + 1.0,
    }
    with gp([named["blocks.0.weight"], named["out.bias"]], modifier_rank=last):
        if dist.get_rank() == last or (deepspeed and stage < 3):
            m = engine.module
            m.blocks[0].weight.data.mul_(0.5)
            m.out.bias.data.add_(1.0)
    if deepspeed:
        for n, v in target.items():
            _set_full(utils, stage, deepspeed, "safe_set_full_fp32_param")(named[n], v)
    return target


def _local_or_full(utils, stage, deepspeed, get, set_full, p, fn, *key):
    """``fn`` applied to ``p``'s local part (zeroshard at every stage, DeepSpeed at stage 3, where
    its local API exists), else to the whole value: the same change either way."""
    if deepspeed and stage < 3:
        _set_full(utils, stage, deepspeed, set_full)(p, fn(getattr(utils, get.replace("local", "full"))(p, *key)), *key)
    else:
        getattr(utils, get.replace("get", "set"))(p, fn(getattr(utils, get)(p, *key)), *key)


def _boundary_helpers(engine, utils, stage, deepspeed):
    """At the accumulation boundary: every getter read, then one setter of each kind."""
    named = _named(engine)
    read = dict(
        grads={n: utils.safe_get_full_grad(p).float().clone() for n, p in named.items()},
        values=full_params(engine, utils),
        exp_avg={n: utils.safe_get_full_optimizer_state(p, "exp_avg").clone() for n, p in named.items()},
        exp_avg_sq={n: utils.safe_get_full_optimizer_state(p, "exp_avg_sq").clone() for n, p in named.items()},
    )
    full = functools.partial(_set_full, utils, stage, deepspeed)
    full("safe_set_full_grad")(named["inp.weight"], read["grads"]["inp.weight"] * 3)
    _local_or_full(
        utils, stage, deepspeed, "safe_get_local_grad", "safe_set_full_grad", named["blocks.1.weight"], lambda g: g * 2
    )
    full("safe_set_full_fp32_param")(named["out.weight"], read["values"]["out.weight"] * 0.5)
    _local_or_full(
        utils,
        stage,
        deepspeed,
        "safe_get_local_fp32_param",
        "safe_set_full_fp32_param",
        named["blocks.0.bias"],
        lambda v: v + 0.01,
    )
    full("safe_set_full_optimizer_state")(named["blocks.0.weight"], torch.zeros(13, 13), "exp_avg")
    _local_or_full(
        utils,
        stage,
        deepspeed,
        "safe_get_local_optimizer_state",
        "safe_set_full_optimizer_state",
        named["inp.bias"],
        lambda v: v * 0.5,
        "exp_avg_sq",
    )
    return read


def helpers(stage):
    """One DeepSpeed and one zeroshard engine at ``stage``, the same calls on each; every value
    read on every rank, returned from rank 0."""
    ds = ds_setup()
    cfg = base(stage)
    out = {}
    for who in ("ds", "zs"):
        init, gp, utils = _api(ds if who == "ds" else None)
        engine = _engine(init, cfg)
        res = out[who] = {"attrs": (engine.id, engine.width(), type(engine.blocks).__name__)}
        res["target"] = _edit(engine, gp, utils, stage, who == "ds")
        res["edited"] = _gathered_values(engine, gp, list(res["target"]))
        _steps(engine, 0, 2)
        res["after_edit"] = full_params(engine, utils)
        engine.empty_partition_cache()
        _accumulate(engine, 2)
        res["read"] = _boundary_helpers(engine, utils, stage, who == "ds")
        engine.step()
        res["after_set"] = full_params(engine, utils)
        _steps(engine, 3, 1)
        res["final"] = full_params(engine, utils)
    return out


def bf16_edit():
    """GatheredParameters(modifier_rank=last) on bf16 parameters: DeepSpeed's at stage 3 (its
    edit, gathered), zeroshard's at stage 2, where the fp32 master is made again from the edited
    parameters (what safe_get_full_fp32_param reads)."""
    ds = ds_setup()
    out = {}
    for who, stage in (("ds", 3), ("zs", 2)):
        init, gp, utils = _api(ds if who == "ds" else None)
        engine = _engine(init, base(stage, bf16={"enabled": True}))
        with gp([_named(engine)["blocks.0.weight"]], modifier_rank=dist.get_world_size() - 1):
            if dist.get_rank() == dist.get_world_size() - 1:
                engine.module.blocks[0].weight.data.mul_(0.5).add_(0.25)
        out[who] = _gathered_values(engine, gp, ["blocks.0.weight"])
        if who == "zs":
            out["master"] = full_params(engine, utils)["blocks.0.weight"]
    return out


def _client_pair(init, stage, optimizer, scheduler=None, **extra):
    cfg = base(
        stage,
        zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}},
        zero_force_ds_cpu_optimizer=False,
        **extra,
    )
    del cfg["optimizer"]
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    engine = _engine(init, cfg, optimizer=optimizer)
    lrs = []
    for s in range(3):
        _steps(engine, s, 1)
        lrs.append(engine.get_lr())
    return engine, lrs


def _refusal(fn):
    try:
        fn()
    except (AssertionError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


LRRT = {
    "type": "LRRangeTest",
    "params": {
        "lr_range_test_min_lr": 1e-3,
        "lr_range_test_step_size": 2,
        "lr_range_test_step_rate": 3.0,
        "lr_range_test_staircase": True,
    },
}


def client_optimizers():
    """Each client optimizer on both engines (stage 2, offload_optimizer cpu): (DeepSpeed's
    parameters and learning rates, zeroshard's) by case; the refusals without the flag."""
    ds = ds_setup()
    cases = {
        "adam-l2": (2, lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1), LRRT, {}),
        "adam": (3, lambda ps: torch.optim.Adam(ps, lr=1e-2), None, {}),
        "untested": (
            1,
            lambda ps: SignSGD(ps, lr=1e-2),
            dict(LRRT, params=dict(LRRT["params"], lr_range_test_staircase=False)),
            {"zero_allow_untested_optimizer": True},
        ),
    }
    out = {}
    for name, (stage, make, sched, extra) in cases.items():
        pair = []
        for who in ("ds", "zs"):
            init, _, utils = _api(ds if who == "ds" else None)
            engine, lrs = _client_pair(init, stage, make, sched, **extra)
            pair.append((full_params(engine, utils), lrs))
        out[name] = pair
    out["refused"] = [
        _refusal(lambda: _client_pair(init, 1, lambda ps: SignSGD(ps)))
        for init in (ds.initialize, zeroshard.initialize)
    ]
    return out


def second_initialize(stage, root):
    """Two steps on a first engine, a second initialize over the same model (a fresh optimizer),
    two more steps, on both; a checkpoint of each loaded into a plain model by each library's
    load_state_dict_from_zero_checkpoint (under ``root``). zeroshard's first engine refuses to
    train afterwards, and so does the second once destroyed."""
    ds = ds_setup()
    cfg = base(stage)
    out = {}
    for who in ("ds", "zs"):
        init, _, utils = _api(ds if who == "ds" else None)
        first = _engine(init, cfg)
        _steps(first, 0, 2)
        second = _engine(init, cfg, model=first.module)
        _steps(second, 2, 2)
        out[who] = full_params(second, utils)
        second.save_checkpoint(f"{root}/{who}{stage}")
        if dist.get_rank() == 0:
            if who == "ds":
                from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
            else:
                from zeroshard.zero_to_fp32 import load_state_dict_from_zero_checkpoint
            loaded = load_state_dict_from_zero_checkpoint(Tagged(), f"{root}/{who}{stage}")
            out[f"{who}-loaded"] = {n: p.detach().clone() for n, p in loaded.named_parameters()}
        dist.barrier()
        if who == "zs":
            out["first"] = _refusal_runtime(lambda: _steps(first, 4, 1))
            second.destroy()
            out["destroyed"] = _refusal_runtime(lambda: _steps(second, 4, 1))
    return out


def _refusal_runtime(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def frozen_checkpoint(stage, root):
    """save_checkpoint(exclude_frozen_parameters=True) with blocks.0 frozen, then a fresh model
    (other initial values) loaded with load_module_strict=False and trained one more step, on
    both; the strict load of such a checkpoint refused by both."""
    ds = ds_setup()
    cfg = base(stage)
    out = {}
    for who in ("ds", "zs"):
        init, gp, utils = _api(ds if who == "ds" else None)
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            m = Tagged()
            m.blocks[0].requires_grad_(False)
            models.append(m)
        first = _engine(init, cfg, model=models[0])
        _steps(first, 0, 2)
        first.save_checkpoint(f"{root}/frozen-{who}{stage}", exclude_frozen_parameters=True)
        fresh = {n: p.detach().clone() for n, p in models[1].named_parameters()}
        second = _engine(init, cfg, model=models[1])
        try:
            second.load_checkpoint(f"{root}/frozen-{who}{stage}")
            out[f"{who}-strict"] = None
        except Exception as e:  # noqa: BLE001 - each library's own refusal
            out[f"{who}-strict"] = f"{type(e).__name__}: {e}"
        second.load_checkpoint(f"{root}/frozen-{who}{stage}", load_module_strict=False)
        _steps(second, 2, 1)
        frozen = ["blocks.0.weight", "blocks.0.bias"]
        out[who] = {n: utils.safe_get_full_fp32_param(p).clone() for n, p in _named(second).items() if n not in frozen}
        out[who].update(_gathered_values(second, gp, frozen))
        out[f"{who}-fresh"] = {n: fresh[n] for n in frozen}
    return out
