"""A DeepSpeed config (a dict or a JSON file) read with DeepSpeed 0.19's meaning
and defaults, checked before anything is built.

Every key DeepSpeed knows falls in one of three kinds (docs/deepspeed.md has
the table): *honoured* (it sets what zeroshard does: batch sizes, clipping,
fp16/bf16, the optimizer and scheduler, the ZeRO stage, offload, the bucket
size), *tuning* (a knob of DeepSpeed's own machinery with no counterpart
here: accepted, and listed in one warning), or a *feature* zeroshard does not
have (refused with ``NotImplementedError`` when enabled). A key DeepSpeed does
not know is a ``ValueError`` naming it, and so is an ``"auto"`` value: only
the Hugging Face integration fills those in.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from typing import Optional, Tuple

# ------------------------------------------------------------- the key table
# top level: honoured
TOP_HONOURED = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "steps_per_print",
    "wall_clock_breakdown",
    "communication_data_type",
    "dataloader_drop_last",
    "gradient_allreduce_op",
    "prescale_gradients",
    "gradient_predivide_factor",
    "zero_allow_untested_optimizer",
}  # (read by initialize: a client optimizer DeepSpeed does not know)
# top level: DeepSpeed's own machinery, no counterpart (accepted with one warning)
TOP_TUNING = {
    "zero_force_ds_cpu_optimizer",
    "memory_breakdown",
    "disable_allgather",
    "dump_state",
    "disable_python_gc",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "aio",
    "checkpoint",
    "timers",
    "log_level",
    "data_types",
    "seq_parallel_communication_data_type",
    "sparse_gradients",
    "graph_harvesting",
    "use_data_before_expert_parallelism",
    "compile",
    "check_overflow",
    "managed_gradient_accumulation",
    "zero_optimization_stage",
    "monitor_config",
    "pipeline",
}
# top level: features zeroshard does not have (refused when present and enabled)
TOP_FEATURES = {
    "amp": "apex AMP (use \"bf16\" or \"fp16\")",
    "torch_autocast": "DeepSpeed's torch_autocast mode (use \"bf16\" or \"fp16\")",
    "sparse_attention": "sparse attention",
    "compression_training": "compression training",
    "data_efficiency": "data efficiency (curriculum learning, random-LTD)",
    "curriculum_learning": "curriculum learning",
    "progressive_layer_drop": "progressive layer drop",
    "eigenvalue": "eigenvalue computation",
    "quantize_training": "quantized training (MoQ)",
    "hybrid_engine": "the hybrid engine (RLHF)",
    "nebula": "Nebula checkpoints",
    "autotuning": "autotuning",
    "elasticity": "elastic training",
    "tensor_parallel": "tensor parallelism (AutoTP)",
    "expert_parallel": "mixture-of-experts parallelism",
    "sequence_parallel_size": "sequence parallelism",
    "data_parallel_size": "a data/sequence-parallel mesh",
    "weight_quantization": "weight quantization",
    "zenflow": "ZenFlow",
}
ZERO_HONOURED = {
    "stage",
    "reduce_bucket_size",
    "contiguous_gradients",
    "overlap_comm",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "ignore_unused_parameters",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
}
# (reduce_scatter is read for the reduction options DeepSpeed refuses with it: _reduction)
ZERO_TUNING = {
    "reduce_scatter",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "compute_grad_norm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "stage3_max_live_parameters",
    "max_live_parameters",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "allgather_sequential",
    "legacy_stage1",
    "round_robin_gradients",
    "parameter_alignment",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "leaf_module",
}
ZERO_FEATURES = {
    "zero_quantized_nontrainable_weights": "quantized frozen weights (ZeRO++)",
    "zero_quantized_gradients": "quantized gradients (ZeRO++ qgZ)",
    "zenflow": "ZenFlow",
}
OFFLOAD_HONOURED = {"device", "nvme_path", "ratio", "pin_memory"}
OFFLOAD_TUNING = {
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "cpuadam_cores_perc",
    "pipeline",
}
OFFLOAD_FEATURES = {"super_offload": "SuperOffload"}
FP16_HONOURED = {
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
}
FP16_TUNING = {"fp16_master_weights_and_grads"}
FP16_FEATURES = {"auto_cast": "fp16 auto_cast"}
BF16_HONOURED = {"enabled"}
BF16_TUNING = {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"}
SECTION_KEYS = {"optimizer": {"type", "params", "legacy_fusion"}, "scheduler": {"type", "params"}}
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "bfp16": "bfloat16"}


# ------------------------------------------------------------ the parsed form
@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadSection:
    """``zero_optimization.offload_optimizer`` / ``offload_param``."""

    device: str = "none"  # "none", "cpu" or "nvme"
    nvme_path: Optional[str] = None
    ratio: float = 1.0  # the share of the optimizer state offloaded
    pin_memory: bool = True  # zeroshard pins host memory whenever the parameters are on CUDA


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaling:
    """The ``fp16`` section: DeepSpeed's defaults; ``loss_scale`` 0 means dynamic."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Zero:
    """The ``zero_optimization`` section (stage 0 runs as ZeRO-1: see docs/deepspeed.md)."""

    stage: int = 0
    reduce_bucket_size: Optional[int] = None  # elements; None: not given (zeroshard's 25 MiB buckets)
    contiguous_gradients: bool = True
    overlap_comm: Optional[bool] = None
    offload_optimizer: OffloadSection = OffloadSection()
    offload_param: OffloadSection = OffloadSection()
    ignore_unused_parameters: bool = True  # False: a parameter without a gradient stops the step (engine.py)
    # ZeRO++ hpZ: stage 3's units keep a piece over this many ranks for the backward's gathers
    # (FullyShard's reshard_after_forward=k); 1: none
    hpz_partition_size: int = 1
    # ZeRO++ qwZ: stage 3's weight all-gathers in int8 (MixedPrecision(gather_dtype="int8"))
    quantized_weights: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A checked DeepSpeed config, batch sizes resolved for ``world_size``."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 1.0  # DeepSpeed 0.19's default (0 disables)
    fp16: LossScaling = LossScaling()
    bf16: bool = False
    optimizer: Optional[Tuple[str, dict]] = None  # (type, params)
    scheduler: Optional[Tuple[str, dict]] = None
    zero: Zero = Zero()
    communication_data_type: Optional[str] = None  # torch dtype name
    gradient_allreduce_op: str = "mean"  # "sum": the gradients summed over the ranks, not averaged
    steps_per_print: Optional[int] = None
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False
    unused: Tuple[str, ...] = ()  # tuning keys accepted without a counterpart


# ------------------------------------------------------------------ reading
def load(config) -> dict:
    """The config as a dict: a dict is copied, a str or path is a JSON file."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ValueError(f"DeepSpeed config {path!r}: no such file (pass a dict or the path of a JSON file)")
        with open(path) as f:
            return json.load(f)
    raise TypeError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")


def _autos(d, where="") -> list:
    found = []
    for k, v in d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ():
        path = f"{where}.{k}" if where else str(k)
        if v == "auto":
            found.append(path)
        elif isinstance(v, (dict, list)):
            found += _autos(v, path)
    return found


def _check_keys(section: dict, where: str, honoured, tuning, features, unused: list):
    """Sort ``section``'s keys: unknown -> ValueError; enabled feature -> NotImplementedError;
    tuning -> appended to ``unused``."""
    known = set(honoured) | set(tuning) | set(features)
    for key, value in section.items():
        name = f"{where}.{key}" if where else key
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"DeepSpeed config key {name!r} is not a key DeepSpeed knows{hint}")
        if key in features and _enabled(value):
            raise NotImplementedError(
                f"DeepSpeed config key {name!r}: zeroshard has no {features[key]}; "
                "remove the key (or disable it) to train with ZeRO data parallelism"
            )
        if key in tuning:
            unused.append(name)


def _enabled(value) -> bool:
    if isinstance(value, dict):
        return bool(value.get("enabled", True)) and value != {}
    return value not in (None, False, 0, 1, "none") if not isinstance(value, bool) else value


def _num(d: dict, key: str, default, kind, where: str, minimum=None):
    v = d.get(key, default)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is bool:
        ok = isinstance(v, bool)
    elif kind is int and ok:
        ok = float(v).is_integer()
    if not ok or (minimum is not None and v < minimum):
        low = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"DeepSpeed config {where}{key}: expected a {kind.__name__}{low}, got {v!r}")
    return kind(v)


def _offload(d, where: str, unused: list) -> OffloadSection:
    if d is None:
        return OffloadSection()
    if not isinstance(d, dict):
        raise ValueError(f"DeepSpeed config {where}: expected a dict, got {d!r}")
    _check_keys(d, where, OFFLOAD_HONOURED, OFFLOAD_TUNING, OFFLOAD_FEATURES, unused)
    device = str(d.get("device", "none")).lower()
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"DeepSpeed config {where}.device: expected \"none\", \"cpu\" or \"nvme\", got {device!r}")
    if device == "nvme" and not d.get("nvme_path"):
        raise ValueError(
            f"DeepSpeed config {where}: device \"nvme\" needs \"nvme_path\" (a directory on a fast local disk)"
        )
    ratio = _num(d, "ratio", 1.0, float, where + ".")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"DeepSpeed config {where}.ratio must be in [0, 1], got {ratio}")
    return OffloadSection(
        device=device, nvme_path=d.get("nvme_path"), ratio=ratio, pin_memory=bool(d.get("pin_memory", True))
    )


def _zero(d, unused: list) -> Zero:
    if d is None:
        return Zero()
    if not isinstance(d, dict):
        raise ValueError(f"DeepSpeed config zero_optimization: expected a dict, got {d!r}")
    _check_keys(d, "zero_optimization", ZERO_HONOURED, ZERO_TUNING, ZERO_FEATURES, unused)
    stage = _num(d, "stage", 0, int, "zero_optimization.")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed config zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    opt = _offload(d.get("offload_optimizer"), "zero_optimization.offload_optimizer", unused)
    par = _offload(d.get("offload_param"), "zero_optimization.offload_param", unused)
    if d.get("cpu_offload") and opt.device == "none":  # DeepSpeed's deprecated spellings
        opt = OffloadSection(device="cpu", pin_memory=bool(d.get("cpu_offload_use_pin_memory", True)))
    if d.get("cpu_offload_param") and par.device == "none":
        par = OffloadSection(device="cpu", pin_memory=bool(d.get("cpu_offload_use_pin_memory", True)))
    if par.device != "none" and stage != 3:
        unused.append(f"zero_optimization.offload_param (stage {stage}: parameters are offloaded at stage 3 only)")
        par = OffloadSection()
    hpz = _num(d, "zero_hpz_partition_size", 1, int, "zero_optimization.", 1)
    if hpz > 1 and stage != 3:
        unused.append(
            f"zero_optimization.zero_hpz_partition_size (stage {stage}: parameters are gathered at stage 3 only)"
        )
        hpz = 1
    qwz = _num(d, "zero_quantized_weights", False, bool, "zero_optimization.")
    if qwz and stage != 3:
        unused.append(f"zero_optimization.zero_quantized_weights (stage {stage}: weights are gathered at stage 3 only)")
        qwz = False
    if stage == 3 and "reduce_bucket_size" in d:
        unused.append("zero_optimization.reduce_bucket_size (stage 3 reduces one unit at a time)")
    return Zero(
        stage=stage,
        reduce_bucket_size=_num(d, "reduce_bucket_size", None, int, "zero_optimization.", 1),
        contiguous_gradients=bool(d.get("contiguous_gradients", True)),
        overlap_comm=d.get("overlap_comm"),
        offload_optimizer=opt,
        offload_param=par,
        ignore_unused_parameters=_num(d, "ignore_unused_parameters", True, bool, "zero_optimization."),
        hpz_partition_size=hpz,
        quantized_weights=qwz,
    )


def _precision(raw: dict, unused: list) -> Tuple[LossScaling, bool]:
    fp16 = raw.get("fp16") or {}
    bf16 = raw.get("bf16", raw.get("bfloat16")) or {}
    for name, d in (("fp16", fp16), ("bf16", bf16)):
        if not isinstance(d, dict):
            raise ValueError(f"DeepSpeed config {name}: expected a dict such as {{\"enabled\": true}}, got {d!r}")
    _check_keys(fp16, "fp16", FP16_HONOURED, FP16_TUNING, FP16_FEATURES, unused)
    _check_keys(bf16, "bf16", BF16_HONOURED, BF16_TUNING, {}, unused)
    w = "fp16."
    scaling = LossScaling(
        enabled=bool(fp16.get("enabled", False)),
        loss_scale=_num(fp16, "loss_scale", 0.0, float, w, 0),
        initial_scale_power=_num(fp16, "initial_scale_power", 16, int, w, 0),
        loss_scale_window=_num(fp16, "loss_scale_window", 1000, int, w, 1),
        hysteresis=_num(fp16, "hysteresis", 2, int, w, 1),
        consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
        min_loss_scale=_num(fp16, "min_loss_scale", 1.0, float, w),
    )
    if scaling.enabled and scaling.dynamic and not scaling.min_loss_scale > 0:
        raise ValueError("DeepSpeed config fp16.min_loss_scale must be > 0 with dynamic loss scaling (loss_scale 0)")
    use_bf16 = bool(bf16.get("enabled", False))
    if scaling.enabled and use_bf16:
        raise ValueError("DeepSpeed config: fp16 and bf16 are both enabled; enable one of them")
    return scaling, use_bf16


def resolve_batch(train: Optional[int], micro: Optional[int], gas: Optional[int], world: int) -> Tuple[int, int, int]:
    """DeepSpeed's batch rule: any two of (train_batch_size, train_micro_batch_size_per_gpu,
    gradient_accumulation_steps) give the third (integer division, as DeepSpeed's); one of
    the first two alone means no accumulation; then train == micro * gas * world must hold."""
    if train is not None and micro is not None and gas is None:
        gas = train // micro // world
    elif train is not None and gas is not None and micro is None:
        micro = train // world // gas
    elif micro is not None and gas is not None and train is None:
        train = micro * gas * world
    elif train is not None and micro is None and gas is None:
        micro, gas = train // world, 1
    elif micro is not None and train is None and gas is None:
        train, gas = micro * world, 1
    elif train is None and micro is None:
        raise ValueError(
            "DeepSpeed config: either train_batch_size or train_micro_batch_size_per_gpu must be "
            "given (as DeepSpeed requires)"
        )
    for name, v in (
        ("train_batch_size", train),
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", gas),
    ):
        if v <= 0:
            raise ValueError(f"DeepSpeed config: {name} resolves to {v} at world size {world}; it must be > 0")
    if train != micro * gas * world:
        raise ValueError(
            f"DeepSpeed config: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} "
            f"* gradient_accumulation_steps {gas} * world size {world}; fix one of them"
        )
    return train, micro, gas


def _section(raw: dict, name: str) -> Optional[Tuple[str, dict]]:
    d = raw.get(name)
    if d is None:
        return None
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError(f"DeepSpeed config {name}: expected {{\"type\": ..., \"params\": {{...}}}}, got {d!r}")
    _check_keys(d, name, SECTION_KEYS[name], {"legacy_fusion"}, {}, [])
    params = d.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"DeepSpeed config {name}.params: expected a dict, got {params!r}")
    return str(d["type"]), dict(params)


def _reduction(raw: dict, zero: Zero, world: int) -> str:
    """``gradient_allreduce_op`` ("mean" or "sum"), checked with ``prescale_gradients`` and
    ``gradient_predivide_factor`` as DeepSpeed 0.19 applies them. Pre-scaling and a predivide
    factor f only move the division (1/N before the sum, or 1/f before and f/N after it): the
    mean either way, which zeroshard computes. Where DeepSpeed refuses a combination, or gives
    something other than the mean, it is refused here too (docs/deepspeed.md lists each)."""
    op = raw.get("gradient_allreduce_op", "mean")
    op = op.lower() if isinstance(op, str) else op
    if op not in ("mean", "sum"):
        raise ValueError(
            f"DeepSpeed config gradient_allreduce_op: expected \"mean\" or \"sum\", "
            f"got {raw['gradient_allreduce_op']!r}"
        )
    prescale = _num(raw, "prescale_gradients", False, bool, "")
    factor = _num(raw, "gradient_predivide_factor", 1.0, float, "")
    if not factor > 0:
        raise ValueError(f"DeepSpeed config gradient_predivide_factor: expected a number > 0, got {factor}")
    scatter = (raw.get("zero_optimization") or {}).get("reduce_scatter", True)
    if op == "sum":
        if zero.stage == 3:
            raise ValueError(
                "DeepSpeed config gradient_allreduce_op \"sum\" at zero_optimization.stage 3: "
                "DeepSpeed 0.19 refuses it too (ZeRO-3 averages); use \"mean\", or stage 1 or 2"
            )
        return op  # (DeepSpeed then ignores prescale_gradients and gradient_predivide_factor)
    moved = [k for k, on in (("prescale_gradients", prescale), ("gradient_predivide_factor", factor != 1.0)) if on]
    if moved and scatter and zero.stage in (2, 3):
        raise ValueError(
            f"DeepSpeed config {' and '.join(moved)} at zero_optimization.stage {zero.stage} with "
            "reduce_scatter (true unless set): DeepSpeed 0.19 refuses this combination too (an "
            f"assertion in its ZeRO-{zero.stage} optimizer); remove {' and '.join(moved)}, or set "
            "zero_optimization.reduce_scatter false (both then average)"
        )
    if zero.stage == 3 and not prescale and factor == world != 1:
        raise ValueError(
            f"DeepSpeed config gradient_predivide_factor {factor:g} equal to the world size at "
            "zero_optimization.stage 3: DeepSpeed 0.19's ZeRO-3 then divides by the world size twice "
            f"(gradients {world} times smaller than the mean) where zeroshard would average; "
            "refused rather than differ: use 1.0"
        )
    return op


def parse(config, world_size: int, warn: bool = True) -> Config:
    """Read and check ``config`` (dict or JSON path) for ``world_size`` ranks; warns once,
    listing every tuning key that has no counterpart in zeroshard."""
    raw = load(config)
    autos = _autos(raw)
    if autos:
        raise ValueError(
            f"DeepSpeed config values {autos} are \"auto\": only the Hugging Face integration "
            "(transformers' Trainer) fills those in; give numbers"
        )
    unused: list = []
    _check_keys(raw, "", TOP_HONOURED, TOP_TUNING, TOP_FEATURES, unused)
    ints = {
        k: _num(raw, k, None, int, "", 1)
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    }
    train, micro, gas = resolve_batch(
        ints["train_batch_size"],
        ints["train_micro_batch_size_per_gpu"],
        ints["gradient_accumulation_steps"],
        world_size,
    )
    scaling, bf16 = _precision(raw, unused)
    comm = raw.get("communication_data_type")
    if comm is not None and str(comm).lower() not in DTYPES:
        raise ValueError(f"DeepSpeed config communication_data_type: expected one of {sorted(DTYPES)}, got {comm!r}")
    zero = _zero(raw.get("zero_optimization"), unused)
    cfg = Config(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        gradient_clipping=_num(raw, "gradient_clipping", 1.0, float, "", 0),
        fp16=scaling,
        bf16=bf16,
        optimizer=_section(raw, "optimizer"),
        scheduler=_section(raw, "scheduler"),
        zero=zero,
        communication_data_type=DTYPES[str(comm).lower()] if comm is not None else None,
        gradient_allreduce_op=_reduction(raw, zero, world_size),
        steps_per_print=_num(raw, "steps_per_print", None, int, "", 1),
        wall_clock_breakdown=bool(raw.get("wall_clock_breakdown", False)),
        dataloader_drop_last=bool(raw.get("dataloader_drop_last", False)),
        unused=tuple(unused),
    )
    if warn and unused:
        warnings.warn(
            f"zeroshard.initialize: these DeepSpeed config keys tune DeepSpeed's own machinery and have "
            f"no counterpart in zeroshard; they are ignored: {', '.join(unused)}",
            stacklevel=3,
        )
    return cfg
