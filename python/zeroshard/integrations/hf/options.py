"""``ZeroShardTrainer(zeroshard=dict(...))`` and ``prepare(..., **options)``: the
sharding options, checked once, and what they build (the stage-3 ``FullyShard``,
the ShardedOptimizer's keywords). Shared by the Trainer and the Accelerate helper.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
import torch.nn as nn

import zeroshard

from ..deepspeed.build import block_units
from ..policies import fully_shard_policies

# save_pretrained's default largest safetensors file
DEFAULT_MAX_SHARD_SIZE = "50GB"
# the sharded model and optimizer state, inside a Trainer checkpoint or an Accelerate save_state folder
SHARDED_DIR = "zeroshard"


@dataclasses.dataclass(frozen=True)
class Options:
    """The zeroshard half of a Hugging Face run.

    stage: 1 (optimizer state sharded), 2 (also gradients; the default) or 3 (also
        parameters: the model is wrapped in ``FullyShard``).
    wrap: stage 3's units: module classes, class names, or a predicate; None: the
        model's ``_no_split_modules`` (as FSDP's transformer auto wrap), else each
        element of its outermost ``nn.ModuleList``s.
    offload / offload_dir / offload_fraction: where the optimizer state lives
        (None, ``"cpu"``, ``"nvme"``), as ``ShardedOptimizer``'s.
    offload_params: stage 3: keep the parameter shards in host memory.
    shard_size: hybrid sharding over groups of this many ranks.
    bucket_mb: stages 1/2: the reduce-scatter bucket size.
    reshard_after_forward, prefetch: stage 3: ``FullyShard``'s (an int k: the backward gathers
        over k ranks, ZeRO++'s hpZ).
    max_shard_size: the largest safetensors file a save writes (``save_pretrained``'s).
    tp_size: tensor parallelism: the model's own ``tp_plan`` applied over this many ranks
        (transformers' parallel styles), zeroshard over the rest ([Note: Hugging Face
        tensor parallelism] in integrations/hf/tensor_parallel.py).
    ep_size: expert parallelism: the model's own ``ep_plan`` over this many ranks (each
        holding 1/ep_size of every layer's experts, tokens exchanged all-to-all),
        the experts sharded over the world / ep_size ranks holding the same ones.
    mixed_precision: stage 3's gather and reduce dtypes: ``"bf16"`` / ``"fp16"`` (units
        gathered in that dtype, gradients reduced in fp32), ``"fp32"``, or a
        ``zeroshard.MixedPrecision``; None: what the Trainer's arguments ask for
        (``bf16=True`` / ``fp16=True``), else fp32 (``prepare`` keeps Accelerate's
        autocast over fp32 gathers: pass ``mixed_precision="bf16"`` for bf16 ones).
    """

    stage: int = 2
    wrap: Any = None
    offload: Optional[str] = None
    offload_dir: Optional[str] = None
    offload_fraction: float = 1.0
    offload_params: bool = False
    shard_size: Optional[int] = None
    bucket_mb: float = 25
    reshard_after_forward: Union[bool, int] = True
    prefetch: int = 1
    max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE
    mixed_precision: Any = None
    tp_size: int = 1
    ep_size: int = 1

    @classmethod
    def parse(cls, given, where: str) -> "Options":
        """From the user's dict (or None: stage 2), every key checked."""
        if given is None:
            given = {}
        if isinstance(given, Options):
            return given
        if not isinstance(given, dict):
            raise TypeError(f"{where}: zeroshard= takes a dict such as dict(stage=2), got {type(given).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(f"{where}: unknown zeroshard option(s) {unknown}; the options are {sorted(known)}")
        opts = cls(**given)
        opts.check(where)
        return opts

    def check(self, where: str) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"{where}: zeroshard stage={self.stage!r}; stage is 1 (optimizer state sharded), "
                "2 (also gradients) or 3 (also parameters, FullyShard)"
            )
        if self.wrap is not None and self.stage != 3:
            raise ValueError(f"{where}: wrap= chooses stage 3's units; stage={self.stage} shards no parameters")
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"{where}: offload_params=True offloads stage 3's parameter shards; at "
                f"stage={self.stage} use offload='cpu' (the optimizer state)"
            )
        if self.offload not in (None, "cpu", "nvme"):
            raise ValueError(f"{where}: offload={self.offload!r}; None, 'cpu' or 'nvme'")
        for key in ("tp_size", "ep_size"):
            size = getattr(self, key)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{where}: zeroshard {key}={size!r}; a positive integer (1: none)")
            if size > 1 and (self.shard_size is not None or self.offload or self.offload_params):
                raise ValueError(
                    f"{where}: zeroshard {key}={size} with shard_size= or offload is not "
                    "supported yet; drop one of them"
                )
        if self.ep_size > 1 and (self.stage == 3 or self.tp_size > 1):
            raise ValueError(
                f"{where}: zeroshard ep_size={self.ep_size} trains at stages 1 and 2 without tp_size "
                f"for now (got stage={self.stage}, tp_size={self.tp_size})"
            )
        if self.mixed_precision is not None:
            if self.stage != 3:
                raise ValueError(
                    f"{where}: mixed_precision= sets stage 3's gather dtype; at stage={self.stage} the "
                    "parameters are not gathered (use the Trainer's bf16=True: autocast)"
                )
            precision(self.mixed_precision, where)

    def trainer_only(self, where: str) -> None:
        """tp_size / ep_size parallelize the model inside ZeroShardTrainer; elsewhere refused."""
        for key in ("tp_size", "ep_size"):
            if getattr(self, key) > 1:
                raise ValueError(
                    f"{where}: zeroshard {key}={getattr(self, key)} is ZeroShardTrainer's (it applies "
                    f"the model's own plan); here parallelize the model yourself, or leave {key} out"
                )

    def optimizer_kwargs(self, dp_mesh=None) -> dict:
        """The ShardedOptimizer's sharding keywords; ``dp_mesh``: the ranks stages 1/2 shard
        over beside a tp axis."""
        kw = dict(
            offload=self.offload,
            offload_dir=self.offload_dir,
            offload_fraction=self.offload_fraction,
            shard_size=self.shard_size,
        )
        if self.stage != 3:
            kw.update(stage=self.stage, bucket_mb=self.bucket_mb)
            if dp_mesh is not None:
                kw["device_mesh"] = dp_mesh
        return kw

    def gather_precision(self, asked: Optional[str], where: str) -> "zeroshard.MixedPrecision":
        """Stage 3's MixedPrecision: ``mixed_precision`` when given, else what the run
        asked for (``asked``: ``"bf16"``, ``"fp16"`` or None)."""
        return precision(self.mixed_precision if self.mixed_precision is not None else asked, where)

    def fully_shard(
        self, model: nn.Module, asked: Optional[str] = None, where: str = "zeroshard", dp_mesh=None
    ) -> "zeroshard.FullyShard":
        """Stage 3's FullyShard of ``model``; ``dp_mesh``: the ranks it shards over beside a tp axis."""
        return zeroshard.FullyShard(
            model,
            wrap=units(model, self.wrap),
            mixed_precision=self.gather_precision(asked, where),
            reshard_after_forward=self.reshard_after_forward,
            prefetch=self.prefetch,
            **fully_shard_policies(self.offload_params, self.shard_size, dp_mesh),
        )


# the dtypes a run's precision names gather in; gradients reduce in fp32 (as FSDP's and DeepSpeed's)
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None, "no": None}


def precision(value, where: str) -> "zeroshard.MixedPrecision":
    """``mixed_precision=``'s value as a ``zeroshard.MixedPrecision``."""
    if value is None:
        return zeroshard.MixedPrecision()
    if isinstance(value, zeroshard.MixedPrecision):
        return value
    if value not in _LOW:
        raise ValueError(f"{where}: mixed_precision={value!r}; 'bf16', 'fp16', 'fp32' or a zeroshard.MixedPrecision")
    low = _LOW[value]
    return zeroshard.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32) if low else zeroshard.MixedPrecision()


def units(model: nn.Module, wrap):
    """Stage 3's units: ``wrap`` as given (class names become the model's classes of
    those names), else the classes ``model._no_split_modules`` names, else
    ``block_units``."""
    names = wrap if wrap is not None else getattr(model, "_no_split_modules", None)
    if wrap is not None and (callable(wrap) and not isinstance(wrap, type)):
        return wrap
    if not names:
        return block_units(model)
    if isinstance(names, (str, type)):
        names = [names]
    wanted = {n for n in names if isinstance(n, str)}
    classes = {c for c in names if isinstance(c, type)}
    classes |= {type(m) for m in model.modules() if type(m).__name__ in wanted}
    missing = wanted - {c.__name__ for c in classes}
    if missing and wrap is not None:
        raise ValueError(f"zeroshard wrap={sorted(missing)}: no module of the model has that class name")
    return classes or block_units(model)
