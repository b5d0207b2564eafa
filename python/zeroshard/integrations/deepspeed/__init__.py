"""DeepSpeed scripts and configs on zeroshard: ``initialize`` (as
``zeroshard.initialize``) reads a DeepSpeed config (``config``), builds
zeroshard's objects from it (``build``) and returns an engine with
DeepSpeed's calls (``engine``; ``checkpoints``: DeepSpeed's tags and
``latest`` file over zeroshard checkpoints), with DeepSpeed's fp16 loss scale
(``loss_scaler``) and learning-rate schedules (``lr_schedules``);
``zero_to_fp32`` reads a checkpoint back as one fp32 state dict. DeepSpeed's
user-facing helpers under the same names: ``zero.GatheredParameters`` and
``utils``' ``safe_*`` getters and setters (``live``: which engine holds a
parameter), so ``from zeroshard.integrations import deepspeed`` stands in for
``import deepspeed``; ``zero.Init`` (``zero_init``) builds a model sharded as it
is constructed, as ``deepspeed.zero.Init``. DeepSpeed itself is never imported.
See docs/deepspeed.md.

May import: the public API only (``zeroshard``, ``zeroshard.checkpoint``,
``zeroshard.comm``, ``zeroshard.plan``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

from . import build, lr_schedules, utils, zero, zero_init, zero_to_fp32
from .config import Config, load, parse
from .engine import DeepSpeedEngine

__all__ = ["initialize", "DeepSpeedEngine", "Config", "parse", "zero", "utils", "lr_schedules", "zero_to_fp32"]


def initialize(
    args: Any = None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: Optional[int] = None,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Optional[Callable] = None,
    config=None,
    mesh_param: Any = None,
    config_params=None,
):
    """``deepspeed.initialize``'s call and return, on zeroshard: replace
    ``deepspeed.initialize`` by ``zeroshard.initialize`` and the script runs.

    Args:
        args: an object whose ``deepspeed_config`` (if set) is the config's path.
        model: the ``nn.Module`` to train (converted to fp16/bf16 when the config
            enables them, and moved to this rank's GPU, as DeepSpeed does).
        optimizer: a torch optimizer, or a callable taking the parameters and
            returning one; overrides the config's ``optimizer`` section. Its class,
            param groups and hyperparameters are carried over to a
            ``ShardedOptimizer`` (the object itself is not stepped).
        model_parameters: the parameters (or param groups) the config's optimizer
            trains; default: all of the model's.
        training_data: a dataset: the third return value is then a data loader of
            this rank's share in micro-batches.
        lr_scheduler: a scheduler, or a callable taking the optimizer and returning
            one; overrides the config's ``scheduler`` section.
        distributed_port, mesh_param: accepted; the port comes from torchrun's
            environment.
        mpu: refused (zeroshard has no model parallelism).
        dist_init_required: None: create the default process group from
            torchrun's environment if none exists; False: require one.
        collate_fn: the data loader's.
        config: the DeepSpeed config, a dict or a JSON file's path
            (``config_params`` is its older name).

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``: the
        ``DeepSpeedEngine``, the ``ShardedOptimizer`` (None without one), the
        data loader (None without ``training_data``) and the schedule (None
        without one).
    """
    if mesh_param is not None:
        raise NotImplementedError("zeroshard.initialize(mesh_param=...): zeroshard has no sequence parallelism")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("a DeepSpeed config both in args.deepspeed_config and config=; pass one of them")
        config = from_args
    if config is None:
        raise ValueError(
            "zeroshard.initialize needs a DeepSpeed config: config= (a dict or a JSON file's path) "
            "or args.deepspeed_config"
        )
    build.refuse_unsupported(model, mpu)
    build.init_distributed(dist_init_required)
    cfg, raw = parse(config, dist.get_world_size()), load(config)
    wrapped = build.take_over(model, cfg)  # a second initialize over the same model
    model = zero_init.prepare_model(model, cfg) if wrapped is None else model
    spec = build.optimizer_spec(model, cfg, optimizer, model_parameters)
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter: its first name
    runner = zero_init.wrap_model(model, cfg, wrapped)
    opt = build.make_optimizer(spec, names, runner, cfg, bool(raw.get("zero_allow_untested_optimizer", False)))
    sched = build.make_scheduler(lr_scheduler, cfg, opt)
    loader = build.make_dataloader(training_data, collate_fn, cfg)
    engine = DeepSpeedEngine(model, runner, opt, sched, cfg, raw, loader)
    return engine, opt, loader, sched
