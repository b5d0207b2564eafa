"""Rank-side code of test_deepspeed_engine.py's front-door test: the same model and data
under deepspeed.initialize and zeroshard.initialize wherever DeepSpeed's config or the
script itself could change the numbers: gradient_allreduce_op, prescale_gradients,
gradient_predivide_factor, the script's own loss.backward() (engine.scale(loss) with fp16),
a parameter nothing uses (at stages 0-3), deepspeed.zero.Init against zeroshard.zero.Init, and a model
built on meta. SGD without clipping where a factor on the gradients is in question (Adam's
step does not see one)."""

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard
from support.ds import Net, base, batch, ds_setup, params_of

SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def sgd(stage, **extra):
    zero = extra.pop("zero", {})
    return base(
        stage,
        optimizer=copy.deepcopy(SGD),
        zero_allow_untested_optimizer=True,
        gradient_clipping=0.0,
        zero_optimization=dict({"stage": stage}, **zero),
        **extra,
    )


def train(init, cfg, steps=2, direct=None, model=None, start=None, make=Net):
    """(engine, losses): ``steps`` optimizer steps of ``make()`` (or ``model``, or continuing ``start``);
    ``direct``: the script's own backward, "plain" (``loss.backward()``) or "scale"
    (``engine.scale(loss).backward()``), else ``engine.backward(loss)``."""
    if start is None:
        if model is None:
            torch.manual_seed(0)
            model = make()
        start = init(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))[0]
    engine, losses = start, []
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float16 if engine.fp16_enabled() else torch.float32
    for s in range(steps):
        for m in range(engine.gradient_accumulation_steps()):
            x, y = batch(s, m, rank, world, engine.train_micro_batch_size_per_gpu())
            loss = ((engine(x.to(dtype)).float() - y) ** 2).mean()
            if direct == "plain":
                loss.backward()
            elif direct == "scale":
                engine.scale(loss).backward()
            else:
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return engine, losses


def pair(cfg, steps=2, **kw):
    """[DeepSpeed's, zeroshard's] (parameters, last grad norm, losses) for ``cfg``."""
    deepspeed = ds_setup()
    out = []
    for init, theirs in ((deepspeed.initialize, True), (zeroshard.initialize, False)):
        engine, losses = train(init, cfg, steps, **kw)
        norm = engine.get_global_grad_norm()  # (DeepSpeed's stage 0 keeps none)
        out.append(
            dict(params=params_of(engine, deepspeed=theirs), norm=None if norm is None else float(norm), losses=losses)
        )
    return out


def refusals(cfg, inits=("deepspeed", "zeroshard"), **kw):
    """What building and one step raise under each of ``inits`` (None: nothing)."""
    deepspeed = ds_setup()
    got = []
    for name in inits:
        try:
            train(deepspeed.initialize if name == "deepspeed" else zeroshard.initialize, cfg, 1, **kw)
            got.append(None)
        except (AssertionError, ValueError, RuntimeError) as e:
            got.append(f"{type(e).__name__}: {e}")
    return got


class Unused(Net):
    """Net with a layer its forward never calls."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(3, 3)


class Gain(nn.Module):
    """A module whose own __init__ sets its parameter's values (it has no reset_parameters)."""

    def __init__(self, n):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, n))


class Filled(Net):
    """Net whose __init__ initialises its children after they are built: through apply (run on
    the gathered parameters under either zero.Init) and by writing out.weight directly (a meta
    tensor, or DeepSpeed's empty partition, by then: lost under both)."""

    def __init__(self):
        super().__init__()
        self.gain = Gain(13)
        self.apply(self.init_weights)
        nn.init.constant_(self.out.weight, 0.1)

    @staticmethod
    def init_weights(m):
        if isinstance(m, nn.Linear) and m.out_features == 13:
            nn.init.normal_(m.weight, std=0.4)
            nn.init.zeros_(m.bias)

    def forward(self, x):
        h = torch.tanh(self.inp(x)) * self.gain.g
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


def _recorded(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen]


def zero_init():
    """deepspeed.zero.Init and zeroshard.zero.Init on Filled, trained at stage 3 (and stage 2,
    zeroshard's only); the values right after construction; a plain Filled for reference."""
    from zeroshard.integrations.deepspeed import zero_init as zi

    deepspeed = ds_setup()
    torch.manual_seed(0)
    plain = {k: v.detach().clone() for k, v in Filled().named_parameters()}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=base(3)):
        theirs = Filled()
    out = {"theirs": params_of(train(deepspeed.initialize, base(3), model=theirs)[0], deepspeed=True)}
    for stage in (3, 2):
        torch.manual_seed(0)

        def build():
            with zeroshard.zero.Init(config_dict_or_path=base(stage)):
                return Filled()

        ours, said = _recorded(build)
        held, whole = zi.held_numel(ours)
        meta = all(p.is_meta for p in ours.parameters())
        engine = zeroshard.initialize(model=ours, model_parameters=ours.parameters(), config=base(stage))[0]
        first = params_of(engine)
        out[stage] = dict(
            held=held,
            whole=whole,
            meta=meta,
            said=said,
            first=first,
            params=params_of(train(zeroshard.initialize, base(stage), start=engine)[0]),
        )
    out["plain"] = plain
    with torch.device("meta"):
        on_meta = Filled()
    out["meta_said"] = _recorded(lambda: zeroshard.initialize(model=on_meta, config=base(3)))[1]
    return out


def front_door():
    """Every case, on every rank; rank 0's results."""
    world = dist.get_world_size()
    res = {f"sum-stage{s}": pair(sgd(s, gradient_allreduce_op="sum")) for s in (1, 2)}
    res["prescale-stage1"] = pair(sgd(1, prescale_gradients=True))
    res["predivide-stage2"] = pair(sgd(2, gradient_predivide_factor=4.0, zero={"reduce_scatter": False}))
    res["predivide-stage3"] = pair(sgd(3, gradient_predivide_factor=4.0, zero={"reduce_scatter": False}))
    res.update({f"direct-stage{s}": pair(sgd(s, gradient_accumulation_steps=4), direct="plain") for s in (1, 2, 3)})
    fp16 = sgd(2, fp16={"enabled": True, "initial_scale_power": 8})
    res["fp16-scale-stage2"] = pair(fp16, direct="scale")
    # DeepSpeed's ZeRO-3 with gradient_predivide_factor = world size (zeroshard refuses it): one step's norm
    deepspeed = ds_setup()
    at_world = {"gradient_predivide_factor": float(world), "zero": {"reduce_scatter": False}}
    res["ds-stage3-factor"] = [
        float(train(deepspeed.initialize, sgd(3, **kw), 1)[0].get_global_grad_norm()) for kw in (at_world, {})
    ]
    # a parameter nothing uses: DeepSpeed's ZeRO steps it with a zero gradient (AdamW's decay moves it)
    res.update({f"unused-stage{st}": pair(base(st), 3, make=Unused) for st in (0, 1, 2, 3)})
    torch.manual_seed(0)
    res["unused-initial"] = Unused().extra.weight.detach().clone()
    offload = base(
        2,
        zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}, "ignore_unused_parameters": False},
        zero_force_ds_cpu_optimizer=False,
    )
    res["unused-refused"] = refusals(offload, ("zeroshard",), make=Unused)
    res["refused"] = {
        "sum-stage3": refusals(sgd(3, gradient_allreduce_op="sum")),
        "prescale-stage2": refusals(sgd(2, prescale_gradients=True)),
        "predivide-stage3": refusals(sgd(3, gradient_predivide_factor=2.0)),
        "fp16-plain-backward": refusals(fp16, direct="plain"),
    }
    res["zero_init"] = zero_init()
    return res if dist.get_rank() == 0 else None
