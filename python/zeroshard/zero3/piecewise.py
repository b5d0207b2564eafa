"""torch's own optimizers over a FullyShard model's parameters, as over FSDP2's.

[Note: torch optimizers over sharded parameters] FSDP2's scripts build
``torch.optim.AdamW(model.parameters(), ...)`` over the sharded parameters and
step it: DTensor runs each elementwise op on the local shards. A
``ShardedParameter`` and a ``ShardedTensor`` ([Note: sharded parameters] in
zero3/param.py) do the same, here:

* Elementwise ops (torch's pointwise ops, ``clone``, the ``_foreach_`` ops and
  the fused optimizer kernels ``_fused_adam(w)_``/``_fused_sgd_``/
  ``_fused_adagrad_``) whose tensors are sharded tensors of one layout (the
  same full shape, the same range of it on this rank), numbers, or tensors of
  one element (a step count, a clipping coefficient) run on the pieces. A
  result is a ``ShardedTensor`` of that layout; an in-place op returns the
  tensor it wrote. So ``p.grad`` (the unit's averaged gradient piece), the
  parameter (a view of the unit's fp32 shard) and the optimizer's state
  (``torch.zeros_like(p, memory_format=torch.preserve_format)``, as every
  torch optimizer builds its state: a ``ShardedTensor`` holding zeros the size
  of this rank's piece) step together, each rank its own piece: the optimizer
  state is sharded as FSDP2's is. (Without ``memory_format=`` a shape-only op
  on a parameter is initialisation's: [Note: initialising sharded
  parameters].) Tensors of two layouts in one op are refused naming both.
* Norms (``torch.linalg.vector_norm``, ``p.grad.norm()``, ``_foreach_norm``) of
  sharded gradients are the full tensors' norms: each a small all-gather over
  the unit's ranks (one per call: ``clip_grad_norm_`` asks per parameter, as
  it does for a tensor subclass), so ``torch.nn.utils.clip_grad_norm_`` returns
  and clips by what it would under FSDP2. A tensor-parallel or expert piece is
  no range of one full tensor: its norm is refused.
* ``torch.amp.GradScaler.unscale_`` reports a non-finite value any rank's
  pieces hold (one small all-gather), so every rank skips the same steps and
  keeps one scale, as FSDP2's ``ShardedGradScaler``.
* A write into a parameter's piece tells its FullyShard (``written``): at the
  next forward the gathered copies are dropped and the gradients count as
  consumed, as after a ShardedOptimizer's step.
* ``optimizer.zero_grad()`` sets ``p.grad`` to None (or zeroes the pieces): the
  next backward writes that parameter's gradient afresh instead of adding to
  the one kept in the unit's gradient shard (zero3/fold.py,
  ``forget_cleared``), as torch starts a None ``.grad`` over.

Anything else on sharded tensors (a reduction other than a norm, a view, an
index, ``item()``) is refused by the caller naming the tensor. Cost: one kernel
launch per op per parameter as in torch's single-tensor loop (the foreach and
fused paths take lists), against one fused launch over every shard for
``ShardedOptimizer``; the state lives in as many tensors as there are
parameters. Saving such an optimizer: ``opt.state_dict()`` holds the pieces
(pickling one is refused naming the fix).
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .. import comm

aten = torch.ops.aten

_FUSED = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
_LISTS = ("_foreach_", "_amp_foreach_") + _FUSED  # ops over lists of tensors
_NORMS = (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar, aten.norm.Scalar, aten.norm.ScalarOpt_dim)
_LIKE = (aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default)


def is_sharded(a: Any) -> bool:
    """A ShardedParameter or a ShardedTensor (both carry ``piece`` and ``param_name``)."""
    return isinstance(a, torch.Tensor) and hasattr(a, "piece") and hasattr(a, "param_name")


def layout(a) -> Tuple[tuple, int, int]:
    """What two sharded tensors must share to combine piece by piece."""
    return tuple(a.shape), a.start, a.piece.numel()


def takes(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is this module's to run: an elementwise op over sharded tensors, or
    an optimizer's state made like a parameter (``memory_format=torch.preserve_format``)."""
    name = func.__name__
    if func in _LIKE:
        return kwargs.get("memory_format") is torch.preserve_format or not _is_param(args[0])
    if func in _NORMS:
        return True
    if name.startswith(_LISTS):
        return True
    if torch.Tag.pointwise not in func.tags and func not in (aten.clone.default, aten.detach.default):
        return False
    # a pointwise op over parameters alone is initialisation's (param_init), unless it reads a
    # ShardedTensor (a gradient or an optimizer's state)
    return any(is_sharded(a) and not _is_param(a) for a in tree_flatten((args, kwargs))[0])


def reads_pieces(func) -> bool:
    """An elementwise op reading parameters whose whole values initialisation does not know
    (``grad.add(param)`` of L2 weight decay under ``torch.no_grad()``): run on the pieces."""
    return not torch.is_grad_enabled() and (torch.Tag.pointwise in func.tags or func is aten.clone.default)


def _is_param(a) -> bool:
    return isinstance(a, torch.nn.Parameter)


def run(func, args: tuple, kwargs: dict, make: Callable, refuse: Callable[[str], RuntimeError], written: Callable):
    """``func`` on the pieces ([Note: torch optimizers over sharded parameters]). ``make(piece,
    like)``: a ShardedTensor of ``like``'s layout holding ``piece``; ``refuse(msg)``: the error
    naming the tensor; ``written(p)``: parameter ``p``'s piece was written."""
    if func in _NORMS:
        return _norms(func, args, kwargs, refuse)
    if func is aten.detach.default:
        return make(args[0].piece, args[0])
    foreach = func.__name__.startswith(_LISTS)
    _check(func, args, kwargs, foreach, refuse)
    if foreach:  # (each position of the lists its own layout)
        likes = _likes(args, kwargs)
        lists = lambda a: [_piece_of(x, likes[i]) for i, x in enumerate(a)]  # noqa: E731
        pieces_args = [lists(a) if isinstance(a, (list, tuple)) else _piece_of(a, None) for a in args]
        pieces_kwargs = {k: lists(a) if isinstance(a, (list, tuple)) else a for k, a in kwargs.items()}
    else:
        like = next(a for a in tree_flatten((args, kwargs))[0] if is_sharded(a))
        pieces_args, pieces_kwargs = tree_map(lambda a: _piece_of(a, like), (args, kwargs))
    out = func(*pieces_args, **pieces_kwargs)
    if func is aten._amp_foreach_non_finite_check_and_unscale_.default:  # GradScaler.unscale_
        _agree_found_inf(args[1], [x for x in likes if x is not None])
    wrote = [v for _, v in written_arguments(func, args, kwargs)]
    for v in wrote:
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if _is_param(t):
                written(t)
    if func.__name__.endswith("_") or func._schema.is_mutable:  # the tensor(s) it wrote (None: a void op)
        return None if out is None else (wrote[0] if wrote else out)
    if foreach:
        return [make(o, likes[i]) for i, o in enumerate(out)]
    return make(out, like)


def _agree_found_inf(found_inf: torch.Tensor, grads: list) -> None:
    """``GradScaler.unscale_``'s non-finite flag is any rank's (each checked its own pieces), so
    every rank skips the same steps and keeps one scale, as FSDP2's ShardedGradScaler does."""
    groups = {id(g.group): g.group for g in grads}
    for group in groups.values():
        found_inf.copy_(everyones(found_inf.reshape(1).float(), group, "GradScaler's non-finite check").amax())


def written_arguments(func, args, kwargs) -> List[Tuple[Any, Any]]:
    """(schema argument, value) of each argument ``func`` writes (in place or as ``out=``)."""
    out = []
    for k, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append((a, args[k] if k < len(args) else kwargs.get(a.name)))
    return out


def _positions(args, kwargs) -> List[list]:
    """A foreach op's tensors at each position of its lists."""
    lists = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (list, tuple))]
    n = max((len(x) for x in lists), default=0)
    return [[x[i] for x in lists if i < len(x)] for i in range(n)]


def _likes(args, kwargs) -> list:
    """A foreach op's layout at each position of its lists: the first sharded tensor there."""
    return [next((t for t in items if is_sharded(t)), None) for items in _positions(args, kwargs)]


def _piece_of(a, like):
    """What ``a`` is in an op on the pieces: a sharded tensor's piece, a plain tensor of
    ``like``'s full shape its range of ``like``'s piece, anything else itself."""
    if is_sharded(a):
        return a.piece
    if like is not None and isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape == like.shape:
        return a.reshape(-1)[like.start : like.start + like.piece.numel()]
    return a


def _check(func, args, kwargs, foreach: bool, refuse):
    """Every sharded tensor of one op (or of one position of a foreach op's lists) has one
    layout; plain tensors hold one element (a foreach op's scalars may be a list)."""
    if foreach:
        for items in _positions(args, kwargs):
            _same_layout(func, items, refuse)
        return
    _same_layout(func, tree_flatten((args, kwargs))[0], refuse)


def _same_layout(func, items, refuse):
    sharded = [a for a in items if is_sharded(a)]
    if not sharded:
        return
    first = sharded[0]
    for a in sharded[1:]:
        if layout(a) != layout(first):
            raise refuse(
                f"{func} combines sharded tensors '{first.param_name}' (shape {tuple(first.shape)}, this rank's "
                f"range {first.start}+{first.piece.numel()}) and '{a.param_name}' (shape {tuple(a.shape)}, range "
                f"{a.start}+{a.piece.numel()}), whose pieces are not the same part of one tensor (an optimizer's "
                "state from before the model was laid out again, or two parameters' tensors): build the optimizer "
                "after freezing or unfreezing parameters"
            )
    for a in items:
        if isinstance(a, torch.Tensor) and not is_sharded(a) and a.numel() != 1 and a.shape != first.shape:
            raise refuse(
                f"{func} combines sharded tensor '{first.param_name}' (shape {tuple(first.shape)}) with a plain "
                f"tensor of shape {tuple(a.shape)}: a sharded tensor's elementwise ops take numbers, tensors of one "
                "element, tensors of its full shape (their range of the piece), or sharded tensors of its own "
                "layout (its gradient, its optimizer state)"
            )


def _norms(func, args, kwargs, refuse) -> Any:
    """The full tensors' norms of sharded tensors (each rank's pieces' norms combined over the
    ranks holding them: one all-gather per call)."""
    if func is aten._foreach_norm.Scalar:
        tensors, ord_ = args[0], (args[1] if len(args) > 1 else kwargs.get("ord", 2))
        dtype = kwargs.get("dtype")
    else:
        tensors, ord_ = [args[0]], (args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2)))
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        if dim not in (None, [], ()):
            raise refuse(f"a norm over dimensions {dim} of sharded tensor '{args[0].param_name}'")
        dtype = kwargs.get("dtype")
    ord_ = 2.0 if ord_ is None else float(ord_)
    for t in tensors:
        if not is_sharded(t):
            raise refuse(f"{func} over sharded and plain tensors together")
        if not t.whole:
            raise refuse(
                f"the norm of tensor-parallel or expert tensor '{t.param_name}': its pieces are no ranges of one "
                "full tensor. Use zeroshard.ShardedOptimizer(model.parameters(), ...) and its clip_grad_norm_"
            )
    if not (ord_ == math.inf or ord_ > 0):
        raise refuse(f"a norm of order {ord_} of sharded tensor '{tensors[0].param_name}' (orders > 0 and inf work)")
    out = _global_norms(tensors, ord_)
    outs = [o.to(dtype or t.dtype) for o, t in zip(out, tensors)]
    return outs if func is aten._foreach_norm.Scalar else outs[0]


def _global_norms(tensors: List[torch.Tensor], ord_: float) -> List[torch.Tensor]:
    """Each tensor's full norm: the pieces' partial sums (or maxima) over this rank, combined
    over the tensors' group (one collective for the lot)."""
    groups = {id(t.group): t.group for t in tensors}
    if len(groups) > 1:  # (units over different ranks: one collective per group, in one order)
        parts = [_global_norms([t for t in tensors if t.group is g], ord_) for g in groups.values()]
        it = {id(g): iter(p) for g, p in zip(groups.values(), parts)}
        return [next(it[id(t.group)]) for t in tensors]
    group = next(iter(groups.values()))
    vals = torch.stack([_local_part(t.piece, ord_) for t in tensors]).reshape(-1)
    everyone = everyones(vals, group, "norms of sharded tensors")
    total = everyone.amax(0) if ord_ == math.inf else everyone.sum(0).pow(1.0 / ord_)
    return list(total.unbind(0))


def everyones(vals: torch.Tensor, group, what: str) -> torch.Tensor:
    """``vals`` of every rank of ``group``, a row each (an all-gather: these are no gradient
    reductions, which run on core/reduction.py's pipeline)."""
    world = 1 if group is None else torch.distributed.get_world_size(group)
    out = torch.empty(world * vals.numel(), dtype=vals.dtype, device=vals.device)
    comm.all_gather(vals, out, group=group, what=what).wait()
    return out.view(world, -1)


def _local_part(piece: torch.Tensor, ord_: float) -> torch.Tensor:
    """This rank's part of a norm: the piece's largest magnitude (inf) or its sum of |x|^ord."""
    x = piece.detach().float().abs()
    if ord_ == math.inf:
        return x.max() if x.numel() else torch.zeros((), device=x.device)
    return x.pow(ord_).sum()


def full_tensor(t, refuse) -> torch.Tensor:
    """Sharded tensor ``t`` whole on every rank: the pieces in rank order (a parameter's range of
    its unit's flat buffer, cut in equal chunks over ``t.group``'s ranks in order; collective)."""
    if not t.whole:
        raise refuse(f"full_tensor() of tensor-parallel or expert tensor '{t.param_name}': no ranges of one tensor")
    what = f"full_tensor() of sharded tensor '{t.param_name}'"
    n = torch.tensor([float(t.piece.numel())], dtype=torch.float64, device=t.piece.device)
    bounds = [0]
    for k in everyones(n, t.group, what).reshape(-1).tolist():
        bounds.append(bounds[-1] + int(k))
    out = torch.empty(bounds[-1], dtype=t.piece.dtype, device=t.piece.device)
    comm.all_gather(t.piece.contiguous(), out, group=t.group, bounds=bounds, what=what).wait()
    return out.view(t.shape)


def pickling_refused(name: str, shape) -> str:
    """The error for ``torch.save`` of a sharded tensor (an optimizer's state)."""
    return (
        f"sharded tensor '{name}' (shape {tuple(shape)}) holds only this rank's piece: it cannot be pickled "
        "(torch.save of a torch optimizer's state_dict() over a FullyShard model). Save with "
        "zeroshard.checkpoint.dcp_state_dict / zeroshard.save_checkpoint over a zeroshard.ShardedOptimizer("
        "model.parameters(), optimizer_class=...), which checkpoints the sharded state in any world size"
    )
