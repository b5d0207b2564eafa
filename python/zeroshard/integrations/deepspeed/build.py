"""From a checked config and ``initialize``'s arguments to zeroshard's objects:
the process group, the model's dtype and device, ``FullyShard`` at stage 3,
the ``ShardedOptimizer`` (the config's optimizer or the client's, its param
groups carried over), the schedule and the data loader.
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard

from . import live, lr_schedules
from .config import Config
from ..policies import as_policies, fully_shard_policies

# torch optimizer hyperparameters that only choose an implementation (not the math)
IMPLEMENTATION_KEYS = {"foreach", "fused", "capturable", "differentiable", "initial_lr", "decoupled_weight_decay"}
ADAM_KEYS = {"lr", "betas", "eps", "weight_decay"}
# DeepSpeed's Adam/AdamW params that only choose its implementation
DS_ADAM_IMPLEMENTATION = {
    "torch_adam",
    "adam_w_mode",
    "fp32_optimizer_states",
    "bias_correction",
    "set_grad_none",
    "foreach",
    "fused",
    "amsgrad",
}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def on_cuda() -> bool:
    """Whether DeepSpeed would run on CUDA here: ``DS_ACCELERATOR`` when set ("cuda" or
    "cpu"; DeepSpeed's override of its own detection), else whether a GPU is present."""
    want = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if want == "cpu":
        return False
    if want not in ("", "cuda"):
        raise NotImplementedError(
            f"DS_ACCELERATOR={want!r}: zeroshard runs on CUDA GPUs and on the CPU; "
            "set it to 'cuda' or 'cpu', or leave it unset"
        )
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "DS_ACCELERATOR='cuda' but torch sees no CUDA device; set DS_ACCELERATOR='cpu' to train on the CPU"
        )
    return torch.cuda.is_available()


def init_distributed(dist_init_required: Optional[bool]) -> None:
    """Create the default process group as DeepSpeed does: from torchrun's environment
    (NCCL with CUDA, else gloo); with no launcher, a world of one on this machine."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError(
            "zeroshard.initialize(dist_init_required=False) but no process group exists; call "
            "torch.distributed.init_process_group() first, or leave dist_init_required unset"
        )
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = on_cuda()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")


def refuse_unsupported(model: nn.Module, mpu) -> None:
    """DeepSpeed features zeroshard does not have, recognised from the arguments."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"zeroshard.initialize needs model= an nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise NotImplementedError(
            "zeroshard.initialize(mpu=...): zeroshard has no model (tensor/pipeline) "
            "parallelism; it shards over the data-parallel ranks only"
        )
    for m in model.modules():
        kind = type(m).__module__ + "." + type(m).__name__
        if kind.startswith("deepspeed.runtime.pipe"):
            raise NotImplementedError(
                "a DeepSpeed PipelineModule: zeroshard has no pipeline parallelism; pass "
                "the plain model (the layers in an nn.Sequential)"
            )
        if kind.startswith("deepspeed.moe"):
            raise NotImplementedError(
                f"{type(m).__name__} is a DeepSpeed mixture-of-experts layer: zeroshard has no expert parallelism"
            )
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise NotImplementedError(
            "the model was built under deepspeed.zero.Init (its parameters are DeepSpeed-partitioned): build it "
            "under zeroshard.zero.Init instead (the same arguments; each module's parameters are sharded as it "
            "is built), and zeroshard.initialize takes it at any stage"
        )


def take_over(model: nn.Module, cfg: Config) -> Optional[nn.Module]:
    """A second ``initialize`` over the same model, as DeepSpeed allows: the engine training it
    is destroyed (its optimizer lets go of the parameters) and, where an earlier stage-3 engine
    wrapped the model, its FullyShard is returned to be reused (it must shard as this config
    asks); None otherwise."""
    earlier = live.over(model)
    if earlier is not None:
        earlier.destroy()
    fs = live.wrapped(model)
    if fs is None:
        return None
    low = DTYPE["fp16"] if cfg.fp16.enabled else DTYPE["bf16"] if cfg.bf16 else torch.float32
    offload = cfg.zero.offload_param.device != "none"
    had = (fs.param_dtype, fs.reduce_dtype, fs.offload_params)
    want = (low, reduce_dtype(cfg) or low, offload)
    if cfg.zero.stage != 3 or had != want:
        raise NotImplementedError(
            f"zeroshard.initialize over a model an earlier stage-3 engine sharded (FullyShard: gathered in "
            f"{had[0]}, reduced in {had[1]}, offload_param {had[2]}): the new engine reuses that sharding, so "
            f"its config must ask for stage 3 with the same fp16/bf16, communication_data_type and "
            f"offload_param (it asks for stage {cfg.zero.stage}, {want[0]}, {want[1]}, offload_param {want[2]}); "
            "or build a fresh model and load the first engine's checkpoint into it"
        )
    return fs


def prepare_model(model: nn.Module, cfg: Config) -> nn.Module:
    """DeepSpeed's conversions: the model to fp16/bf16 when enabled, and onto this rank's GPU
    (unless ``DS_ACCELERATOR=cpu``, as DeepSpeed's accelerator is then the CPU)."""
    if cfg.fp16.enabled:
        model.half()
    elif cfg.bf16:
        model.bfloat16()
    if on_cuda() and not any(p.is_meta for p in model.parameters()):
        model.to(torch.device("cuda", torch.cuda.current_device()))
    return model


def block_units(model: nn.Module):
    """Stage 3's units: each element of the outermost ``nn.ModuleList``s (a transformer's
    blocks); the rest of the model is the root unit. None: no ModuleList, one unit."""
    chosen, prefixes = set(), []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and not any(name.startswith(p) for p in prefixes):
            chosen |= {id(m) for m in mod}
            prefixes.append(name + ".")
    return (lambda m: id(m) in chosen) if chosen else None


def reduce_dtype(cfg: Config) -> Optional[torch.dtype]:
    """``communication_data_type``; else fp32 for fp16 models (zeroshard reduces by SUM and
    divides after: an fp16 SUM would overflow at half the loss scale DeepSpeed's
    divide-first fp16 average tolerates, and skip steps DeepSpeed does not); else the
    parameters' dtype, as DeepSpeed."""
    if cfg.communication_data_type:
        return getattr(torch, cfg.communication_data_type)
    return torch.float32 if cfg.fp16.enabled else None


def wrap_model(model: nn.Module, cfg: Config, reuse: Optional[nn.Module] = None) -> nn.Module:
    """Stage 3: ``FullyShard`` (gathered in the model's fp16/bf16, reduced in
    ``reduce_dtype(cfg)``, fp32 shards; ``offload_param``:
    ``offload_params=True``), or ``reuse`` (``take_over``'s); other stages: the model itself."""
    if cfg.zero.stage != 3:
        return model
    if reuse is not None:
        return reuse
    low = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16 else None
    reduce = reduce_dtype(cfg)
    quantized = "int8" if cfg.zero.quantized_weights else None  # (ZeRO++ qwZ)
    mp = zeroshard.MixedPrecision(param_dtype=low, reduce_dtype=reduce, gather_dtype=quantized)
    if cfg.zero.offload_param.device == "nvme":
        warnings.warn(
            "zero_optimization.offload_param.device \"nvme\": zeroshard keeps offloaded parameters in host "
            "memory (the optimizer state still goes to offload_optimizer's nvme_path)",
            stacklevel=4,
        )
    hpz = cfg.zero.hpz_partition_size
    if dist.get_world_size() % hpz:
        raise ValueError(
            f"DeepSpeed config zero_optimization.zero_hpz_partition_size={hpz} must divide the world size "
            f"({dist.get_world_size()}): the ranks of a node, usually"
        )
    return live.wrapped(
        model,
        zeroshard.FullyShard(
            model,
            wrap=block_units(model),
            mixed_precision=mp,
            reshard_after_forward=hpz if hpz > 1 else True,
            **fully_shard_policies(cfg.zero.offload_param.device != "none"),
        ),
    )


def _groups(model_parameters, model: nn.Module) -> list:
    params = list(model.parameters() if model_parameters is None else model_parameters)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def config_optimizer(kind: str, params: dict):
    """(optimizer_class or None for the fused AdamW, its keyword arguments) for the
    config's optimizer section, with DeepSpeed's meaning of each type."""
    params = dict(params)
    if "max_grad_norm" in params:
        raise ValueError(
            "DeepSpeed config optimizer.params.max_grad_norm: DeepSpeed refuses it too; use the "
            "top-level \"gradient_clipping\""
        )
    name = kind.lower()
    if name in ("adam", "adamw"):
        adam_w = name == "adamw" or bool(params.get("adam_w_mode", True))
        # DeepSpeed's own Adam kernels default weight_decay to 0; torch_adam runs torch's class (AdamW: 0.01)
        wd_default = 0.01 if (params.get("torch_adam") and adam_w) else 0.0
        extra = sorted(set(params) - ADAM_KEYS - DS_ADAM_IMPLEMENTATION)
        if extra or params.get("amsgrad"):
            raise ValueError(
                f"DeepSpeed config optimizer {kind}: params {extra or ['amsgrad']} are not Adam's "
                "(lr, betas, eps, weight_decay)"
            )
        kw = {k: params[k] for k in ADAM_KEYS if k in params}
        kw.setdefault("weight_decay", wd_default)
        if adam_w or kw["weight_decay"] == 0:
            return None, kw  # decoupled decay (or none): the fused AdamW
        return torch.optim.Adam, kw  # Adam with L2 decay: torch's, over the shards
    if name == "muon":
        raise NotImplementedError(
            "DeepSpeed optimizer Muon: zeroshard has no Muon (its orthogonalisation needs "
            "whole matrices, not shards); use Adam, AdamW or SGD"
        )
    cls = getattr(torch.optim, kind, None)
    if cls is None or not isinstance(cls, type):
        raise NotImplementedError(
            f"DeepSpeed optimizer type {kind!r}: zeroshard runs Adam, AdamW, SGD and torch's "
            "other elementwise optimizers; or pass optimizer= a torch optimizer"
        )
    return cls, params


def client_optimizer(opt: torch.optim.Optimizer):
    """(optimizer_class or None, defaults, groups) reproducing a client's torch optimizer."""
    cls = type(opt)
    groups = [dict(g) for g in opt.param_groups]
    # torch's Adam with no weight decay (or decoupled: AdamW's) is AdamW: the fused kernel, offloadable
    adamw = (
        cls is torch.optim.AdamW
        or cls is torch.optim.Adam
        and all(g.get("decoupled_weight_decay") or not g.get("weight_decay") for g in groups)
    )
    fused = adamw and not any(g.get("amsgrad") or g.get("maximize") for g in groups)
    keep = ADAM_KEYS if fused else set(opt.defaults) - IMPLEMENTATION_KEYS - {"params"}
    groups = [dict({k: g[k] for k in keep if k in g}, params=list(g["params"])) for g in groups]
    defaults = {k: opt.defaults[k] for k in keep if k in opt.defaults}
    return (None if fused else cls), defaults, groups


def optimizer_spec(model: nn.Module, cfg: Config, optimizer, model_parameters):
    """(optimizer_class or None, keyword arguments, param groups over the model's own
    parameters) from the client's optimizer (an object, or a callable taking the
    parameters) or the config's; None without either. Taken before stage 3 wraps the model."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
    if isinstance(optimizer, torch.optim.Optimizer):
        return client_optimizer(optimizer)
    if optimizer is not None:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a callable returning one, got {type(optimizer).__name__}"
        )
    if cfg.optimizer is None:
        return None
    cls, kwargs = config_optimizer(*cfg.optimizer)
    return cls, kwargs, _groups(model_parameters, model)


def _untested(cls, allowed: bool, offload: str) -> dict:
    """ShardedOptimizer options for a client ``optimizer_class`` (not the fused AdamW): one that
    is not torch's own runs elementwise on each rank's pieces once the config allows untested
    optimizers (DeepSpeed runs it on its flat partitions alike), and is refused otherwise; its
    state stays with the parameters (offload steps the fused AdamW's only)."""
    options = {}
    if getattr(torch.optim, cls.__name__, None) is not cls:
        if not allowed:
            raise ValueError(
                f"the client optimizer {cls.__module__}.{cls.__name__} is not one ZeRO is tested with: "
                "add \"zero_allow_untested_optimizer\": true to the DeepSpeed config (as DeepSpeed asks) "
                "to run it; zeroshard then steps it elementwise on each rank's pieces of every "
                "parameter, as DeepSpeed steps it on its flat partitions"
            )
        options["elementwise"] = True
    if offload != "none" and on_cuda():
        warnings.warn(
            f"zero_optimization.offload_optimizer with {cls.__name__}: zeroshard offloads the state of "
            "its fused AdamW only (Adam/AdamW without L2 decay); this optimizer's state stays on the GPU",
            stacklevel=4,
        )
    return options


def make_optimizer(spec, names: dict, runner: nn.Module, cfg: Config, allow_untested: bool = False):
    """The ShardedOptimizer for ``spec`` over the model the engine calls; at stage 3 each
    parameter is replaced by its FullyShard piece (``names``: id -> name, taken before wrapping).
    ``allow_untested``: the config's ``zero_allow_untested_optimizer``."""
    if spec is None:
        return None
    cls, kwargs, groups = spec
    if cfg.zero.stage == 3:
        pieces = dict(runner.named_parameters())
        groups = [dict(g, params=[pieces[names[id(p)]] for p in g["params"]]) for g in groups]
    zero, reduce = cfg.zero, reduce_dtype(cfg)
    off = zero.offload_optimizer
    options = dict(
        offload=None if off.device == "none" else off.device,
        offload_fraction=off.ratio,
        offload_dir=off.nvme_path if off.device == "nvme" else None,
    )
    if zero.stage != 3:
        item = reduce.itemsize if reduce is not None else next(p for g in groups for p in g["params"]).element_size()
        # reduce_bucket_size counts elements; absent, zeroshard's 25 MiB (DeepSpeed's 5e8 would be 2 GB of fp32)
        options.update(
            stage=max(1, zero.stage),
            reduce_dtype=reduce,
            bucket_mb=zero.reduce_bucket_size * item / 2**20 if zero.reduce_bucket_size else 25,
        )
    if cls is not None:
        options.update(
            optimizer_class=cls,
            offload=None,
            offload_fraction=1.0,
            offload_dir=None,
            **_untested(cls, allow_untested, off.device),
        )
    return zeroshard.ShardedOptimizer(groups, **kwargs, **as_policies(options))


def make_scheduler(lr_scheduler, cfg: Config, optimizer):
    """The client's schedule (an object, or a callable taking the optimizer), else the config's."""
    if lr_scheduler is not None:
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is not None:
        if optimizer is None:
            raise ValueError("DeepSpeed config has a scheduler but no optimizer (none in the config, none passed)")
        return lr_schedules.from_config(cfg.scheduler[0], cfg.scheduler[1], optimizer)
    return None


def make_dataloader(training_data, collate_fn, cfg: Config):
    """DeepSpeed's data loader: this rank's share (a DistributedSampler) in micro-batches."""
    if training_data is None:
        return None
    sampler = torch.utils.data.distributed.DistributedSampler(training_data)
    return torch.utils.data.DataLoader(
        training_data,
        batch_size=cfg.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
    )
