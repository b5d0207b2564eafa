"""``deepspeed.zero.GatheredParameters`` over zeroshard's engines (``zeroshard.zero``).

``with GatheredParameters(params, modifier_rank=r):`` makes the given
parameters whole on every rank for the block; with ``modifier_rank``, the
values rank r leaves in them become every rank's, fp32 master included.

* Stage 3 (the parameters of an engine's FullyShard): the units holding
  them are held gathered by ``FullyShard.gathered(units=params)`` ([Note:
  gathered blocks] in zero3/gathered.py): read-only in the gather dtype;
  with a modifier in float32, rank r's values written into every rank's fp32
  shards on exit. Inside the block, reach the parameters through their
  modules (``model.embed.weight``): a parameter object taken before it is the
  sharded one, which holds no data.
* Stages 1 and 2 (parameters whole on every rank): with a modifier, rank r's
  values are broadcast into every rank's parameters on exit and the
  optimizer's fp32 master shards are made again from them (DeepSpeed leaves
  these stages' parameters alone, so an edit stays on rank r and the next
  step overwrites it from the master).
* Any other parameter (no live engine trains it): with a modifier, rank r's
  values are broadcast (DeepSpeed does nothing for it).

Nothing is written back when the block raises. ``fwd_module`` (DeepSpeed
registers the parameters as its external parameters) is accepted and not
needed: a unit is gathered whenever its modules run.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from . import live

__all__ = ["GatheredParameters"]


def _as_list(params) -> list:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    out = list(params.values() if isinstance(params, dict) else params)
    for p in out:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"GatheredParameters takes a parameter or an iterable of parameters, got an item of "
                f"type {type(p).__name__}"
            )
    return out


class GatheredParameters:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters(params, modifier_rank=None,
    fwd_module=None, enabled=True)`` (see the module docstring). Collective: every rank
    enters it; edit on ``modifier_rank`` only (a global rank) or on every rank alike."""

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank, self.enabled = modifier_rank, enabled and bool(self.params)
        if modifier_rank is not None and not (
            isinstance(modifier_rank, int) and dist.is_initialized() and 0 <= modifier_rank < dist.get_world_size()
        ):
            raise ValueError(
                f"GatheredParameters(modifier_rank={modifier_rank!r}): expected a rank of the "
                f"world ({dist.get_world_size() if dist.is_initialized() else 'no process group'}) "
                "or None"
            )
        self._stack: Optional[contextlib.ExitStack] = None
        self._whole: list = []  # (optimizer or None, its parameters here)

    def __enter__(self):
        if not self.enabled:
            return self
        sharded, whole = {}, {}
        for p in self.params:
            e = live.holding(p)
            if e is not None and e.runner is not e.module:
                sharded.setdefault(id(e), (e.runner, []))[1].append(p)
            else:
                opt = e.optimizer if e is not None else None
                whole.setdefault(id(opt), (opt, []))[1].append(p)
        self._whole = list(whole.values())
        dtype = torch.float32 if self.modifier_rank is not None else None
        with contextlib.ExitStack() as stack:
            for fs, ps in sharded.values():
                stack.enter_context(fs.gathered(dtype=dtype, units=ps, modifier_rank=self.modifier_rank))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, kind, value, tb):
        if not self.enabled:
            return False
        stack, self._stack = self._stack, None
        try:
            if kind is None and self.modifier_rank is not None:
                self._broadcast_whole()
        finally:
            stack.__exit__(kind, value, tb)
        return False

    @torch.no_grad()
    def _broadcast_whole(self) -> None:
        """Stages 1/2 and plain parameters: rank ``modifier_rank``'s values everywhere, and the
        optimizer's fp32 master made again from them."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        for opt, ps in self._whole:
            if opt is not None:
                opt.wait_params()
            for p in ps if world > 1 else ():
                dist.broadcast(p.data, src=self.modifier_rank)
            if opt is not None:
                opt.source.params_loaded()
