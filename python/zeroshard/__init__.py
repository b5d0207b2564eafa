"""zeroshard: ZeRO sharding for PyTorch with a C++/CUDA core.

Front doors: :class:`ShardedOptimizer` (ZeRO-1/2, replaces DDP + AdamW; with
FullyShard parameters, the ZeRO-3 optimizer) and :class:`FullyShard` (ZeRO-3
module wrapper, with :class:`MixedPrecision`). Underneath: the flat-buffer
layout (:func:`compute_layout`), the fused AdamW kernel (:func:`fused_adamw_`)
and flat-buffer collectives (:func:`reduce_scatter`, :func:`all_gather`,
:func:`all_reduce`). Checkpoints that resume at any world size and stage:
:func:`save_checkpoint`, :func:`load_checkpoint`, :func:`export_full_state_dict`, and
:func:`resume` at the start of a script; :func:`load_pretrained` reads published
safetensors weights straight into shards; :func:`full_tensors` streams a sharded model's
whole tensors, one unit at a time (for an inference engine's ``load_weights``);
:func:`init_distributed` creates the
process group so that torchrun's restarts come up.
When collectives hang or fail: :func:`flight_record`, :func:`set_timeout`,
:class:`CollectiveTimeout`, :class:`CollectiveError`, :class:`CollectiveMismatch`.
DeepSpeed scripts and configs: :func:`initialize`, and ``zero.Init`` (DeepSpeed's
``zero.Init``: a model sharded as it is built), imported on first use.
"""

from __future__ import annotations

from .native.ext import _C
from .comm.flight import CollectiveError, flight_record
from .comm.watchdog import CollectiveMismatch, CollectiveTimeout, set_timeout
from .checkpoint import (
    CheckpointError,
    export_full_state_dict,
    load_checkpoint,
    load_pretrained,
    resume,
    save_checkpoint,
)
from .comm.launch import init_distributed
from .comm import CommHandle, all_gather, all_gather_object, all_reduce, reduce_scatter
from .zero3.fully_shard import FullyShard, MixedPrecision, register_forward_method
from .zero3.stream import full_tensors
from .zero3.module_api import FSDPModule, fully_shard, register_fsdp_forward_method
from .native.kernels import fused_adamw_, fused_adamw_multi_
from .native.layout import Layout, compute_layout
from .optim.sharded import ShardedOptimizer
from .comm.mesh import Sharding
from .offload import Offload

__version__ = "0.1.0"


def __getattr__(name: str):
    """``zeroshard.initialize`` and ``zeroshard.zero`` (DeepSpeed's front door and its
    ``deepspeed.zero``, docs/deepspeed.md) are imported on first use, so ``import zeroshard``
    does not load the integration."""
    if name == "initialize":
        from .integrations.deepspeed import initialize

        return initialize
    if name == "zero":
        from .integrations.deepspeed import zero

        return zero
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")


def build_info() -> dict:
    """How the compiled core was built, and the torch it runs with now.

    Keys: ``cuda`` (bool: CUDA kernels compiled in), ``cuda_archs``
    (e.g. ``"80,90"``), ``cuda_compiler_version``, ``torch_version`` (built
    against), ``torch_runtime_version`` (imported now), ``torch_cuda``
    (CUDA version of the running torch or None), ``cxx_standard``.
    """
    import torch

    info = dict(_C.build_info())
    info["torch_runtime_version"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["version"] = __version__
    return info


__all__ = [
    "CheckpointError",
    "export_full_state_dict",
    "load_checkpoint",
    "load_pretrained",
    "save_checkpoint",
    "CommHandle",
    "Layout",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "build_info",
    "compute_layout",
    "FullyShard",
    "MixedPrecision",
    "fused_adamw_",
    "fused_adamw_multi_",
    "reduce_scatter",
    "ShardedOptimizer",
    "flight_record",
    "CollectiveError",
    "CollectiveTimeout",
    "CollectiveMismatch",
    "set_timeout",
    "initialize",
    "zero",
    "init_distributed",
    "resume",
    "register_forward_method",
    "fully_shard",
    "FSDPModule",
    "register_fsdp_forward_method",
    "full_tensors",
    "Offload",
    "Sharding",
]
