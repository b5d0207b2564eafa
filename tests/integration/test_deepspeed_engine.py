"""zeroshard.initialize side by side with deepspeed.initialize (DeepSpeed is a test-only
dependency, run on CPU with DS_ACCELERATOR=cpu, in the same gloo process groups).

One launch per world size runs the same script and config under both, config after
config, and the parent compares: losses and final parameters within 1e-5 (fp32) at
stages 1-3 with accumulation, clipping and WarmupDecayLR, with CPU offload; with fp16
dynamic loss scaling, the same skipped steps and loss scales. Seed and public configs
run unchanged (DeepSpeed too where it can on CPU, else DDP + torch's AdamW). Checkpoints
resume exactly and reshard 2 -> 3 ranks, stage 3 -> 2; zero_to_fp32 loads into the plain model.

Two DeepSpeed-side settings keep DeepSpeed on CPU without building C++ ops: its shared-memory
collectives op is marked unavailable (gloo is used), and its accelerator is told fp16 works
(the CPU accelerator refuses fp16 on CPUs without AVX512-FP16, though torch runs it).
"""

import copy
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import zeroshard
from support.ds import Net, base, batch, ds_setup, params_of
from support.ds_configs import CIFAR, MEGATRON_Z3, QANET, SEED_000, SEED_003, SEED_003_NVME
from support.launch import launch

STEPS = 6


def train(init, cfg, steps=STEPS, inject=(), optimizer=None, start=None):
    """Build with ``init`` (or continue ``start``), train ``steps`` optimizer steps; returns
    (engine, losses, applied, scales)."""
    if start is None:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters()) if optimizer == "client" else None
        engine = init(model=model, model_parameters=model.parameters(), optimizer=opt, config=copy.deepcopy(cfg))[0]
    else:
        engine = start
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float16 if engine.fp16_enabled() else torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    losses, applied, scales = [], [], []
    first = engine.global_steps
    for s in range(first, first + steps):
        for m in range(engine.gradient_accumulation_steps()):
            x, y = batch(s, m, rank, world, engine.train_micro_batch_size_per_gpu(), inject)
            loss = ((engine(x.to(dtype)).float() - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        applied.append(engine.was_step_applied())
        scale = getattr(engine, "loss_scaler", None)
        scales.append(scale.scale if scale is not None else float(getattr(engine.optimizer, "cur_scale", 1.0)))
    return engine, losses, applied, scales


def reference(cfg, steps=STEPS):
    """DDP + torch.optim.AdamW in one process: every rank's micro-batches, averaged."""
    from zeroshard.integrations.deepspeed import lr_schedules

    torch.manual_seed(0)
    model = Net()
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=p["betas"], weight_decay=p["weight_decay"])
    sched = lr_schedules.from_config(cfg["scheduler"]["type"], dict(cfg["scheduler"]["params"]), opt)
    world, gas, n = dist.get_world_size(), cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]
    for s in range(steps):
        for m in range(gas):
            for r in range(world):
                x, y = batch(s, m, r, world, n)
                (((model(x) - y) ** 2).mean() / (gas * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"])
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _float(x):
    return None if x is None else float(x)


def _side_by_side(configs, with_reference=True):
    """On every rank: each config under DeepSpeed and zeroshard (and DDP); rank 0's results."""
    deepspeed = ds_setup()
    out = {}
    for name, cfg, kw in configs:
        ds_cfg = kw.pop("ds_config", cfg)
        e1, l1, a1, s1 = train(deepspeed.initialize, ds_cfg, **kw)
        e2, l2, a2, s2 = train(zeroshard.initialize, cfg, **kw)
        p1, p2 = params_of(e1, deepspeed=True), params_of(e2)
        ref = reference(cfg) if with_reference and not kw.get("inject") else None
        out[name] = dict(
            losses=(l1, l2),
            applied=(a1, a2),
            scales=(s1, s2),
            params=(p1, p2),
            ref=ref,
            norms=(_float(e1.get_global_grad_norm()), e2.get_global_grad_norm()),
            lr=(e1.get_lr(), e2.get_lr()),
        )
    return out if dist.get_rank() == 0 else None


def _close(a: dict, b: dict, tol: float) -> float:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, f"parameters differ by {worst} (> {tol})"
    return worst


FP32 = [
    ("stage1", base(1), {}),
    ("stage2", base(2), {}),
    ("stage3", base(3), {}),
    (
        "stage2+offload",
        base(
            2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}, zero_force_ds_cpu_optimizer=False
        ),
        {},
    ),
    (
        "stage3+offload",
        base(
            3,
            zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
            zero_force_ds_cpu_optimizer=False,
        ),
        {},
    ),
]


@pytest.mark.timeout(300)
def test_same_losses_and_parameters_as_deepspeed_and_ddp(dist_pool):
    res = dist_pool.run(_side_by_side, copy.deepcopy(FP32), timeout=240)[0]
    for name, r in res.items():
        (l1, l2), (p1, p2) = r["losses"], r["params"]
        assert max(abs(a - b) for a, b in zip(l1, l2)) <= 1e-5, name
        _close(p1, p2, 1e-5)
        _close(r["ref"], p2, 1e-5)
        assert r["applied"][0] == r["applied"][1] == [True] * STEPS, name
        assert abs(r["norms"][0] - r["norms"][1]) <= 1e-5 and r["lr"][0] == r["lr"][1], name


def fp16_config(stage):
    return base(
        stage,
        fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2},
        gradient_clipping=0.05,
    )


@pytest.mark.timeout(300)
def test_fp16_skips_the_same_steps_with_the_same_scales_as_deepspeed(dist_pool):
    """Overflows injected at steps 1, 2 and 5 (an inf input on rank 0): the first only uses up
    the hysteresis, the second halves the scale; three clean steps double it. Clipping is
    always active here, so DeepSpeed's unscale by the already-doubled scale (see
    loss_scaler.py) does not change its result."""
    configs = [(f"fp16-stage{s}", fp16_config(s), {"steps": 8, "inject": (1, 2, 5)}) for s in (1, 2, 3)]
    res = dist_pool.run(_side_by_side, configs, timeout=240)[0]
    for name, r in res.items():
        assert r["applied"][0] == r["applied"][1] == [True, False, False, True, True, False, True, True], name
        assert r["scales"][0] == r["scales"][1], (name, r["scales"])
        _close(r["params"][0], r["params"][1], 2e-3)  # fp16 parameters: a few ulps


# -------------------------------------------------- seed and public configs, unchanged
# (the configs themselves: tests/_ds_configs.py, which the unit tests read too)
def for_deepspeed_on_cpu(cfg):
    """What DeepSpeed alone needs to run a config on CPU without building C++ ops: torch's
    Adam (its CPU and fused Adams are compiled; its own kernels' weight_decay default is 0),
    the offloaded step left to a torch optimizer, and no fp16 master weights (DeepSpeed runs
    those only with its compiled DeepSpeedCPUAdam; zeroshard keeps an fp32 master anyway)."""
    cfg = copy.deepcopy(cfg)
    cfg.get("fp16", {}).pop("fp16_master_weights_and_grads", None)
    params = cfg.get("optimizer", {}).get("params")
    if params is not None:
        params.setdefault("weight_decay", 0.0)
        params["torch_adam"] = True
    cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def seed_configs(tmp):
    """Seed configs with only what DeepSpeed itself demands added: a micro-batch size where
    they have none (deepspeed.initialize refuses a config without one), and nvme_path where
    this machine has a disk."""
    s000 = dict(copy.deepcopy(SEED_000), train_micro_batch_size_per_gpu=2)
    nvme = dict(copy.deepcopy(SEED_003_NVME), train_micro_batch_size_per_gpu=2)
    for k in ("offload_optimizer", "offload_param"):
        nvme["zero_optimization"][k]["nvme_path"] = tmp
    return s000, nvme


def _unchanged(tmp):
    s000, nvme = seed_configs(tmp)
    configs = [
        ("seed000", s000, {"optimizer": "client", "steps": 2}),
        ("seed003", copy.deepcopy(SEED_003), {"optimizer": "client", "steps": 2}),
        ("cifar", CIFAR, {"steps": 2}),
        ("megatron-zero3", MEGATRON_Z3, {"steps": 2}),
        ("qanet-onecycle", QANET, {"steps": 2}),
    ]
    for _, cfg, kw in configs:
        kw["ds_config"] = for_deepspeed_on_cpu(cfg)
    out = _side_by_side(configs, with_reference=False)
    engine = train(zeroshard.initialize, nvme, steps=2, optimizer="client")[0]  # DeepSpeed's nvme needs its aio op
    ddp = _client_reference(nvme, engine)
    mine = params_of(engine)
    if out is not None:
        out["seed003-nvme"] = dict(params=(ddp, mine))
    return out


def _client_reference(cfg, engine, steps=2):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    world, gas, n = dist.get_world_size(), engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    for s in range(steps):
        for m in range(gas):
            for r in range(world):
                x, y = batch(s, m, r, world, n)
                (((model(x) - y) ** 2).mean() / (gas * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed 0.19's default clipping
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore")
def test_seed_and_public_configs_run_unchanged(tmp_path):
    res = launch("pool", 2).run(_unchanged, str(tmp_path), timeout=240)[0]
    for name, r in res.items():
        p1, p2 = r["params"]
        fp16 = name in ("seed003", "cifar", "megatron-zero3")
        _close(p1, p2, 2e-3 if fp16 else 1e-5)
        if "applied" in r:
            assert r["applied"][0] == r["applied"][1] and r["scales"][0] == r["scales"][1], name


# ------------------------------------------------------------------ checkpoints
def ckpt_config(stage):
    cfg = base(stage, train_batch_size=12)
    del cfg["train_micro_batch_size_per_gpu"]  # 3 per rank at world size 2, 2 at world size 3
    return cfg


def _save_and_resume(root):
    """World 2, stage 3: 6 steps uninterrupted; 3 steps, save, 3 more; a fresh engine loads
    the checkpoint and takes the same 3 steps."""
    whole = params_of(train(zeroshard.initialize, ckpt_config(3))[0])
    engine = train(zeroshard.initialize, ckpt_config(3), steps=3)[0]
    engine.save_checkpoint(root, client_state={"epoch": 7})
    at_save = params_of(engine)
    continued = params_of(train(None, None, steps=3, start=engine)[0])
    torch.manual_seed(1)
    fresh = zeroshard.initialize(model=Net(), config=ckpt_config(3))[0]
    path, client = fresh.load_checkpoint(root)
    assert client == {"epoch": 7} and path.endswith("global_step3") and fresh.global_steps == 3
    resumed = train(None, None, steps=3, start=fresh)[0]
    return dict(whole=whole, at_save=at_save, continued=continued, resumed=params_of(resumed), lr=resumed.get_lr())


def _reshard(root):
    """World 3, stage 2: load the world-2 stage-3 checkpoint and take the last 3 steps."""
    torch.manual_seed(1)
    engine = zeroshard.initialize(model=Net(), config=ckpt_config(2))[0]
    engine.load_checkpoint(root)
    assert engine.global_steps == 3 and engine.lr_scheduler.last_batch_iteration == 2
    engine = train(None, None, steps=3, start=engine)[0]
    return dict(params=params_of(engine), lr=engine.get_lr(), steps=engine.global_steps)


@pytest.mark.timeout(300)
def test_checkpoints_resume_exactly_reshard_and_export(tmp_path):
    from zeroshard.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = str(tmp_path / "ckpt")
    saved = launch("pool", 2).run(_save_and_resume, root)[0]
    _close(saved["continued"], saved["resumed"], 0.0)  # same world size: exact
    moved = launch("pool", 3).run(_reshard, root)[0]
    _close(saved["whole"], moved["params"], 1e-5)  # 2 -> 3 ranks, stage 3 -> 2
    assert moved["lr"] == saved["lr"] and moved["steps"] == 6
    assert open(os.path.join(root, "latest")).read() == "global_step3"
    sd = get_fp32_state_dict_from_zero_checkpoint(root)
    plain = Net()
    plain.load_state_dict(sd)  # the plain model's own names
    _close({k: v.detach() for k, v in plain.named_parameters()}, saved["at_save"], 0.0)
    out = tmp_path / "export"
    res = subprocess.run(
        [sys.executable, "-m", "zeroshard.zero_to_fp32", root, str(out)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    exported = torch.load(out / "pytorch_model.bin", weights_only=True)
    _close(exported, sd, 0.0)


# ------------------------------------------------------------------ precision
def _bf16_against_deepspeed():
    """zeroshard's bf16 stage 3 (the units' gather dtypes, from the flight record) and DeepSpeed's,
    each against DeepSpeed's fp32 stage 3: (gathers, zeroshard's distance, DeepSpeed's)."""
    from support.records import unit_gather_dtypes

    deepspeed = ds_setup()
    bf16 = base(3, bf16={"enabled": True})
    t0 = time.time()
    engine = train(zeroshard.initialize, bf16)[0]
    ours, gathers = params_of(engine), unit_gather_dtypes(t0)
    theirs_engine = train(deepspeed.initialize, bf16)[0]
    theirs = params_of(theirs_engine, deepspeed=True)
    # where a script sends its inputs (x.to(engine.device)) and which GPU is its own
    assert (str(engine.device), engine.local_rank) == (str(theirs_engine.device), theirs_engine.local_rank), (
        engine.device,
        engine.local_rank,
        theirs_engine.device,
        theirs_engine.local_rank,
    )
    fp32 = params_of(train(deepspeed.initialize, base(3))[0], deepspeed=True)
    far = lambda a: max((a[k].float() - fp32[k]).abs().max().item() for k in fp32)  # noqa: E731
    return gathers, far(ours), far(theirs)


def test_bf16_config_gathers_every_unit_in_bf16_at_stage_3():
    """``"bf16": {"enabled": true}`` at stage 3: every unit all-gather in bf16, from the flight record,
    and the run as far from DeepSpeed's fp32 run as DeepSpeed's own bf16 run is (within its noise)."""
    for gathers, ours, theirs in launch("pool", 2).run(_bf16_against_deepspeed):
        assert gathers == ["bfloat16"]
        assert 0 < theirs and ours <= 1.5 * theirs, (ours, theirs)
        print(f"bf16 stage 3 from DeepSpeed's fp32 run: zeroshard {ours:.2e}, DeepSpeed {theirs:.2e}")


# ------------------------------------------------- DeepSpeed's user-facing helpers
# (the rank-side code: tests/_ds_helpers_job.py; the same calls on a DeepSpeed and a zeroshard engine)
def _helpers_all_stages(root):
    from support.jobs import ds_helpers_job as job

    return dict(
        {s: job.helpers(s) for s in (1, 2, 3)},
        clients=job.client_optimizers(),
        second={s: job.second_initialize(s, root) for s in (2, 3)},
        bf16=job.bf16_edit(),
        frozen={s: job.frozen_checkpoint(s, root) for s in (1, 3)},
    )


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore")
def test_helpers_act_as_deepspeeds(tmp_path):
    """GatheredParameters(modifier_rank=last) edits every rank's parameters and fp32 master
    (DeepSpeed's at stage 3, and its master set alike); deepspeed.utils' getters read what
    DeepSpeed's read and its setters (full and local: parameter, gradient, optimizer state)
    change the next step as DeepSpeed's do; engine attributes are the module's; torch's Adam
    and an untested class with CPU offload, LRRangeTest and a second initialize over the same
    model train as DeepSpeed does; load_state_dict_from_zero_checkpoint fills a plain model as
    DeepSpeed's does from its own checkpoint."""
    # at 3 ranks only (uneven chunks): each comparison with DeepSpeed costs seconds a world size
    dist_pool = launch("pool", 3)
    ranks = dist_pool.run(_helpers_all_stages, str(tmp_path), timeout=240)
    res = ranks[0]
    for stage in (1, 2, 3):
        ds, zs = res[stage]["ds"], res[stage]["zs"]
        assert ds["attrs"] == zs["attrs"] == ("tagged-net", 13, "ModuleList"), stage
        _close(ds["target"], zs["edited"], 1e-6)  # the modifier rank's edit, on rank 0 too
        if stage == 3:
            _close(ds["edited"], zs["edited"], 1e-6)  # DeepSpeed's own GatheredParameters, gathered
        for key in ("after_edit", "after_set", "final"):
            _close(ds[key], zs[key], 1e-5)
        for key in ("grads", "values", "exp_avg"):
            _close(ds["read"][key], zs["read"][key], 1e-6)
        _close(ds["read"]["exp_avg_sq"], zs["read"]["exp_avg_sq"], 1e-9)
    for r in ranks[1:]:  # every rank holds the edited, then trained, parameters
        _close(r[3]["zs"]["final"], res[3]["zs"]["final"], 0.0)
    for name, ((p1, lr1), (p2, lr2)) in ((k, v) for k, v in res["clients"].items() if k != "refused"):
        _close(p1, p2, 1e-5)
        assert lr1 == lr2, (name, lr1, lr2)
    theirs, ours = res["clients"]["refused"]
    assert "zero_allow_untested_optimizer" in theirs and "zero_allow_untested_optimizer" in ours, (theirs, ours)
    for stage, r in res["second"].items():
        _close(r["ds"], r["zs"], 1e-5)
        _close(r["ds-loaded"], r["zs-loaded"], 1e-5)
        _close(r["zs-loaded"], r["zs"], 0.0)
        assert "destroyed engine" in r["first"] and "destroyed engine" in r["destroyed"], stage
    for stage, r in res["frozen"].items():  # exclude_frozen_parameters, load_module_strict=False
        _close(r["ds"], r["zs"], 1e-5)
        _close(r["zs-fresh"], {n: r["zs"][n] for n in r["zs-fresh"]}, 0.0)  # the loading model's own values
        assert r["ds-strict"] is not None and "blocks.0.weight" in r["zs-strict"], (stage, r["zs-strict"])
    for r in ranks:  # bf16: the same edit as DeepSpeed's, and the fp32 master made from it
        bf16 = r["bf16"]
        _close(bf16["ds"], bf16["zs"], 0.0)
        assert torch.equal(bf16["master"], bf16["zs"]["blocks.0.weight"].float())


# ------------------------------------------ the front door never changes numbers silently
# (the rank-side code: tests/_ds_front_door_job.py)
def _front_door():
    from support.jobs import ds_front_door_job as job

    return job.front_door()


def _refused_alike(refused: dict):
    """Each case DeepSpeed refuses, zeroshard refuses too, naming the option."""
    names = {
        "sum-stage3": ("gradient_allreduce_op", "gradient_allreduce_op"),
        "prescale-stage2": ("pre-scale", "prescale_gradients"),
        "predivide-stage3": ("gradient_predivide_factor", "gradient_predivide_factor"),
        "fp16-plain-backward": ("Loss scaling is required", "engine.scale(loss)"),
    }
    assert refused.keys() == names.keys()
    for case, (theirs, ours) in refused.items():
        assert theirs and names[case][0] in theirs, (case, theirs)
        assert ours and names[case][1] in ours, (case, ours)


def _zero_init_alike(z: dict, world: int):
    """zeroshard.zero.Init against deepspeed.zero.Init on tests/_ds_front_door_job.Filled."""
    for stage in (3, 2):
        r = z[stage]
        _close(z["theirs"], r["params"], 1e-5)  # trained alike (DeepSpeed: stage 3)
        assert r["meta"] and r["whole"] / world <= r["held"] <= r["whole"] / world + 9, (r["held"], r["whole"])
        for name, value in r["first"].items():  # what the parent's apply set: kept
            assert (value == z["plain"][name]).all() == (name != "out.weight"), name
        assert not (r["first"]["out.weight"] == 0.1).any()  # its direct write: lost, as DeepSpeed's
        said = [s for s in r["said"] if "zero.Init" in s]
        assert len(said) == 1 and "Filled.__init__" in said[0] and "'out.weight" in said[0], r["said"]
    lost = [s for s in z["meta_said"] if "built on the meta device" in s]
    assert len(lost) == 1 and "'out.weight'" in lost[0] and "'inp.weight'" in lost[0], z["meta_said"]


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore")
def test_the_front_door_never_changes_numbers_silently():
    """Against DeepSpeed on the same model and data (SGD without clipping, so a factor on the
    gradients shows): gradient_allreduce_op "sum" at stages 1 and 2; prescale_gradients and
    gradient_predivide_factor where DeepSpeed runs them; the script's own loss.backward() with 4
    accumulation steps at stages 1-3 (engine.scale(loss).backward() with fp16): DeepSpeed's
    losses, parameters and grad norms. Where DeepSpeed refuses, zeroshard refuses, naming the
    option. DeepSpeed's ZeRO-3 with a predivide factor equal to the world size (zeroshard
    refuses it) has a grad norm world-size times smaller than its mean's; a parameter nothing
    uses is stepped with a zero gradient at stages 0-3 (weight decay moves it), as DeepSpeed
    does; with ignore_unused_parameters false and offload, an error naming it. A model built under
    zeroshard.zero.Init trains as under deepspeed.zero.Init, each rank holding a 1/world share
    once built; built on meta, the parameters whose initialisation is lost are named."""
    # at 3 ranks only (uneven chunks): each comparison with DeepSpeed costs seconds a world size
    dist_pool = launch("pool", 3)
    world = dist_pool.world_size
    res = dist_pool.run(_front_door, timeout=240)[0]
    compared = [k for k in res if k.startswith(("sum", "prescale", "predivide", "direct", "fp16", "unused-stage"))]
    assert len(compared) == 13
    for name in compared:
        ds, zs = res[name]
        tol = 2e-3 if name.startswith("fp16") else 1e-5
        _close(ds["params"], zs["params"], tol)
        if name != "unused-stage0":  # (DeepSpeed's stage 0 keeps no norm)
            assert abs(ds["norm"] - zs["norm"]) <= tol * ds["norm"], (name, ds["norm"], zs["norm"])
        assert max(abs(a - b) for a, b in zip(ds["losses"], zs["losses"])) <= tol, name
    factor_world, mean = res["ds-stage3-factor"]
    assert abs(mean / factor_world - world) <= 1e-4, (factor_world, mean)
    moved = [
        (res[f"unused-stage{st}"][0]["params"]["extra.weight"] - res["unused-initial"]).abs().max().item()
        for st in range(4)
    ]
    assert min(moved) > 1e-6, moved
    assert "'extra.weight'" in res["unused-refused"][0] and "ignore_unused_parameters" in res["unused-refused"][0]
    _refused_alike(res["refused"])
    _zero_init_alike(res["zero_init"], world)
