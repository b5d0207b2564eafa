"""What a FullyShard model's parameters are between uses.

[Note: sharded parameters] Outside a unit's forward and backward, every
parameter of a FullyShard model (what ``model.parameters()`` and
``named_parameters()`` yield, and what its modules hold) is a
``ShardedParameter``: an ``nn.Parameter`` with the *full* tensor's shape,
``dim()``, ``numel()`` and ``size()`` (and fp32, the shards' dtype, on the
shards' device), holding no data of its own. This rank's piece of it, a 1-D
view of the unit's fp32 shard (possibly empty), is ``p.to_local()``. So code
written for DDP or FSDP2 that inspects parameters after wrapping (weight
decay by ``p.dim() >= 2``, counting with ``p.numel()``, filters on names and
shapes) chooses what it would choose there; ``requires_grad_``, ``.grad``,
``.dtype`` and ``.device`` work as on any parameter. Anything that would
read or write the data (``p.data``, ``detach()``, arithmetic, ``copy_``,
``nn.Module.state_dict()`` of a module inside the model, ``torch.save(p)``)
raises an error naming the parameter and what to call instead: the model's
``state_dict(to=0)`` on every rank, or ``p.to_local()`` for this rank's piece.
Its ``.grad`` between backward and step is the optimizer's ``ShardedGrad``
([Note: sharded gradients]); with no ShardedOptimizer, a ``ShardedTensor``
of the same shape whose ``to_local()`` is this rank's gradient piece.
"""
from __future__ import annotations

import torch
import torch.nn as nn

aten = torch.ops.aten


# what a user wrote, for the torch ops it reaches us as
_SAID = {"aten.detach.default": "detach(), p.data or a module's state_dict()",
         "aten._to_copy.default": ".to(), .float(), .cpu() or module.to()"}


def _refuse(name: str, what: str, shape) -> str:
    what = _SAID.get(what, what)
    return (f"FullyShard parameter '{name}' (shape {tuple(shape)}) is sharded over the ranks: {what} needs its "
            "full data, which no rank holds between steps. For a state dict call model.state_dict(to=0) on "
            "every rank (the FullyShard model, not a module inside it); this rank's piece is p.to_local()")


class ShardedTensor(torch.Tensor):
    """A tensor with the full parameter's shape whose data is this rank's 1-D piece
    (``to_local()``); see [Note: sharded parameters]."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: torch.Size, name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        t.piece, t.param_name = local, name
        return t

    def to_local(self) -> torch.Tensor:
        """This rank's piece: a 1-D view (possibly empty) of the unit's shard."""
        return self.piece

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if func is aten.detach.default and type(first) is ShardedTensor:
            return ShardedTensor(first.piece, first.shape, first.param_name)
        owner = next((a for a in args if isinstance(a, ShardedTensor)), first)
        raise RuntimeError(_refuse(getattr(owner, "param_name", "?"), str(func), getattr(owner, "shape", ())))

    def __repr__(self):
        return f"ShardedTensor('{self.param_name}', shape {tuple(self.shape)}, this rank's piece {self.piece.numel()})"


class ShardedParameter(nn.Parameter):
    """A FullyShard model's parameter between uses; see [Note: sharded parameters]."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: torch.Size, name: str, requires_grad: bool = True):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device,
                                                requires_grad=requires_grad)
        t.piece, t.param_name = local, name
        return t

    def to_local(self) -> torch.Tensor:
        """This rank's piece: a 1-D view (possibly empty) of the unit's fp32 shard."""
        return self.piece

    def __deepcopy__(self, memo):
        raise RuntimeError(_refuse(self.param_name, "copy.deepcopy", self.shape))

    def __reduce_ex__(self, proto):
        raise RuntimeError(_refuse(self.param_name, "pickling (torch.save)", self.shape))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        owner = next((a for a in args if isinstance(a, (ShardedParameter, ShardedTensor))), None)
        raise RuntimeError(_refuse(getattr(owner, "param_name", "?"), str(func), getattr(owner, "shape", ())))

    def __repr__(self):
        return (f"ShardedParameter('{self.param_name}', shape {tuple(self.shape)}, {self.dtype}, this rank's piece "
                f"{self.piece.numel()} elements; see zeroshard's docs, 'ZeRO-3: FullyShard')")
