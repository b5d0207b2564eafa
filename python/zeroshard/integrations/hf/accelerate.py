"""``prepare``: an ``accelerate launch`` script trained with zeroshard. In place of
``accelerator.prepare(model, optimizer, ...)``::

    model, optimizer, loader, scheduler = zeroshard.integrations.hf.prepare(
        accelerator, model, optimizer, loader, scheduler, stage=2)

The model is not wrapped in DDP (Accelerate applies its autocast only); the
optimizer becomes a ShardedOptimizer (same class, hyperparameters, groups; at
stage 3 over the FullyShard pieces) that Accelerate steps, scales and skips as
its own; the other objects go through ``accelerator.prepare``. Under
``accelerator.accumulate`` the non-final micro-batches reduce nothing.
``accelerator.save_state`` / ``load_state`` keep the model and optimizer state
sharded in ``<dir>/zeroshard`` (loadable at any world size and stage) beside
Accelerate's own files.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import GradientState
from accelerate.utils import DistributedType

import zeroshard

from .. import convert
from .options import SHARDED_DIR, Options


class ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper (steps only when gradients sync, GradScaler,
    skipped-step detection) around a ShardedOptimizer, whose state
    ``save_state``/``load_state`` keep sharded in ``<dir>/zeroshard`` (the
    ``state_dict`` Accelerate writes is a pointer there)."""

    def __init__(self, optimizer: "zeroshard.ShardedOptimizer", scaler=None):
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        self._is_accelerate_prepared = True  # accelerator.prepare_optimizer registers it as it is

    def state_dict(self):
        if self.optimizer.sharded_state:
            return {"zeroshard": SHARDED_DIR}
        self.optimizer.consolidate_state_dict(to=0)  # its class's own format, on rank 0 (written there)
        return self.optimizer.state_dict() if torch.distributed.get_rank() == 0 else {}

    def load_state_dict(self, state_dict):
        if state_dict.get("zeroshard") == SHARDED_DIR:
            return  # loaded by the load_state hook, with the model
        self.optimizer.load_state_dict(state_dict)


class _Quiet:
    """At each forward, enter the optimizer's ``no_sync`` when Accelerate is in a
    non-final micro-batch of ``accumulate`` and leave it on the final one (stages
    1/2; FullyShard has ``no_sync`` of its own, which Accelerate enters)."""

    def __init__(self, optimizer):
        self.optimizer, self.context = optimizer, None
        self.state = GradientState()

    def __call__(self, module, args):
        if not torch.is_grad_enabled():
            return
        if not self.state.sync_gradients and self.context is None:
            self.context = self.optimizer.no_sync()
            self.context.__enter__()
        elif self.state.sync_gradients and self.context is not None:
            context, self.context = self.context, None
            context.__exit__(None, None, None)


class _States:
    """``save_state``/``load_state`` hooks: the model and optimizer to and from a
    zeroshard checkpoint in ``<dir>/zeroshard``; Accelerate's own copy of the
    model's weights is left out."""

    def __init__(self, prepared, runner, optimizer):
        self.prepared, self.runner = prepared, runner
        self.optimizer = optimizer if optimizer.sharded_state else None  # else: Accelerate's optimizer file

    def _index(self, models) -> Optional[int]:
        found = [i for i, m in enumerate(models) if m is self.prepared]
        return found[0] if found else None

    def save(self, models, weights, output_dir):
        zeroshard.save_checkpoint(os.path.join(output_dir, SHARDED_DIR), self.runner, self.optimizer)
        i = self._index(models)
        if i is not None and i < len(weights):
            weights.pop(i)

    def load(self, models, input_dir):
        zeroshard.load_checkpoint(os.path.join(input_dir, SHARDED_DIR), self.runner, self.optimizer)
        i = self._index(models)
        if i is not None:
            models.pop(i)


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *others, **options):
    """``accelerator.prepare`` for zeroshard: returns ``(model, optimizer, *others)``
    prepared. ``options``: ``Options``' keys (``stage=2`` by default). The model
    returned is the one to call (a FullyShard at stage 3; save it with
    ``zeroshard.integrations.hf.save_pretrained``)."""
    opts = Options.parse(options, "zeroshard.integrations.hf.prepare")
    opts.trainer_only("zeroshard.integrations.hf.prepare")
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise ValueError(
            f"prepare: this Accelerator is configured for {accelerator.distributed_type.value}; "
            "zeroshard shards the run itself: launch without a DeepSpeed/FSDP config"
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or getattr(model, "_is_accelerate_prepared", False):
        raise TypeError("prepare: pass the plain model, not one accelerator.prepare already wrapped")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, zeroshard.ShardedOptimizer):
        raise TypeError(
            "prepare: pass the plain torch optimizer built over the model (e.g. "
            "torch.optim.AdamW(model.parameters(), ...)); prepare builds the ShardedOptimizer from it"
        )
    if not any(p.is_meta for p in model.parameters()):
        model.to(accelerator.device)  # placement first: the ShardedOptimizer views the placed tensors
    names = {id(p): n for n, p in model.named_parameters()}
    runner, pieces = model, None
    if opts.stage == 3:
        runner = opts.fully_shard(model)
        pieces = dict(runner.named_parameters())
    sharded = convert.to_sharded(optimizer, opts.optimizer_kwargs(), pieces, names)
    convert.move_schedulers(others, optimizer, sharded)
    prepared = accelerator.prepare_model(runner, device_placement=False, evaluation_mode=True)
    wrapped = accelerator.prepare_optimizer(ShardedAcceleratedOptimizer(sharded, scaler=accelerator.scaler))
    if not isinstance(runner, zeroshard.FullyShard):
        runner.register_forward_pre_hook(_Quiet(sharded))
    states = _States(prepared, runner, sharded)
    accelerator.register_save_state_pre_hook(states.save)
    accelerator.register_load_state_pre_hook(states.load)
    rest = accelerator.prepare(*others) if others else ()
    rest = rest if isinstance(rest, tuple) else (rest,)
    return (prepared, wrapped, *rest)
