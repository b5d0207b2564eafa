"""DeepSpeed configs read by zeroshard.initialize, without processes: the batch-size rule,
the keys honoured / accepted with one warning / refused, "auto", the seed and public
configs; DeepSpeed's loss scale and LR schedules checked against DeepSpeed's own classes
(DS_ACCELERATOR=cpu); the optimizer a config names; read_full_state_dict."""

import copy
import math
import os
import warnings

import pytest
import torch
import torch.nn as nn

import zeroshard
from zeroshard.integrations.deepspeed import build, config, loss_scaler, lr_schedules
from support.ds_configs import CIFAR, MEGATRON_Z3, QANET, SEED_000, SEED_003, SEED_003_NVME

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def parse(cfg, world=2):
    return config.parse(cfg, world, warn=False)


# ------------------------------------------------------------- batch sizes
@pytest.mark.parametrize(
    "given,world,expect",
    [
        (dict(train_batch_size=32, gradient_accumulation_steps=4), 2, (32, 4, 4)),
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, (32, 4, 4)),
        (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4), 3, (48, 4, 4)),
        (dict(train_batch_size=12), 3, (12, 4, 1)),
        (dict(train_micro_batch_size_per_gpu=5), 2, (10, 5, 1)),
        (dict(train_batch_size=24, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4), 3, (24, 2, 4)),
    ],
)
def test_any_two_batch_sizes_give_the_third(given, world, expect):
    cfg = parse(given, world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expect


@pytest.mark.parametrize(
    "given,world,match",
    [
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2, "!= "),
        (dict(train_batch_size=32, gradient_accumulation_steps=4), 3, "!= "),  # 32 // 3 // 4 = 2: 24 != 32
        (dict(gradient_accumulation_steps=4), 2, "either train_batch_size"),
        ({}, 2, "either train_batch_size"),
        (dict(train_batch_size=2, gradient_accumulation_steps=4), 2, "resolves to 0"),
        (dict(train_batch_size=0), 2, "expected a int >= 1"),
    ],
)
def test_inconsistent_batch_sizes_are_refused_as_deepspeed_refuses_them(given, world, match):
    with pytest.raises(ValueError, match=match):
        parse(given, world)


# ------------------------------------------------------------------- keys
def test_tuning_keys_are_accepted_with_one_warning_listing_all_of_them():
    cfg = dict(
        train_batch_size=4,
        zero_optimization={
            "stage": 3,
            "stage3_prefetch_bucket_size": 5e7,
            "sub_group_size": 1e9,
            "reduce_bucket_size": 1e6,
        },
        flops_profiler={"enabled": False},
        zero_allow_untested_optimizer=True,
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config.parse(cfg, 2)
    assert len(seen) == 1
    text = str(seen[0].message)
    for key in (
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.sub_group_size",
        "flops_profiler",
        "reduce_bucket_size (stage 3",
    ):
        assert key in text
    assert "zero_allow_untested_optimizer" not in text  # honoured: initialize reads it


def test_a_key_deepspeed_does_not_know_is_an_error_naming_it():
    # the typo is in microsoft/DeepSpeedExamples' Megatron-LM-v1.1.5-ZeRO3 configs; DeepSpeed 0.19 refuses it too
    with pytest.raises(
        ValueError,
        match="'zero_optimization.stage3_param_persitence_threshold'.*did you mean "
        "'stage3_param_persistence_threshold'",
    ):
        parse(dict(train_batch_size=4, zero_optimization={"stage": 3, "stage3_param_persitence_threshold": 8e4}))
    with pytest.raises(ValueError, match="'train_batchsize'"):
        parse(dict(train_batch_size=4, train_batchsize=4))
    with pytest.raises(ValueError, match="'fp16.enable'"):
        parse(dict(train_batch_size=4, fp16={"enable": True}))


def test_auto_values_are_for_the_hugging_face_integration():
    with pytest.raises(ValueError, match=r"\['train_batch_size', 'optimizer.params.lr'\].*Hugging Face"):
        parse({"train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})


def test_hpz_partition_size_is_stage_3s_post_forward_shards():
    """ZeRO++ hpZ is FullyShard's reshard_after_forward=k ([Note: post-forward shards]); at
    stages 1/2 (no parameter gathers) it is listed as unused."""
    assert parse({"train_batch_size": 4, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}).zero == (
        config.Zero(stage=3, hpz_partition_size=2)
    )
    at2 = parse({"train_batch_size": 4, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    assert at2.zero.hpz_partition_size == 1 and any("zero_hpz_partition_size" in u for u in at2.unused), at2


def test_quantized_weights_are_stage_3s_int8_gathers():
    """ZeRO++ qwZ is MixedPrecision(gather_dtype="int8") ([Note: quantized gathers]: the engine's
    gathers, tests/multiprocess/test_compressed.py); listed as unused at stages 1/2."""
    cfg = parse({"train_batch_size": 4, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    assert cfg.zero.quantized_weights
    at2 = parse({"train_batch_size": 4, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}})
    assert not at2.zero.quantized_weights and any("zero_quantized_weights" in u for u in at2.unused), at2


@pytest.mark.parametrize(
    "extra,what",
    [
        ({"amp": {"enabled": True}}, "apex AMP"),
        ({"hybrid_engine": {"enabled": True}}, "hybrid engine"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, "quantized frozen"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "qgZ"),
        ({"sequence_parallel_size": 4}, "sequence parallelism"),
        ({"fp16": {"enabled": True, "auto_cast": True}}, "auto_cast"),
    ],
)
def test_features_zeroshard_lacks_are_refused(extra, what):
    with pytest.raises(NotImplementedError, match=what):
        parse(dict(train_batch_size=4, **extra))
    off = {k: ({"enabled": False} if isinstance(v, dict) and "enabled" in v else v) for k, v in extra.items()}
    if off != extra:
        parse(dict(train_batch_size=4, **off))  # disabled: accepted


def test_defaults_and_honoured_keys():
    cfg = parse(dict(train_batch_size=4))
    assert cfg.gradient_clipping == 1.0 and cfg.zero.stage == 0 and not cfg.fp16.enabled  # DeepSpeed 0.19's defaults
    assert cfg.fp16 == config.LossScaling() and cfg.fp16.initial_scale_power == 16 and cfg.fp16.hysteresis == 2
    cfg = parse(
        dict(
            train_batch_size=4,
            bf16={"enabled": True},
            communication_data_type="fp32",
            zero_optimization={"stage": 2, "cpu_offload": True, "reduce_bucket_size": 5e7},
        )
    )
    assert cfg.bf16 and cfg.communication_data_type == "float32" and cfg.zero.reduce_bucket_size == 50_000_000
    assert cfg.zero.offload_optimizer.device == "cpu"  # the deprecated spelling
    with pytest.raises(ValueError, match="both enabled"):
        parse(dict(train_batch_size=4, bf16={"enabled": True}, fp16={"enabled": True}))
    with pytest.raises(ValueError, match="nvme_path"):
        parse(dict(train_batch_size=4, zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}))


def test_seed_and_public_configs_parse_as_deepspeed_reads_them(tmp_path):
    with pytest.raises(ValueError, match="either train_batch_size"):  # as deepspeed.initialize refuses it
        parse(SEED_000)
    with pytest.raises(ValueError, match="train_batch_size 32 != train_micro_batch_size_per_gpu 2"):
        parse(SEED_003, world=3)
    s3 = parse(SEED_003)
    assert (s3.train_micro_batch_size_per_gpu, s3.zero.stage, s3.fp16.enabled) == (4, 3, True)
    assert s3.zero.offload_param.device == s3.zero.offload_optimizer.device == "cpu"
    nvme = parse(dict(copy.deepcopy(SEED_003_NVME), train_micro_batch_size_per_gpu=1))
    assert nvme.zero.offload_optimizer == config.OffloadSection(device="nvme", nvme_path="/local_nvme")
    cifar = parse(CIFAR, world=1)
    assert cifar.zero.offload_optimizer.device == "cpu" and cifar.fp16.initial_scale_power == 15
    assert "fp16.fp16_master_weights_and_grads" in cifar.unused
    assert parse(MEGATRON_Z3).unused == ("activation_checkpointing",)
    assert parse(QANET).gradient_accumulation_steps == 8 and parse(QANET).scheduler[0] == "OneCycle"


# -------------------------------------------------------------- optimizer
def test_ds_accelerator_chooses_the_device_as_in_deepspeed(monkeypatch):
    """DS_ACCELERATOR overrides DeepSpeed's detection: "cpu" keeps the model on the CPU (and
    the process group on gloo) even where a GPU is present, as DeepSpeed's CPU accelerator
    does; unset, a GPU is used when there is one. (Seen on a one-GPU machine: the
    DeepSpeed-side tests, which set DS_ACCELERATOR=cpu, met a model moved to cuda:0.)"""
    moved = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    cfg = parse(dict(train_batch_size=4))
    for value, cuda in (("cpu", False), ("CPU", False), ("", True), ("cuda", True)):
        monkeypatch.setenv("DS_ACCELERATOR", value)
        assert build.on_cuda() is cuda, value
        moved.clear()
        build.prepare_model(nn.Linear(3, 3), cfg)
        assert bool(moved) is cuda, value
    monkeypatch.delenv("DS_ACCELERATOR")
    assert build.on_cuda()
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(NotImplementedError, match="DS_ACCELERATOR='xpu'.*'cuda' or 'cpu'"):
        build.on_cuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="no CUDA device.*DS_ACCELERATOR='cpu'"):
        build.on_cuda()


def test_the_optimizer_a_config_names_has_deepspeeds_meaning():
    assert build.config_optimizer("Adam", {"lr": 1e-3}) == (None, {"lr": 1e-3, "weight_decay": 0.0})  # AdamW mode
    assert build.config_optimizer("AdamW", {"lr": 1e-3, "torch_adam": True}) == (
        None,
        {"lr": 1e-3, "weight_decay": 0.01},
    )
    assert build.config_optimizer("Adam", {"weight_decay": 0.1, "adam_w_mode": False}) == (
        torch.optim.Adam,
        {"weight_decay": 0.1},
    )  # L2 decay: torch's Adam
    assert build.config_optimizer("SGD", {"lr": 0.1, "momentum": 0.9}) == (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9},
    )
    with pytest.raises(NotImplementedError, match="Muon"):
        build.config_optimizer("Muon", {})
    with pytest.raises(NotImplementedError, match="OneBitAdam"):
        build.config_optimizer("OneBitAdam", {})
    with pytest.raises(ValueError, match="gradient_clipping"):
        build.config_optimizer("Adam", {"max_grad_norm": 1.0})
    model = nn.Linear(3, 3)
    cls, kw, groups = build.client_optimizer(
        torch.optim.AdamW([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias]}], weight_decay=0.2)
    )
    assert cls is None and kw["weight_decay"] == 0.2 and groups[0]["lr"] == 0.1 and groups[1]["params"] == [model.bias]


def test_zero_init_and_model_parallelism_are_refused_with_a_pointer():
    model = nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="model .tensor/pipeline. parallelism"):
        build.refuse_unsupported(model, mpu=object())
    model.weight.ds_id = 0
    with pytest.raises(NotImplementedError, match="build it under zeroshard.zero.Init instead"):
        build.refuse_unsupported(model, None)
    assert zeroshard.initialize is zeroshard.integrations.deepspeed.initialize


def test_zero_init_takes_deepspeeds_arguments_and_refuses_what_it_cannot_honour():
    """The parameters' dtype from the config (or dtype=), as DeepSpeed's; DeepSpeed's
    arguments zeroshard cannot honour are refused, named. (Its behaviour, against
    deepspeed.zero.Init: test_deepspeed_engine.py's front-door test.)"""
    from zeroshard.integrations.deepspeed import zero_init

    assert zeroshard.zero.Init is zero_init.Init
    with pytest.raises(ValueError, match="needs config_dict_or_path="):
        zero_init.Init()
    assert zero_init.Init(config_dict_or_path={"bf16": {"enabled": True}}).dtype == torch.bfloat16
    assert zero_init.Init(config={"fp16": {"enabled": True}}).dtype == torch.float16
    assert zero_init.Init(config_dict_or_path={"fp16": {"enabled": True}}, dtype=torch.float32).dtype == torch.float32
    assert zero_init.Init(enabled=False).dtype is None
    for kw in (
        dict(module=nn.Linear(2, 2)),
        dict(mpu=object()),
        dict(zero_quantized_weights=True),
        dict(remote_device="nvme"),
        dict(param_swapper=object()),
    ):
        with pytest.raises(NotImplementedError, match=f"Init\\({list(kw)[0]}="):
            zero_init.Init(config_dict_or_path={}, **kw)


def test_gradient_reduction_options_are_honoured_or_refused_as_deepspeed_refuses_them():
    """gradient_allreduce_op "sum" (stages 0-2) and "mean"; prescale_gradients and
    gradient_predivide_factor, the mean wherever DeepSpeed runs them; refused where DeepSpeed
    refuses them (with reduce_scatter at stages 2-3, "sum" at stage 3) and where its ZeRO-3
    divides twice (a factor equal to the world size); ignore_unused_parameters read. Against
    DeepSpeed itself: test_deepspeed_engine.py's front-door test."""
    four = dict(train_batch_size=4)
    assert parse(four).gradient_allreduce_op == "mean"
    summed = parse(dict(four, gradient_allreduce_op="SUM", zero_optimization={"stage": 2}))
    assert summed.gradient_allreduce_op == "sum"
    with pytest.raises(ValueError, match="gradient_allreduce_op: expected \"mean\" or \"sum\", got 'max'"):
        parse(dict(four, gradient_allreduce_op="max"))
    with pytest.raises(ValueError, match="gradient_allreduce_op \"sum\" at zero_optimization.stage 3"):
        parse(dict(four, gradient_allreduce_op="sum", zero_optimization={"stage": 3}))
    for stage, zero in ((0, {}), (1, {}), (2, {"reduce_scatter": False}), (3, {"reduce_scatter": False})):
        zero = dict(zero, stage=stage)
        parse(dict(four, prescale_gradients=True, gradient_predivide_factor=4.0, zero_optimization=zero))
        parse(dict(four, gradient_predivide_factor=4.0, zero_optimization=zero))
    for stage in (2, 3):
        for key, value in (("prescale_gradients", True), ("gradient_predivide_factor", 2.0)):
            with pytest.raises(ValueError, match=f"{key} at zero_optimization.stage {stage} with reduce_scatter"):
                parse(dict(four, **{key: value}, zero_optimization={"stage": stage}))
    parse(dict(four, gradient_allreduce_op="sum", prescale_gradients=True, zero_optimization={"stage": 2}))
    with pytest.raises(ValueError, match="gradient_predivide_factor 2 equal to the world size at zero_optimization.st"):
        parse(dict(four, gradient_predivide_factor=2.0, zero_optimization={"stage": 3, "reduce_scatter": False}), 2)
    with pytest.raises(ValueError, match="prescale_gradients: expected a bool, got 'yes'"):
        parse(dict(four, prescale_gradients="yes"))
    with pytest.raises(ValueError, match="gradient_predivide_factor: expected a number > 0"):
        parse(dict(four, gradient_predivide_factor=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # honoured: not in the warning's list
        cfg = config.parse(
            dict(
                four,
                gradient_allreduce_op="mean",
                prescale_gradients=False,
                gradient_predivide_factor=1.0,
                zero_optimization={"stage": 2, "ignore_unused_parameters": False},
            ),
            2,
        )
    assert cfg.zero.ignore_unused_parameters is False and parse(four).zero.ignore_unused_parameters is True
    with pytest.raises(ValueError, match="zero_optimization.ignore_unused_parameters: expected a bool"):
        parse(dict(four, zero_optimization={"stage": 2, "ignore_unused_parameters": 0}))


# -------------------------------------------- against DeepSpeed's own classes
def test_loss_scale_follows_deepspeeds_dynamic_loss_scaler(monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler as ds

    class OneRank:
        @staticmethod
        def get_rank():
            return 0

    monkeypatch.setattr(ds, "dist", OneRank)
    pattern = [True, True, False, False, False, True, False, False, False, False, False, False, True, True, False]
    for hysteresis, consecutive in ((1, False), (2, False), (3, True)):
        mine = loss_scaler.LossScaler(
            config.LossScaling(
                enabled=True,
                loss_scale=0.0,
                initial_scale_power=10,
                loss_scale_window=3,
                hysteresis=hysteresis,
                consecutive_hysteresis=consecutive,
                min_loss_scale=1.0,
            )
        )
        theirs = ds.DynamicLossScaler(
            init_scale=2.0**10,
            scale_window=3,
            min_scale=1.0,
            delayed_shift=hysteresis,
            consecutive_hysteresis=consecutive,
        )
        for overflow in pattern:
            mine.update(overflow)
            theirs.update_scale(overflow)
            assert mine.scale == theirs.cur_scale and mine.hysteresis == theirs.cur_hysteresis
    static = loss_scaler.LossScaler(config.LossScaling(enabled=True, loss_scale=128.0))
    static.update(True)
    assert static.scale == 128.0 and loss_scaler.LossScaler(config.LossScaling()).scale == 1.0


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 3, "warmup_max_lr": 0.02}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.004,
            "cycle_max_lr": 0.015,
            "cycle_first_step_size": 4,
            "cycle_second_step_size": 3,
            "decay_step_size": 2,
            "decay_lr_rate": 0.1,
            "decay_mom_rate": 0.05,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 6,
            "cycle_first_stair_count": 3,
            "cycle_momentum": False,
        },
    ),
    (
        "LRRangeTest",
        {"lr_range_test_min_lr": [0.001, 0.002], "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.5},
    ),
    ("LRRangeTest", {"lr_range_test_step_size": 4, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("kind,params", SCHEDULES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SCHEDULES)])
def test_lr_schedules_follow_deepspeeds(kind, params):
    from deepspeed.runtime import lr_schedules as ds

    def groups():
        return [{"params": [nn.Parameter(torch.zeros(1))], "lr": 0.05}, {"params": [nn.Parameter(torch.zeros(1))]}]

    a, b = torch.optim.AdamW(groups(), lr=0.01), torch.optim.AdamW(groups(), lr=0.01)
    mine, theirs = lr_schedules.from_config(kind, dict(params), a), getattr(ds, kind)(b, **params)
    for _ in range(20):
        assert [g["lr"] for g in a.param_groups] == pytest.approx([g["lr"] for g in b.param_groups], abs=1e-15)
        assert [g["betas"] for g in a.param_groups] == [g["betas"] for g in b.param_groups]
        mine.step()
        theirs.step()
    mine.load_state_dict(theirs.state_dict())
    assert mine.state_dict() == theirs.state_dict()
    with pytest.raises(NotImplementedError, match="NoSuchSchedule"):
        lr_schedules.from_config("NoSuchSchedule", {}, a)


# ------------------------------------------------- the core's new reader
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.BatchNorm1d(3)


def test_read_full_state_dict_yields_the_plain_model_one_tensor_at_a_time(tmp_path):
    torch.manual_seed(0)
    model = Tied().to(torch.bfloat16)
    zeroshard.save_checkpoint(tmp_path / "ck", model, None)
    got = dict(zeroshard.checkpoint.read_full_state_dict(tmp_path / "ck"))
    want = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert got["emb.weight"].dtype == torch.bfloat16
    fp32 = dict(zeroshard.checkpoint.read_full_state_dict(tmp_path / "ck", dtype=torch.float32))
    assert fp32["head.weight"].dtype == torch.float32 and fp32["norm.num_batches_tracked"].dtype == torch.long
    with pytest.raises(ValueError, match="floating"):
        next(zeroshard.checkpoint.read_full_state_dict(tmp_path / "ck", dtype=torch.int32))
    assert math.isfinite(float(fp32["emb.weight"].sum()))
