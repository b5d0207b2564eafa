"""Fused AdamW over flat shards (csrc/adamw.h, csrc/ops.cpp)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._ext import _C


def fused_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    step: int,
    grad_scale: float = 1.0,
    outs: Optional[Sequence[torch.Tensor]] = None,
    scale: Optional[torch.Tensor] = None,
    noop: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """AdamW (decoupled weight decay, bias-corrected) on each flat shard, in place.

    ``params[i]`` is fp32 (the master copy, or the parameter itself);
    ``grads[i]`` is fp32, bf16 or fp16 and is multiplied by ``grad_scale``
    (and by the 1-element fp32 tensor ``scale`` if given) before use.
    ``outs[i]`` (bf16/fp16/fp32), if given, receives the updated parameter,
    rounded to nearest even. ``found_inf`` (1-element int32) is set to 1 if
    any scaled gradient is non-finite; ``noop`` (1-element int32) skips the
    whole call when non-zero. ``step`` counts this update (1 for the first).
    On CUDA nothing here synchronises with the host.
    """
    _C.fused_adamw_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                    None if outs is None else list(outs), float(lr), float(beta1), float(beta2),
                    float(eps), float(weight_decay), int(step), float(grad_scale), scale, noop,
                    found_inf)
