"""``DeepSpeedEngine``: DeepSpeed's engine calls on zeroshard's objects.

The engine holds the user's model, the model it calls (``FullyShard`` at
stage 3, else the model itself), a ``ShardedOptimizer``, the schedule and the
fp16 loss scale, and keeps DeepSpeed's counters. It adds nothing to the
training math: ``backward`` divides the loss by the accumulation steps (and
multiplies it by the fp16 scale) and calls ``loss.backward()``; a script's own
``loss.backward()`` is divided the same way, by a hook on the gradient of each
tensor the engine's forward returned, as DeepSpeed 0.19's engine does (with
fp16, the loss must come from ``engine.scale(loss)``). At each accumulation
boundary ``step`` unscales (and, with ``gradient_allreduce_op: "sum"``,
multiplies the averaged gradients by the world size), clips with
``ShardedOptimizer.clip_grad_norm_``, steps, zeroes the gradients and steps
the schedule, skipping a step whose gradients hold an inf or NaN on any rank,
as DeepSpeed does. A parameter no rank gave a gradient gets a zero one, as
DeepSpeed gives it (its weight decay and momentum still move it), unless
``ignore_unused_parameters`` asks for an error.
Micro-batches before the boundary run under ``no_sync()`` at stages 0 and 1
(one reduction per step, as DeepSpeed's ZeRO-1) and are reduced each time at
stages 2 and 3 (so the gradients stay sharded).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import checkpoints, live
from .config import Config
from .loss_scaler import LossScaler


def _device_of(runner: nn.Module) -> torch.device:
    """The device the engine's model computes on (FullyShard's, else its parameters')."""
    if isinstance(getattr(runner, "device", None), torch.device):
        return runner.device
    p = next(runner.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def hook_outputs(out, hook) -> None:
    """``hook`` on the gradient of every tensor with a grad_fn in a forward's output, looking
    into tuples, lists and dicts (a Hugging Face ModelOutput is one), as DeepSpeed's engine does."""
    if isinstance(out, torch.Tensor):
        if out.grad_fn is not None:
            out.register_hook(hook)
    elif isinstance(out, (tuple, list)):
        for item in out:
            hook_outputs(item, hook)
    elif isinstance(out, dict):
        for item in out.values():
            hook_outputs(item, hook)


class DeepSpeedEngine(live.Tracked, nn.Module):
    """What ``zeroshard.initialize`` returns first: call it as the model, then
    ``engine.backward(loss)`` and ``engine.step()`` after every micro-batch."""

    def __init__(
        self, module: nn.Module, runner: nn.Module, optimizer, lr_scheduler, cfg: Config, config: dict, dataloader=None
    ):
        super().__init__()
        self.module = module  # the user's model (DeepSpeed's engine.module)
        object.__setattr__(self, "runner", runner)  # what forward calls; not a second submodule
        self.optimizer, self.lr_scheduler, self.cfg, self.config = optimizer, lr_scheduler, cfg, config
        self.training_dataloader = dataloader
        self.loss_scaler = LossScaler(cfg.fp16)
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = _device_of(runner)  # where inputs go: x.to(engine.device), as with DeepSpeed
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary()
        self._step_applied = False
        self._grad_norm: Optional[float] = None
        self._in_engine_backward = 0  # engine.backward() running: its loss is divided already
        self._scaled_by_user = False  # engine.scale(loss) since the last forward
        self._names = {id(p): n for n, p in runner.named_parameters()}
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.track()  # (live.Tracked: destroy(), the helpers' lookups)

    # ------------------------------------------------------------- config
    def train_batch_size(self) -> int:
        return self.cfg.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.cfg.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.cfg.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.cfg.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.cfg.zero.stage

    def fp16_enabled(self) -> bool:
        return self.cfg.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.cfg.bf16

    def steps_per_print(self) -> Optional[int]:
        return self.cfg.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.cfg.wall_clock_breakdown

    # ------------------------------------------------------------- state
    def get_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        return [g.get("betas", (g.get("momentum"),))[0] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last optimizer step (before clipping, unscaled; inf if
        it overflowed); None before the first."""
        return self._grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters (False off the boundary, or skipped)."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the micro-step counter's boundary (None: back to counting)."""
        self._boundary = is_boundary

    # ---------------------------------------------------------- training
    def forward(self, *inputs, **kwargs):
        self._check_alive("engine(...)")
        self._scaled_by_user = False
        with self._timed("forward"):
            out = self.runner(*inputs, **kwargs)
        hook_outputs(out, self._output_grad)
        return out

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """An output's gradient: in a backward the script started itself (``loss.backward()``),
        divided by the accumulation steps, as DeepSpeed's engine divides it."""
        if self._in_engine_backward:
            return grad
        if self.loss_scaler.scale != 1.0 and not self._scaled_by_user:
            raise RuntimeError(
                "loss.backward() with fp16 loss scaling on a loss the scale was not applied to: "
                "call engine.scale(loss).backward(), or engine.backward(loss) (DeepSpeed 0.19 "
                "refuses it too with dynamic scaling, and with a static loss_scale divides the "
                "gradients by a scale the loss never had)"
            )
        gas = self.gradient_accumulation_steps()
        return grad / gas if gas != 1 else grad

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for the script's own backward
        (``engine.scale(loss).backward()``), as DeepSpeed's ``engine.scale``."""
        self._scaled_by_user = True
        return loss * self.loss_scaler.scale if self.loss_scaler.scale != 1.0 else loss

    def train(self, mode: bool = True):
        super().train(mode)
        if self.runner is not self.module:  # stage 3: the FullyShard wrapper too
            self.runner.train(mode)
        return self

    def no_sync(self):
        """Accumulate gradients locally, reduced by the next backward outside (any stage)."""
        return self.optimizer.no_sync()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """``loss / gradient_accumulation_steps`` (returned), times the fp16 scale, backward."""
        self._check_alive("engine.backward()")
        if self.optimizer is None:
            raise RuntimeError("engine.backward() needs an optimizer (none in the config, none passed)")
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        scaled = loss * self.loss_scaler.scale if self.loss_scaler.scale != 1.0 else loss
        local = self.cfg.zero.stage <= 1 and not self.is_gradient_accumulation_boundary()
        self._in_engine_backward += 1
        try:
            with self._timed("backward"), self.optimizer.no_sync() if local else contextlib.nullcontext():
                scaled.backward(retain_graph=retain_graph)
        finally:
            self._in_engine_backward -= 1
        return loss

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Count a micro-step; at the accumulation boundary, update (see the module docstring)."""
        self._check_alive("engine.step()")
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer (none in the config, none passed)")
        self._step_applied = False
        with self._timed("step"):
            if self.is_gradient_accumulation_boundary():
                self._take_model_step(lr_kwargs)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs) -> None:
        opt = self.optimizer
        self._zero_unused()
        # the fp16 unscale and, for gradient_allreduce_op "sum", the sum over the ranks from their mean
        factor = (self.world_size if self.cfg.gradient_allreduce_op == "sum" else 1) / self.loss_scaler.scale
        if factor != 1.0:
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            torch._foreach_mul_(grads, factor)
        clip = self.cfg.gradient_clipping
        norm = float(opt.clip_grad_norm_(clip if clip > 0 else math.inf))
        overflow = not math.isfinite(norm)
        if not overflow:
            self._sync_hyperparameters()
            opt.step()
            overflow = bool(getattr(opt, "last_step_skipped", False))
        opt.zero_grad()
        self.loss_scaler.update(overflow)
        self._grad_norm = math.inf if overflow else norm
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._report()

    def _zero_unused(self) -> None:
        """Trainable parameters no rank gave a gradient since the last step. DeepSpeed steps them
        with a zero gradient (its ZeRO optimizers' flat partitions hold zeros there; at stage 0
        its engine makes zero gradients before reducing), so weight decay and momentum still
        move them and they count as stepped: here each gets a zero gradient (``p.grad`` set by
        hand: [Note: gradients set by the script]). With ``ignore_unused_parameters`` false
        DeepSpeed stops at them at stages 1-2 with optimizer offload, and so does zeroshard."""
        zero = self.cfg.zero
        idle = [
            (self._names.get(id(p), f"#{i}"), p)
            for g in self.optimizer.param_groups
            for i, p in enumerate(g["params"])
            if p.requires_grad and p.grad is None
        ]
        if (
            idle
            and not zero.ignore_unused_parameters
            and zero.stage in (1, 2)
            and zero.offload_optimizer.device != "none"
        ):
            raise RuntimeError(
                f"zeroshard.initialize: parameters {[n for n, _ in idle[:8]]}{' ...' if len(idle) > 8 else ''} got "
                "no gradient on any rank since the last step, and zero_optimization.ignore_unused_parameters is "
                "false (with offload_optimizer at stage 1-2 DeepSpeed stops there too); set it true to step them "
                "with a zero gradient, as DeepSpeed then does, or use them in the loss"
            )
        for _, p in idle:
            p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)

    def _sync_hyperparameters(self) -> None:
        """A client schedule bound to the client's own optimizer writes its param groups:
        carry those values into the sharded optimizer's before it steps."""
        source = getattr(self.lr_scheduler, "optimizer", None)
        if isinstance(source, torch.optim.Optimizer) and source is not self.optimizer:
            for mine, theirs in zip(self.optimizer.param_groups, source.param_groups):
                mine.update({k: v for k, v in theirs.items() if k != "params" and k in mine})

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    # ---------------------------------------------------------- reporting
    @contextlib.contextmanager
    def _timed(self, what: str):
        if not self.cfg.wall_clock_breakdown:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._times[what] += time.perf_counter() - start

    def _report(self) -> None:
        if self.global_rank != 0:
            return
        every = self.cfg.steps_per_print
        if every and self.global_steps % every == 0:
            print(
                f"[zeroshard] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                f"mom={self.get_mom()}",
                flush=True,
            )
        if self.cfg.wall_clock_breakdown:
            t = self._times
            print(
                f"[zeroshard] time (ms) | forward: {t['forward'] * 1e3:.2f} | backward: {t['backward'] * 1e3:.2f} "
                f"| step: {t['step'] * 1e3:.2f}",
                flush=True,
            )
            self._times = dict.fromkeys(t, 0.0)

    # -------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state: Optional[dict] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Collective: write ``save_dir/tag`` (default ``global_step{N}``), a zeroshard
        checkpoint holding the engine's counters, schedule, loss scale and
        ``client_state``, and (``save_latest``) the ``latest`` file naming it."""
        return checkpoints.save(self, save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
    ):
        """Collective: load ``load_dir/tag`` (default: the tag ``latest`` names) at any
        world size and stage; returns (its path, the ``client_state`` saved with it), or
        (None, None) when there is none."""
        return checkpoints.load(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn,
        )

    def module_state_dict(self) -> dict:
        """The model's full state dict, on every rank (collective at stage 3)."""
        if self.runner is not self.module:
            return self.runner.state_dict()
        return self.module.state_dict()

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters=False):
        """Rank 0 writes the model's full state dict (in its dtype) with ``torch.save``; collective."""
        return checkpoints.save_model(self, save_dir, save_filename)
