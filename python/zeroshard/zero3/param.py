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
In-place initialisation (nn.init's fills, ``model.init_weights()`` after
wrapping) writes the pieces: [Note: initialising sharded parameters] in
zero3/param_init.py.
Its ``.grad`` between backward and step is the optimizer's ``ShardedGrad``
([Note: sharded gradients]); with no ShardedOptimizer, a ``ShardedTensor``
of the same shape whose ``to_local()`` is this rank's gradient piece. A
torch optimizer steps the pieces: [Note: torch optimizers over sharded
parameters] in zero3/piecewise.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from . import param_init, piecewise

aten = torch.ops.aten


# what a user wrote, for the torch ops it reaches us as
_SAID = {
    "aten.detach.default": "detach(), p.data or a module's state_dict()",
    "aten._to_copy.default": ".to(), .float(), .cpu() or module.to()",
    "aten.empty_like.default": "empty_like or a module's to_empty() (call the FullyShard model's)",
}


# ops of torch's optimizers' steps (fused, foreach and single-tensor): one reaching a sharded
# parameter means a torch optimizer was built over a FullyShard model
_STEP_OPS = ("_fused_adam", "_fused_sgd", "_foreach_", "addcdiv", "addcmul", "lerp")


def _refuse(name: str, what: str, shape, func=None, whole: bool = True) -> str:
    said = _SAID.get(what, what)
    head = (
        f"FullyShard parameter '{name}' (shape {tuple(shape)}) is sharded over the ranks: {said} needs its full "
        "data, which no rank holds between steps. "
    )
    if any(op in what for op in _STEP_OPS):
        return head + (
            "A torch optimizer's elementwise ops run on the pieces, but not this one: build "
            "zeroshard.ShardedOptimizer(model.parameters(), ...) over them, which steps each rank's shard "
            "(AdamW by default; optimizer_class=torch.optim.Adam, say, for another torch optimizer)"
        )
    read = (
        "For a state dict call model.state_dict(to=0) on every rank (the FullyShard model, not a module inside "
        "it); this rank's piece is p.to_local()"
    )
    if func is None or not (func._schema.is_mutable or any(r.alias_info is not None for r in func._schema.returns)):
        return head + read
    # a write, a view or an index: most likely initialising it
    if not whole:
        return (
            f"{head}It is a tensor-parallel or an expert parameter: elementwise in-place ops work on it, but "
            "a random fill or a copy would not give each rank its part of the one full tensor; initialise "
            f"module '{param_init.module_of(name)}' before wrapping, or load its values (model.load_state_dict)"
        )
    return (
        f"{head}To initialise it: nn.init's fills (uniform_, normal_, trunc_normal_, constant_, zeros_, ones_, "
        "xavier_*, kaiming_*, eye_) and elementwise in-place ops work on it under torch.no_grad(), applied to "
        "the parameter itself (not to p.data or an index of it). For any other initialisation fill a full "
        "tensor and copy it in, on every rank, seeded alike (each keeps its piece): with torch.no_grad(): "
        "w = torch.empty(p.shape); nn.init.orthogonal_(w); p.copy_(w); or give module "
        f"'{param_init.module_of(name)}' its values before wrapping (a model partly on meta keeps them). "
        "To read it: model.state_dict(to=0) on every rank, or p.to_local() for this rank's piece"
    )


class ShardedTensor(torch.Tensor):
    """A tensor with the full parameter's shape whose data is this rank's 1-D piece
    (``to_local()``): a parameter's gradient, or a torch optimizer's state of it; see
    [Note: sharded parameters] and [Note: torch optimizers over sharded parameters]."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: torch.Size, name: str, start: int = 0, whole: bool = True, group=None):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        # as the parameter's: where the piece begins in the flattened full tensor, whether the
        # pieces are ranges of one full tensor, the ranks holding the pieces
        t.piece, t.param_name, t.start, t.whole, t.group = local, name, start, whole, group
        return t

    @classmethod
    def of(cls, local: torch.Tensor, like: torch.Tensor) -> "ShardedTensor":
        """``local`` as a sharded tensor of ``like``'s layout (a parameter or a sharded tensor)."""
        return cls(local, like.shape, like.param_name, like.start, like.whole, like.group)

    def to_local(self) -> torch.Tensor:
        """This rank's piece: a 1-D tensor (possibly empty)."""
        return self.piece

    def full_tensor(self) -> torch.Tensor:
        """The full tensor, on every rank (collective over the ranks holding the pieces: every
        one calls it), as DTensor's ``full_tensor()``."""
        return piecewise.full_tensor(self, _piece_error)

    def __reduce_ex__(self, proto):
        raise RuntimeError(piecewise.pickling_refused(self.param_name, self.shape))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if piecewise.takes(func, args, kwargs):
            return _on_pieces(func, args, kwargs)
        owner = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ShardedTensor)), None)
        raise RuntimeError(_refuse(getattr(owner, "param_name", "?"), str(func), getattr(owner, "shape", ())))

    def __repr__(self):
        return f"ShardedTensor('{self.param_name}', shape {tuple(self.shape)}, this rank's piece {self.piece.numel()})"


def _piece_error(msg: str) -> RuntimeError:
    return RuntimeError(f"FullyShard: {msg}")


def _on_pieces(func, args, kwargs):
    """``func`` on the pieces ([Note: torch optimizers over sharded parameters])."""
    return piecewise.run(func, args, kwargs, ShardedTensor.of, _piece_error, param_init.note_write)


class ShardedParameter(nn.Parameter):
    """A FullyShard model's parameter between uses; see [Note: sharded parameters]."""

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        shape: torch.Size,
        name: str,
        requires_grad: bool = True,
        start: int = 0,
        whole: bool = True,
        group=None,
    ):
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=requires_grad
        )
        # ``start``: where the piece begins in the flattened full tensor; ``whole``: the pieces
        # are ranges of the one full tensor (False: a tensor-parallel or an expert parameter);
        # ``group``: the ranks holding the pieces (its unit's)
        t.piece, t.param_name, t.start, t.whole, t.group = local, name, start, whole, group
        t.owner_ref = None  # a weak reference to the FullyShard that made it (records.register_owner)
        return t

    def to_local(self) -> torch.Tensor:
        """This rank's piece: a 1-D view (possibly empty) of the unit's fp32 shard."""
        return self.piece

    def place(self, local: torch.Tensor, start: int):
        """The piece moved (the unit was laid out again): ``local``, from ``start`` of the full tensor."""
        self.piece, self.start = local, start
        param_init.forget()

    def __deepcopy__(self, memo):
        raise RuntimeError(_refuse(self.param_name, "copy.deepcopy", self.shape))

    def __reduce_ex__(self, proto):
        raise RuntimeError(_refuse(self.param_name, "pickling (torch.save)", self.shape))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if piecewise.takes(func, args, kwargs):
            return _on_pieces(func, args, kwargs)
        out = param_init.apply(func, args, kwargs, lambda a: isinstance(a, ShardedParameter))
        if out is not NotImplemented:
            return out
        if piecewise.reads_pieces(func):
            return _on_pieces(func, args, kwargs)
        owner = next(
            (a for a in tree_flatten((args, kwargs))[0] if isinstance(a, (ShardedParameter, ShardedTensor))), None
        )
        raise RuntimeError(
            _refuse(
                getattr(owner, "param_name", "?"),
                str(func),
                getattr(owner, "shape", ()),
                func,
                getattr(owner, "whole", True),
            )
        )

    def __repr__(self):
        return (
            f"ShardedParameter('{self.param_name}', shape {tuple(self.shape)}, {self.dtype}, this rank's piece "
            f"{self.piece.numel()} elements; see zeroshard's docs, 'ZeRO-3: FullyShard')"
        )
