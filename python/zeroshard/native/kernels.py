"""Fused AdamW over flat shards (csrc/adamw.h, csrc/ops.cpp)."""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

import torch

from .ext import _C


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
    outs: Optional[Sequence[torch.Tensor]] = None,
    scale: Optional[torch.Tensor] = None,
    noop: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """AdamW (decoupled weight decay, bias-corrected) on each flat shard, in place.

    ``params[i]`` is fp32 (the master copy, or the parameter itself);
    ``grads[i]`` is fp32, bf16 or fp16, taken as it is (the averaged gradient:
    [Note: one meaning for a gradient]), multiplied only by the 1-element fp32
    tensor ``scale`` if given (a GradScaler's inverse scale).
    ``outs[i]`` (bf16/fp16/fp32), if given, receives the updated parameter,
    rounded to nearest even. ``found_inf`` (1-element int32) is set to 1 if
    any scaled gradient is non-finite; ``noop`` (1-element int32) skips the
    whole call when non-zero. ``step`` counts this update (1 for the first).
    On CUDA nothing here synchronises with the host.
    """
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    fused_adamw_multi_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [hyper],
        [0] * len(params),
        outs=outs,
        scale=scale,
        noop=noop,
        found_inf=found_inf,
    )


_HYPER_KEYS = {"lr", "beta1", "beta2", "eps", "weight_decay", "step"}


def fused_adamw_multi_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hypers: Sequence[Mapping[str, float]],
    hyper_of: Sequence[int],
    *,
    outs: Optional[Sequence[Optional[torch.Tensor]]] = None,
    scale: Optional[torch.Tensor] = None,
    noop: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """:func:`fused_adamw_` over shards with different hyperparameters, in one
    kernel launch on CUDA ([Note: one launch] in csrc/adamw_multi.h) and one
    parallel loop on CPU. Shard ``i`` uses ``hypers[hyper_of[i]]``, a mapping
    with ``lr`` and ``step`` and optionally ``beta1``, ``beta2``, ``eps``,
    ``weight_decay`` (the defaults of :func:`fused_adamw_`).
    ``outs[i]`` may be None (no low-precision output for that shard)."""
    for k, h in enumerate(hypers):
        unknown = sorted(set(h) - _HYPER_KEYS)
        if unknown:
            raise ValueError(
                f"fused_adamw_multi_: hyperparameter set {k} has unknown keys {unknown}; a set takes "
                f"{sorted(_HYPER_KEYS)} (the gradient is taken as it is: a GradScaler's inverse scale "
                "is the scale= tensor)"
            )
    sets: List = [
        _C.AdamWOptions(
            lr=float(h["lr"]),
            beta1=float(h.get("beta1", 0.9)),
            beta2=float(h.get("beta2", 0.999)),
            eps=float(h.get("eps", 1e-8)),
            weight_decay=float(h.get("weight_decay", 0.0)),
            step=int(h["step"]),
        )
        for h in hypers
    ]
    _C.fused_adamw_(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [] if outs is None else list(outs),
        sets,
        [int(k) for k in hyper_of],
        scale,
        noop,
        found_inf,
    )
