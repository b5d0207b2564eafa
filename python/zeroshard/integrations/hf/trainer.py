"""``ZeroShardTrainerMixin``: the Hugging Face ``Trainer`` with zeroshard in place of
the DDP wrapper Accelerate would add. Data loading, logging, evaluation,
callbacks, schedules and the training loop stay the Trainer's; what changes is
where the optimizer comes from, the model the loop calls, accumulation and
checkpoints ([Note: Trainer integration]).

[Note: Trainer integration] The Trainer builds its optimizer over the plain
model (``create_optimizer``: the ``optim`` argument's class, the no-decay
groups), then prepares the model with Accelerate, which wraps it in DDP in a
multi-process run. Here ``create_optimizer`` keeps the Trainer's choice but
rebuilds it as a ``ShardedOptimizer`` (same class, hyperparameters, groups; at
stage 3 over the ``FullyShard`` pieces, the model wrapped first), and
``_prepare_for_training`` asks Accelerate for autocast only
(``prepare_model(evaluation_mode=True)``: no DDP, no device move) and wraps the
optimizer without Accelerate's state-dict round trip. What the loop then does
works unchanged on zeroshard's objects: ``model.zero_grad()``, the GradScaler,
the logged ``grad_norm``; clipping (``max_grad_norm``) goes to the optimizer's
``clip_grad_norm_`` after Accelerate unscales: the global norm, from statistics
taken once per step. Non-final micro-batches run under ``no_sync``. A checkpoint folder holds the
``save_pretrained`` files (from rank 0 at stages 1/2; streamed from the
zeroshard checkpoint at stage 3) and ``zeroshard/``, the sharded model and
optimizer state, which a resume loads at any world size and stage.
A model wrapped before the trainer (``from_pretrained`` at stage 3) is trained as it
is: the Trainer sees the model inside, and the arguments' precision must be the one
it gathers in. At stage 3 a peft model's files are its adapter alone.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Optional

import torch

import zeroshard
from zeroshard import comm

from .. import convert
from . import pretrained
from . import tensor_parallel
from .options import SHARDED_DIR, Options

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
FORMAT = "zeroshard-hf/1"


class ZeroShardTrainerMixin:
    """Put first in a ``Trainer`` subclass's bases (``class SFT(ZeroShardTrainerMixin,
    trl.SFTTrainer)``) to train it with zeroshard; ``zeroshard=dict(stage=..., ...)``
    takes ``Options``' keys. ``ZeroShardTrainer`` is this mixin over ``Trainer``."""

    def __init__(self, *args, zeroshard: Optional[dict] = None, **kwargs):
        self.zeroshard_options = Options.parse(zeroshard, type(self).__name__)
        self.sharded_optimizer: Optional["zeroshard.ShardedOptimizer"] = None
        self.zeroshard_model: Optional[torch.nn.Module] = None  # what trains: the model, or its FullyShard
        args, kwargs = self._adopt(args, kwargs)
        self._replaced: dict = {}  # tp/ep plans: id(parameter replaced) -> (its name, it)
        self.zeroshard_mesh = None  # tensor parallelism: the (dp_shard, tp) mesh
        self.zeroshard_experts_mesh = None  # expert parallelism: the (edp, ep, tp of 1) mesh
        super().__init__(*args, **kwargs)
        self._check_setup()
        if self.zeroshard_options.tp_size > 1 or self.zeroshard_options.ep_size > 1:
            before = {id(p): (n, p) for n, p in self.model.named_parameters()}
            if self.zeroshard_options.tp_size > 1:
                self._tensor_parallel()
            else:  # [Note: expert DTensors]
                self.zeroshard_experts_mesh = tensor_parallel.expert_parallelize(
                    self.model, self.zeroshard_options.ep_size, self.accelerator.device.type, type(self).__name__
                )
            self._replaced = before

    def _tensor_parallel(self) -> None:
        """[Note: Hugging Face tensor parallelism]: the model's plan over the tp ranks."""
        where = type(self).__name__
        if self.zeroshard_model is not None:
            raise ValueError(
                f"{where}: zeroshard tp_size={self.zeroshard_options.tp_size} applies the model's "
                "tensor-parallel plan to the plain model; pass it unwrapped (not from_pretrained's)"
            )
        self.zeroshard_mesh = tensor_parallel.mesh(
            self.args, self.zeroshard_options.tp_size, self.accelerator.device.type, where
        )
        tensor_parallel.parallelize(self.model, self.zeroshard_mesh["tp"], where)

    def _dp_mesh(self):
        """Beside a tp axis, the ranks zeroshard shards over (None: all of them)."""
        return self.zeroshard_mesh["dp_shard"] if self.zeroshard_mesh is not None else None

    def get_tp_size(self) -> int:
        """The ranks of a tp group share a batch: the Trainer's token counts and loss scale."""
        return self.zeroshard_options.tp_size if self.zeroshard_mesh is not None else super().get_tp_size()

    def _get_dataloader(self, *args, **kwargs):
        """With tp_size, the ranks of a tp group get the same batches."""
        if self.zeroshard_mesh is None:
            return super()._get_dataloader(*args, **kwargs)
        with tensor_parallel.data_follow(self.accelerator, self.zeroshard_mesh):
            return super()._get_dataloader(*args, **kwargs)

    def _adopt(self, args: tuple, kwargs: dict):
        """A model wrapped before the trainer (``from_pretrained`` at stage 3): the trainer
        runs it, at stage 3, and the Trainer sees the model inside. Returns the Trainer's arguments."""
        given = kwargs.get("model", args[0] if args else None)
        if not isinstance(given, zeroshard.FullyShard):
            return args, kwargs
        if self.zeroshard_options.stage != 3:
            raise ValueError(
                f"{type(self).__name__}(model=FullyShard(...)): the model is sharded at stage 3; pass "
                f"zeroshard=dict(stage=3) (got stage={self.zeroshard_options.stage})"
            )
        self.zeroshard_model = given
        if "model" in kwargs:
            return args, dict(kwargs, model=given.module)
        return (given.module,) + tuple(args[1:]), kwargs

    def _check_precision(self) -> None:
        """A model wrapped before the trainer gathers in the dtype the arguments ask for."""
        fs, where = self.zeroshard_model, type(self).__name__
        if not isinstance(fs, zeroshard.FullyShard):
            return
        want = self.zeroshard_options.gather_precision(self._asked_precision(), where).param_dtype or torch.float32
        if fs.param_dtype != want:
            name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(want, "fp32")
            raise ValueError(
                f"{where}: the model was wrapped gathering its units in {fs.param_dtype}, but the "
                f"arguments ask for {want} (bf16={self.args.bf16}, fp16={self.args.fp16}); wrap or load "
                f"it with zeroshard=dict(stage=3, mixed_precision='{name}') to match"
            )

    def _asked_precision(self) -> Optional[str]:
        return "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else None

    def _move_model_to_device(self, model, device):
        """A model wrapped before the trainer is where FullyShard put it."""
        if isinstance(self.zeroshard_model, zeroshard.FullyShard):
            return None
        return super()._move_model_to_device(model, device)

    def _check_setup(self) -> None:
        where = type(self).__name__
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            which = "deepspeed=" if self.is_deepspeed_enabled else "fsdp="
            raise ValueError(
                f"{where}: TrainingArguments({which}...) asks for another sharding; zeroshard shards "
                f"the run itself: drop {which} (zeroshard=dict(stage=...) chooses the stage)"
            )
        if isinstance(self.optimizer, zeroshard.ShardedOptimizer):
            raise TypeError(
                f"{where}(optimizers=(ShardedOptimizer, ...)): pass the plain torch optimizer (e.g. "
                "torch.optim.AdamW(model.parameters(), ...)) or none; the trainer builds the "
                "ShardedOptimizer from it after the model is placed, at the stage zeroshard= gives"
            )
        if self.args.n_gpu > 1:
            raise ValueError(
                f"{where}: {self.args.n_gpu} GPUs in one process (DataParallel); launch one process "
                "per GPU with torchrun or accelerate launch"
            )
        self._check_precision()

    # ---------------------------------------------------------------- building
    def create_optimizer(self, model=None):
        """The Trainer's optimizer (``optim``, its hyperparameters, the no-decay groups,
        or the one passed in ``optimizers=``), rebuilt as a ShardedOptimizer; at stage
        3 the model is wrapped in FullyShard first."""
        if self.sharded_optimizer is not None:
            return self.sharded_optimizer
        plain = self.optimizer if self.optimizer is not None else super().create_optimizer(model)
        names = {i: n for i, (n, _) in self._replaced.items()}  # (an optimizer built before the plan)
        names.update({id(p): n for n, p in self.model.named_parameters()})
        runner, pieces, dp_mesh = self.model, None, self._dp_mesh()
        if self.zeroshard_options.stage == 3:
            runner = (
                self.zeroshard_model
                if self.zeroshard_model is not None
                else self.zeroshard_options.fully_shard(
                    self.model, self._asked_precision(), type(self).__name__, dp_mesh
                )
            )
            pieces = dict(runner.named_parameters())
        elif self._replaced:
            pieces = dict(self.model.named_parameters())
        experts = self.zeroshard_experts_mesh["edp"] if self.zeroshard_experts_mesh is not None else None
        sharded = convert.to_sharded(plain, self.zeroshard_options.optimizer_kwargs(dp_mesh), pieces, names, experts)
        convert.move_schedulers([self.lr_scheduler], plain, sharded)
        self.sharded_optimizer, self.zeroshard_model, self.optimizer = sharded, runner, sharded
        self._replaced = {}
        return sharded

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """[Note: Trainer integration]: no DDP wrapper; the ShardedOptimizer built after
        the model's placement; the checkpoint loaded into both."""
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        model = self.accelerator.prepare_model(self.zeroshard_model, device_placement=False, evaluation_mode=True)
        if not getattr(self.optimizer, "_is_accelerate_prepared", False):
            self.optimizer = self.accelerator.prepare_optimizer(self.sharded_optimizer, device_placement=False)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Evaluation and prediction run the model training runs (the FullyShard at stage 3)."""
        if self.zeroshard_model is not None:
            return self.zeroshard_model
        return super()._wrap_model(model, training, dataloader)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Non-final micro-batches of an accumulation reduce nothing (stages 1/2: the
        optimizer's ``no_sync``; at stage 3 Accelerate's ``no_sync`` reaches FullyShard's)."""
        quiet = (
            self.sharded_optimizer is not None
            and not self.accelerator.sync_gradients
            and not isinstance(model, zeroshard.FullyShard)
        )
        with self.sharded_optimizer.no_sync() if quiet else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        """``max_grad_norm``: the global norm from the optimizer's per-step statistics,
        the scale applied inside its step (no pass over the gradients)."""
        if self.sharded_optimizer is None:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return self.sharded_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged ``grad_norm`` (without clipping too): the global one."""
        if grad_norm is None and self.sharded_optimizer is not None:
            self.accelerator.unscale_gradients()
            grad_norm = self.sharded_optimizer.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    # ------------------------------------------------------------- saving
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """What ``save_pretrained`` writes, into ``output_dir``; call it on every rank
        (collective at stage 3, where rank 0 streams a zeroshard checkpoint into the
        files and no rank holds the whole model). Inside a checkpoint the sharded
        model and optimizer state are written first and the files come from them."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        whole = (
            isinstance(self.zeroshard_model, zeroshard.FullyShard)
            or self.zeroshard_options.tp_size > 1
            or self.zeroshard_options.ep_size > 1
        )
        if self.sharded_optimizer is None or not whole:
            if self.sharded_optimizer is not None:
                self.sharded_optimizer.wait_params()
            return super().save_model(output_dir, _internal_call)
        fs = self.zeroshard_model
        comm.check_in(
            f"{type(self).__name__}.save_model()",
            self.sharded_optimizer,
            fs.process_group if isinstance(fs, zeroshard.FullyShard) else None,
            hint="At stage 3 or with tp_size no rank holds the whole model: call trainer.save_model() on "
            "every rank, as Trainer scripts do (rank 0 writes the files)",
        )
        if _internal_call:
            checkpoint = self._save_sharded(output_dir, with_optimizer=not self.args.save_only_model)
            if pretrained.is_peft(self.model):  # the adapter, as peft's save_pretrained writes it
                pretrained.save_adapter(fs, output_dir, is_main_process=self.args.should_save)
            elif self.args.should_save:
                pretrained.export_pretrained(checkpoint, self.model, output_dir, self.zeroshard_options.max_shard_size)
        else:
            pretrained.save_pretrained(
                self.zeroshard_model,
                output_dir,
                is_main_process=self.args.should_save,
                max_shard_size=self.zeroshard_options.max_shard_size,
            )
        if self.args.should_save:
            self._save_beside_weights(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_beside_weights(self, output_dir: str) -> None:
        """What ``Trainer._save`` writes next to the weights (rank 0)."""
        processor = self.processing_class
        if processor is None and getattr(self.data_collator, "tokenizer", None) is not None:
            processor = self.data_collator.tokenizer
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_sharded(self, output_dir: str, with_optimizer: bool) -> str:
        """Collective: the model (and the optimizer, where zeroshard checkpoints hold its
        state) into ``output_dir/zeroshard``; returns that path."""
        path = os.path.join(output_dir, SHARDED_DIR)
        if getattr(self, "_zeroshard_saved", None) != path:
            opt = self.sharded_optimizer if with_optimizer and self.sharded_optimizer.sharded_state else None
            zeroshard.save_checkpoint(
                path, self.zeroshard_model, opt, extra={"format": FORMAT, "with_optimizer": opt is not None}
            )
            self._zeroshard_saved = path
        return path

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharded_optimizer is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self._save_sharded(output_dir, with_optimizer=True)
        if not self.sharded_optimizer.sharded_state:  # its own format, consolidated on rank 0
            self.sharded_optimizer.consolidate_state_dict(to=0)
            if self.args.should_save:
                torch.save(self.sharded_optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))
        self._zeroshard_saved = None
        if self.args.should_save:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ------------------------------------------------------------- loading
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """A folder with ``zeroshard/`` loads with the optimizer, once both exist
        (``_load_optimizer_and_scheduler``); any other folder (a DDP run's) as the Trainer does."""
        if os.path.isdir(os.path.join(resume_from_checkpoint, SHARDED_DIR)):
            return None
        if self.zeroshard_model is not None and self.zeroshard_model is not self.model:
            raise ValueError(
                f"{resume_from_checkpoint} has no {SHARDED_DIR}/ folder: at stage 3 a checkpoint "
                "loads into the sharded model from a zeroshard checkpoint this trainer wrote"
            )
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or self.sharded_optimizer is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        sharded = os.path.join(checkpoint, SHARDED_DIR)
        if not os.path.isdir(sharded):
            return super()._load_optimizer_and_scheduler(checkpoint)  # torch's format, any world size
        own_format = not self.sharded_optimizer.sharded_state
        zeroshard.load_checkpoint(sharded, self.zeroshard_model, None if own_format else self.sharded_optimizer)
        if own_format:
            self.sharded_optimizer.load_state_dict(
                torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
            )
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self) -> None:
        sharded = os.path.join(self.state.best_model_checkpoint, SHARDED_DIR)
        if self.zeroshard_model is None or not os.path.isdir(sharded):
            return super()._load_best_model()
        zeroshard.load_checkpoint(sharded, self.zeroshard_model, None)
