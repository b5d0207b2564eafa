"""DeepSpeed's checkpoint layout over zeroshard checkpoints.

As DeepSpeed names them: ``save_dir/<tag>/`` per checkpoint (default tag
``global_step{N}``) and ``save_dir/latest``, a text file holding the tag
the last save wrote. Inside ``<tag>/`` is a zeroshard checkpoint
(``zeroshard.save_checkpoint``: a file per rank, a manifest, atomic, and
loadable at any world size and stage); its ``extra`` holds the engine's
counters, the schedule's and loss scale's states and ``client_state``.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

import zeroshard

LATEST = "latest"
FORMAT = "zeroshard-deepspeed/1"


def tag_dir(root, tag: Optional[str]) -> Optional[str]:
    """``root/tag``, or ``root/<the tag in root/latest>``; None if there is no latest file."""
    if tag is None:
        latest = os.path.join(os.fspath(root), LATEST)
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.join(os.fspath(root), str(tag))


def _write_latest(root: str, tag: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def save(engine, save_dir, tag, client_state: dict, save_latest: bool, exclude_frozen: bool) -> bool:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    root = os.fspath(save_dir)
    os.makedirs(root, exist_ok=True)
    extra = {
        "format": FORMAT,
        "client_state": client_state,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "micro_steps": engine.micro_steps,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "zero_stage": engine.zero_optimization_stage(),
        "world_size": engine.world_size,
    }
    zeroshard.save_checkpoint(
        os.path.join(root, tag), engine.runner, engine.optimizer, extra=extra, exclude_frozen=exclude_frozen
    )
    if save_latest and engine.global_rank == 0:
        _write_latest(root, tag)
    dist.barrier()
    return True


def load(
    engine,
    load_dir,
    tag,
    strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    custom_load_fn,
):
    if custom_load_fn is not None:
        raise NotImplementedError(
            "load_checkpoint(custom_load_fn=...): a zeroshard checkpoint loads only into the model it was saved from"
        )
    path = tag_dir(load_dir, tag)
    if path is None or not os.path.isdir(path):
        warnings.warn(
            f"load_checkpoint: no checkpoint at {path or os.path.join(os.fspath(load_dir), LATEST)}; "
            "nothing loaded (as DeepSpeed, returning (None, None))",
            stacklevel=3,
        )
        return None, None
    with_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    extra = zeroshard.load_checkpoint(path, engine.runner, engine.optimizer if with_optimizer else None, strict=strict)
    if not with_optimizer and engine.optimizer is not None:
        _refresh_master(engine)
    extra = extra if isinstance(extra, dict) and extra.get("format") == FORMAT else {"client_state": extra}
    if not load_module_only and "global_steps" in extra:
        engine.global_steps, engine.global_samples = extra["global_steps"], extra["global_samples"]
        engine.skipped_steps, engine.micro_steps = extra["skipped_steps"], extra["micro_steps"]
        engine.loss_scaler.load_state_dict(extra["loss_scaler"])
        if load_lr_scheduler_states and engine.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    return path, extra.get("client_state")


def _refresh_master(engine) -> None:
    """The model alone was loaded: stages 1/2 with fp16/bf16 parameters keep an fp32 master
    shard of them, re-made here from the loaded parameters (the optimizer's moments kept)."""
    if engine.zero_optimization_stage() == 3 or not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        return
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())


def save_model(engine, save_dir, save_filename: str) -> bool:
    sd = engine.module_state_dict()
    if engine.global_rank == 0:
        os.makedirs(os.fspath(save_dir), exist_ok=True)
        torch.save(sd, os.path.join(os.fspath(save_dir), save_filename))
    dist.barrier()
    return True
