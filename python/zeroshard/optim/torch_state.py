"""A torch optimizer's state dict over a FullyShard model's parameters.

[Note: a torch optimizer's state dict over sharded parameters] A torch optimizer
stepping sharded parameters keeps its state as pieces ([Note: torch optimizers
over sharded parameters] in zero3/piecewise.py): ``opt.state[p]["exp_avg"]`` is a
``ShardedTensor``. Its state dict is what the FullyShard model's own is, full
tensors, so the habits of DDP scripts and torch's helpers work on it:

* ``opt.state_dict()`` holds each sharded state tensor whole (gathered: a
  collective, every rank calls it, as ``model.state_dict()``), so
  ``torch.save(opt.state_dict())`` on rank 0, ``copy.deepcopy`` and
  ``torch.distributed.checkpoint.state_dict``'s ``get_optimizer_state_dict``
  (full or not) give what they give under DDP; cost: the whole state in memory
  on every rank while it is built (``zeroshard.save_checkpoint`` over a
  ``ShardedOptimizer`` writes each rank's shard instead).
* ``opt.load_state_dict(sd)`` with those full tensors (or
  ``set_optimizer_state_dict``) keeps each rank's piece.

The hooks doing it are torch's own (``register_state_dict_post_hook`` and
``register_load_state_dict_post_hook``), registered on each torch optimizer over
sharded parameters at its first ``step()`` (torch's global step pre-hook; its
helpers take a step of lr 0 to create the state before they read or load it).
State loaded before that first step is made pieces then.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..zero3.param import ShardedParameter, ShardedTensor

# the torch optimizers seen stepping (their hooks are registered once): weak, so an
# optimizer's entry goes with it
_SEEN: "weakref.WeakSet" = weakref.WeakSet()


def _params(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def _on_step(opt, args, kwargs):
    """torch's global step pre-hook: a torch optimizer over sharded parameters, at its first step."""
    if opt in _SEEN or type(opt).__module__.startswith("zeroshard."):
        return
    _SEEN.add(opt)
    if not any(isinstance(p, ShardedParameter) for p in _params(opt)):
        return
    opt.register_state_dict_post_hook(_full_state)
    opt.register_load_state_dict_post_hook(_pieces_kept)
    _pieces_kept(opt)


def _full_state(opt, sd: dict) -> dict:
    """``opt.state_dict()``'s sharded state tensors gathered whole (new dicts: the packed
    state shares the optimizer's own per-parameter dicts)."""
    sd = dict(sd)
    sd["state"] = {
        k: {a: v.full_tensor() if isinstance(v, ShardedTensor) and v.whole else v for a, v in entry.items()}
        for k, entry in sorted(sd["state"].items(), key=lambda kv: str(kv[0]))
    }
    return sd


@torch.no_grad()
def _pieces_kept(opt) -> None:
    """Plain state tensors of a sharded parameter's full shape (loaded) become its pieces."""
    for p in _params(opt):
        entry = opt.state.get(p) if isinstance(p, ShardedParameter) and p.whole else None
        for a, v in (entry or {}).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, ShardedTensor) and v.shape == p.shape and v.dim():
                piece = v.reshape(-1)[p.start : p.start + p.piece.numel()]
                entry[a] = ShardedTensor.of(piece.to(p.piece.device, p.piece.dtype).clone(), p)


_HOOK = register_optimizer_step_pre_hook(_on_step)
