"""What ``p.grad`` holds after a backward, and the per-step gradient statistics.

[Note: sharded gradients] After a backward outside ``no_sync()``, the
averaged gradient of every parameter lives sharded over the ranks, in the
shard source's buffers (see [Note: shard sources] in core/source.py): no rank
holds a parameter's whole averaged gradient. So that code written for DDP
cannot read a wrong one, ``p.grad`` of every trainable parameter is then a
``ShardedGrad``: a tensor with the gradient's shape and dtype but no storage
of its own, whose operations run on the shards:

* ``torch.linalg.vector_norm`` / ``p.grad.norm()`` / ``torch._foreach_norm``
  (any order torch takes: 2 and inf from the statistics, others with one
  small collective when first asked for in a step): the global norm of the
  averaged gradient, so ``torch.nn.utils.clip_grad_norm_`` (``foreach`` or
  not) returns and clips by exactly what it would under DDP;
* ``mul_`` / ``div_`` by a number or a one-element tensor, ``zero_``:
  applied to this rank's pieces (clip_grad_norm_'s scaling is one);
* ``torch.amp.GradScaler.unscale_`` (its ``_amp_foreach_non_finite_check_
  and_unscale_``): unscales the pieces and reports a non-finite value found
  on *any* rank, so every rank skips the same steps and keeps the same scale;
* anything else raises an error naming the parameter and what does work.

The statistics behind this (each parameter's squared 2-norm, summed over
the ranks) are taken once per step, at the end of the backward, with one
small all-reduce; the engine reads the non-finite check and its own
``clip_grad_norm_`` from them too, so neither needs a pass of its own. The
all-reduce is waited for only by what reads them (or by the end of the
step): a script that does not clip steps while it is in flight. A piece
whose source copied it to host memory during the backward (ZeRO-3 offload)
comes with its squared norm taken on the device before the copy
(``Segment.sumsq_before_copy``), so the end of the backward reads no host
memory for it.

Before the next backward accumulates, each placeholder is swapped back for
what the source keeps in ``p.grad`` (ZeRO-1: a view of its gradient buffer;
ZeRO-2: None), by a hook that runs before autograd accumulates the first
gradient. ``opt.zero_grad()`` and ``model.zero_grad()`` both clear them. The
hooks exist only while placeholders are placed: a loop that zeroes its
gradients after each step runs none of them.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional

import torch

from .. import comm
from .slots import Slots
from ..core.hooks import remove_hooks, weak_hook
from ..core.segments import squared_norms
from . import norms
from .grad_reads import full_gradient, read, writes

aten = torch.ops.aten


class ShardedGrad(torch.Tensor):
    """``p.grad`` after a backward; see [Note: sharded gradients]."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, index: int, grads: "ReducedGrads", dtype=None, device=None):
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=dtype or like.dtype, device=device or like.device
        )
        t.index, t.grads = index, grads
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
        handler = _HANDLERS.get(func)
        if handler is not None and isinstance(first, ShardedGrad):
            return handler(first.grads, *args, **(kwargs or {}))
        if not writes(func):  # a read: on the full gradients ([Note: gradient reads])
            return read(func, args, kwargs, ShardedGrad)
        owner = (
            first if isinstance(first, ShardedGrad) else next((a for a in args if isinstance(a, ShardedGrad)), first)
        )
        raise RuntimeError(unsupported(owner.grads, owner.index, str(func)))

    def full_tensor(self) -> torch.Tensor:
        """The full averaged gradient, as DDP's ``p.grad`` holds it (collective: every rank
        calls it; see [Note: gradient reads] in optim/grad_reads.py)."""
        return full_gradient(self.grads, self.index).to(self.device, self.dtype)

    def __repr__(self):
        return (
            f"ShardedGrad(parameter {self.index}, shape {tuple(self.shape)}, {self.dtype}: sharded over the "
            "ranks; p.grad.full_tensor() on every rank gathers it, see docs/converting-ddp.md)"
        )


def _norm(grads, g, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dim is not None:
        raise RuntimeError(unsupported(grads, g.index, "a norm over some dimensions"))
    return grads.norm_everywhere(g.index, float(ord)).to(dtype or g.dtype)


def _foreach_norm(grads, gs, ord=2, dtype=None):
    """Per gradient, as torch's clip_grad_norm_ asks before it sums their squares (it
    takes them one by one, ``_norm``, where foreach is off): a parameter of a param group
    over its own ranks answers for its place in every such group ([Note: param groups
    over their own ranks]), so the total counts every expert once and is the same on
    every rank (``p.grad.full_tensor()`` is this rank's expert's gradient alone)."""
    return [grads.norm_everywhere(g.index, float(ord)).to(dtype or g.dtype) for g in gs]


def _scale(grads, g, factor):
    grads.scale_([g.index], factor)
    return g


def _divide(grads, g, factor):
    grads.scale_([g.index], 1.0 / factor)
    return g


def _foreach_scale(grads, gs, factor):
    grads.scale_([g.index for g in gs], factor)


def _zero(grads, g):
    grads.scale_([g.index], 0.0)
    return g


def _unscale(grads, gs, found_inf, inv_scale):
    grads.unscale_([g.index for g in gs], found_inf, inv_scale)


def _detach(grads, g):
    return ShardedGrad(g, g.index, grads)


def _convert(grads, g, *, dtype=None, device=None, **kwargs):
    """``.to()``/``.float()`` (as ``model.float()`` applies to gradients): the same
    sharded gradient, seen with the new dtype and device."""
    return ShardedGrad(g, g.index, grads, dtype=dtype, device=device)


def _clamp(grads, g, min=None, max=None):
    grads.clamp_([g.index], min, max)
    return g


_HANDLERS: Dict[object, Callable] = {
    aten.linalg_vector_norm.default: _norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.mul_.Tensor: _scale,
    aten.mul_.Scalar: _scale,
    aten.div_.Tensor: _divide,
    aten.div_.Scalar: _divide,
    aten._foreach_mul_.Tensor: _foreach_scale,
    aten._foreach_mul_.Scalar: _foreach_scale,
    aten.zero_.default: _zero,
    aten._foreach_zero_.default: lambda grads, gs: grads.scale_([g.index for g in gs], 0.0),
    aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale,
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten._to_copy.default: _convert,
    # torch.nn.utils.clip_grad_value_ (per gradient, or foreach=True)
    aten.clamp_.default: _clamp,
    aten.clamp_.Tensor: _clamp,
    aten.clamp_min_.default: lambda grads, g, v: _clamp(grads, g, v, None),
    aten.clamp_max_.default: lambda grads, g, v: _clamp(grads, g, None, v),
    aten._foreach_clamp_min_.Scalar: lambda grads, gs, v: grads.clamp_([g.index for g in gs], v, None),
    aten._foreach_clamp_max_.Scalar: lambda grads, gs, v: grads.clamp_([g.index for g in gs], None, v),
}


def scaled_grad(src: torch.Tensor, scale: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One transient fp32 copy of the averaged gradient ``src`` on ``device`` (times the
    clipping coefficient ``scale``), made in one pass."""
    if src.dtype == torch.float32 and src.device == device:
        return src * scale.to(device) if scale is not None else src.clone()
    g = src.to(device, torch.float32)
    return g.mul_(scale) if scale is not None else g


def _over_tp(tp, stats: torch.Tensor, source) -> None:
    """Statistics summed over dp, then over tp (tensor-parallel parameters)."""
    if tp is not None and tp.size > 1:
        comm.all_reduce(stats, group=tp.group, what="gradient statistics over tp").wait()
        source.comm_elements["all_reduce"] += stats.numel()


class ReducedGrads(norms.NormQueries):
    """The engine's view of the reduced gradient shards: per-parameter pieces,
    the per-step statistics and the ``p.grad`` placeholders; see [Note: sharded
    gradients]."""

    def __init__(self, params: List[torch.Tensor], trainable: List[int], source, err: Callable[[str], str]):
        self.params, self.trainable, self.source, self.err = params, trainable, source, err
        # param index -> [(segment, start, stop)]: this rank's pieces of its reduced gradient
        self.pieces: Dict[int, list] = {i: [] for i in trainable}
        for seg in source.segments:
            for i, a, b, _ in seg.pieces:
                self.pieces[i].append((seg, a, b))
        # the same pieces in one list, and their parameter indices (fixed: built once)
        self.flat = [(seg, a, b) for pieces in self.pieces.values() for seg, a, b in pieces]
        self._segments = list({id(seg): seg for seg, _, _ in self.flat}.values())
        self.flat_index = torch.tensor(
            [i for i, pieces in self.pieces.items() for _ in pieces], dtype=torch.long, device=source.device
        )
        self.placeholders = {i: ShardedGrad(params[i], i, self) for i in trainable}
        self.kept: Dict[int, Optional[torch.Tensor]] = {}  # p.grad the source had before the placeholder
        self.placed: Dict[int, Optional[torch.Tensor]] = {}  # what backward_done put in p.grad
        self.used: List[bool] = [False] * len(params)  # got a gradient on some rank (this step)
        self.seen: List[bool] = [False] * len(params)  # ... or, at its place, in another ep group
        # per statistics slot (optim/slots.py: a parameter's, or one per group of its ranks): squared
        # 2-norm of the averaged gradient
        self.slots = Slots(source.param_colors(), len(params), source.device)
        # tensor-parallel: statistics summed over tp too, a replicated parameter counted on tp rank 0
        self.tp = source.tensor_parallel()  # ([Note: tensor-parallel parameters])
        self._uncounted = torch.tensor(self.tp.uncounted() if self.tp else [], dtype=torch.long, device=source.device)
        self._sq: Optional[torch.Tensor] = None
        self.stale: set = set()  # parameters clamped since: their squared norms are taken again when read
        self.coef: Optional[torch.Tensor] = None  # the engine's clip coefficient, folded into the step
        self.maxabs: Optional[torch.Tensor] = None  # per parameter: inf-norm, taken when first asked for
        self.pnorms: Dict[float, torch.Tensor] = {}  # per order (not 2 nor inf): per parameter, when asked for
        self._inflight = None  # the statistics' all-reduce, until settle() (see backward_done)
        self._trainable = set(trainable)
        self._subsets: Dict[tuple, torch.Tensor] = {}  # flat_index of a subset of the pieces (_index)
        self._trainable_index = torch.tensor(
            self.slots.own_of(sorted(trainable)), dtype=torch.long, device=source.device
        )
        # on the trainable leaves, kept from one backward to the next (registering and removing
        # one per parameter every step cost more host time than the no-op call a loop that zeroes
        # its gradients after each step makes); removed with this object
        self.hooks: List[torch.utils.hooks.RemovableHandle] = []
        weakref.finalize(self, remove_hooks, self.hooks)
        self._leaves = [i for i in trainable if params[i].grad_fn is None]
        self._hooked: List[int] = []  # the leaves self.hooks are on
        # what the script set in p.grad, taken ([Note: gradients set by the script] in optim/hand_grads.py)
        self.by_hand = False  # gradients assigned with no backward since zero_grad: a step steps
        self.uncounted_hand = None  # parameters whose gradient no statistic counts (set to None), or None
        source.listeners.append(weak_hook(self.backward_done))

    # ----------------------------------------------------------- statistics
    def local_values(self, fn, taken: Optional[list] = None) -> torch.Tensor:
        """``fn`` of this rank's pieces (a list of them on one device -> a 1-D fp32
        tensor, a value each), one value per parameter (0 where none). ``taken``: per
        piece, its value already taken (None: not), used instead of reading the piece."""
        out = torch.zeros(len(self.params), dtype=torch.float32, device=self.source.device)
        if not self.flat:
            return out
        views = [seg.grad[a:b] for seg, a, b in self.flat]
        if taken is None and all(v.device == out.device for v in views):
            out.index_add_(0, self.flat_index, fn(views))
            return out
        taken = taken or [None] * len(views)
        ks = [k for k, t in enumerate(taken) if t is not None]
        if ks:
            out.index_add_(0, self.piece_index(ks), torch.stack([taken[k] for k in ks]).to(out.device))
        for here in (True, False):  # gradient shards in host memory: their values in one copy
            ks = [k for k, v in enumerate(views) if (v.device == out.device) == here and taken[k] is None]
            if ks:
                vals = fn([views[k] for k in ks]).to(out.device)
                out.index_add_(0, self.piece_index(ks), vals)
        return out

    @torch.no_grad()
    def backward_done(self):
        """A backward outside no_sync() finished: take the statistics (one
        all-reduce of two floats per parameter: its squared norm, and whether it
        got a gradient) and put the placeholders into ``p.grad`` (None for a
        parameter no rank gave a gradient, as under DDP).

        When every trainable parameter got a gradient on this rank, each of them
        got one "on some rank" whatever the others say, so nothing here needs the
        all-reduce's result: it stays in flight, and whatever reads the norms
        (clipping, GradScaler, the non-finite check) or ends the step waits for it
        (settle()). The engine's update runs meanwhile: the latency of a small
        collective off every step's critical path."""
        self.settle()
        self.stale, self.coef, self.pnorms = set(), None, {}
        self.by_hand, self.uncounted_hand = False, None
        n, S = len(self.params), self.slots.size
        stats = torch.zeros(2 * S, dtype=torch.float32, device=self.source.device)
        stats[:S] = self.slots.spread(self._local_sumsq(after_backward=True))
        groups = self.source.groups
        arrived = self.source.arrived()
        known = self._trainable.issubset(arrived)
        if known and len(arrived) == len(self.trainable):
            stats[S:].index_fill_(0, self._trainable_index, 1.0)  # (the usual step: no host-to-device copy)
        elif arrived:
            stats[S:].index_fill_(0, torch.tensor(self.slots.own_of(arrived), device=stats.device), 1.0)
        self._inflight = (comm.all_reduce(stats, group=groups.every, what="gradient statistics"), stats, known)
        self.source.comm_elements["all_reduce"] += stats.numel()
        self.maxabs = None
        if known:
            self.used = self.seen = [i in self._trainable for i in range(n)]
        else:
            self.settle()
        for i in self.trainable:
            p = self.params[i]
            if i not in self.placed or p.grad is not self.placed[i]:  # (ZeRO-3: backward re-set it)
                self.kept[i] = self.source.resting_grad(i, p.grad)
            # (a param group over its own ranks: a p.grad wherever some group's parameter here got a
            # gradient, so torch's clip_grad_norm_ sums the same parameters on every rank; it steps
            # where its own did: ``used``)
            self.placed[i] = self.placeholders[i] if self.seen[i] else None
            p.grad = self.placed[i]
        self.hook_leaves()

    def hook_leaves(self):
        """The hook that gives ``p.grad`` back before the next backward accumulates, on the
        leaves that require grad now: one frozen since construction takes no gradient (and
        torch refuses a hook on it); one unfrozen again needs its hook back."""
        want = [i for i in self._leaves if self.params[i].requires_grad]
        if want != self._hooked:
            remove_hooks(self.hooks)
            hook = weak_hook(self._before_accumulate)
            self.hooks.extend(self.params[i].register_hook(hook) for i in want)
            self._hooked = want

    def settle(self):
        """Wait for the statistics' all-reduce, if one is in flight. ``used`` is then
        read from what every rank said, unless backward_done knew it already (every
        trainable parameter got a gradient here): no host sync on CUDA then."""
        if self._inflight is not None:
            handle, stats, known = self._inflight
            self._inflight = None
            handle.wait()
            _over_tp(self.tp, stats, self.source)
            S = self.slots.size
            self._sq = stats[:S]
            if not known:  # read on the host: which parameters step, and which have a p.grad
                self.used = (self.slots.own(stats[S:]) > 0).tolist()
                self.seen = self.used if self.slots.identity else (self.slots.summed(stats[S:]) > 0).tolist()

    @property
    def slot_sumsq(self) -> torch.Tensor:
        """Every slot's squared norm (every distinct parameter's, once: optim/slots.py)."""
        self.settle()
        if self.stale:
            self._retake()
        return self._sq

    @property
    def sumsq(self) -> torch.Tensor:
        """Per parameter: the squared norm of this rank's parameter there (a view of the
        slots without param groups over their own ranks; else a copy: write through
        ``slot_sumsq``)."""
        return self.slots.own(self.slot_sumsq)

    def piece_index(self, ks: List[int]) -> torch.Tensor:
        """``flat_index[ks]``, kept per subset: indexing a device tensor with a list copies
        the list to the device, a host sync, each time (the subsets repeat step to step)."""
        key = tuple(ks)
        if key not in self._subsets:
            self._subsets[key] = self.flat_index[torch.tensor(ks, dtype=torch.long, device=self.flat_index.device)]
        return self._subsets[key]

    def _local_sumsq(self, after_backward: bool = False) -> torch.Tensor:
        """This rank's part of each parameter's squared norm, as the step will apply the
        gradient (the engine's pending clip); summed over the ranks
        it is the statistic. Hybrid: the replicas' shards are equal, so one replica counts.
        ``after_backward``: the squared norms the source took on the device before copying
        gradient shards to host memory stand for those pieces (a pass over host memory on
        the CPU was a large share of a ZeRO-3 offload backward's host time)."""
        taken = None
        if after_backward and any(seg.norms_taken for seg in self._segments):
            taken = [seg.sumsq_before_copy(a, b) for seg, a, b in self.flat]
            taken = taken if any(t is not None for t in taken) else None
        local = self.local_values(squared_norms, taken)
        if self.uncounted_hand is not None:
            local.index_fill_(0, self.uncounted_hand, 0.0)
        if self.coef is not None:
            local *= self.coef.to(local.device).square()
        if self.source.groups.replica_rank != 0:
            local.zero_()
        return local.index_fill_(0, self._uncounted, 0.0) if self._uncounted.numel() else local

    def _retake(self):
        """The squared norms again, after clamping (one all-reduce: every rank clamped alike)."""
        local = self.slots.spread(self._local_sumsq())
        comm.all_reduce(local, group=self.source.groups.every, what="gradient statistics after a clamp").wait()
        self.source.comm_elements["all_reduce"] += local.numel()
        _over_tp(self.tp, local, self.source)
        self._sq, self.stale = local, set()

    def nonfinite(self) -> torch.Tensor:
        """One-element bool tensor: some gradient element, on some rank, is inf or NaN."""
        return (~torch.isfinite(self.slot_sumsq)).any().reshape(1)

    def clip_(self, max_norm: float, norm_type: float):
        """Scales every gradient by min(1, max_norm / total norm) (the coefficient the fused
        step folds in: ``clip_coefficient``); returns the total norm."""
        total = self.total_norm(float(norm_type))
        self.scale_all_(torch.clamp(max_norm / (total + 1e-6), max=1.0).float().reshape(()))
        return total.reshape(())

    # ------------------------------------------------------ in-place updates
    @torch.no_grad()
    def scale_(self, indices: List[int], factor):
        """Multiply the gradients of ``indices`` by ``factor`` (a number or a one-element tensor)."""
        for i in indices:
            for g in (g for seg, a, b in self.pieces[i] for g in seg.grad_views(a, b)):
                if isinstance(factor, torch.Tensor):
                    g.mul_(factor.to(g.device))
                elif factor == 0:
                    g.zero_()
                else:
                    g.mul_(factor)
        self.pnorms = {}
        sq = self.slot_sumsq
        idx = torch.tensor(indices, device=sq.device)
        at = idx if self.slots.identity else torch.tensor(self.slots.of_params(indices), device=sq.device)
        if not isinstance(factor, torch.Tensor) and factor == 0:
            sq[at] = 0.0  # exact, even where the gradient was inf or NaN
            if self.maxabs is not None:
                self.maxabs[idx] = 0.0
            return
        f = (
            factor.to(self.sumsq.device, torch.float32).reshape(())
            if isinstance(factor, torch.Tensor)
            else torch.tensor(float(factor), device=sq.device)
        )
        sq[at] = sq[at] * (f * f)
        if self.maxabs is not None:
            self.maxabs[idx] = self.maxabs[idx] * f.abs()

    @torch.no_grad()
    def clamp_(self, indices: List[int], lo, hi):
        """``torch.nn.utils.clip_grad_value_``: clamp the averaged gradients of ``indices``
        elementwise to [lo, hi]. The pieces hold them divided by the source's
        pending clip coefficient, so the bounds are too;
        the norms are taken again, in one all-reduce, when next read."""
        scale = 1.0 if self.coef is None else self.coef
        for i in indices:
            for g in (g for seg, a, b in self.pieces[i] for g in seg.grad_views(a, b)):
                s = scale.to(g.device) if isinstance(scale, torch.Tensor) else scale
                g.clamp_(min=None if lo is None else lo / s, max=None if hi is None else hi / s)
        self.stale.update(indices)
        self.maxabs, self.pnorms = None, {}

    def unscale_(self, indices: List[int], found_inf: torch.Tensor, inv_scale: torch.Tensor):
        """GradScaler's unscale: multiply by ``inv_scale``; ``found_inf`` becomes 1 if
        any of these gradients holds an inf or NaN on any rank."""
        self.scale_(indices, inv_scale)
        sq = self.slot_sumsq  # (every group's slots: an overflow on any rank skips the step everywhere)
        bad = (~torch.isfinite(sq[torch.tensor(self.slots.of_params(indices), device=sq.device)])).any()
        found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype).reshape(found_inf.shape)))

    def clip_coefficient(self) -> Optional[torch.Tensor]:
        """The product of the engine's clip_grad_norm_ factors since these gradients were
        reduced (1 element, fp32), or None: the fused step folds it in. It belongs to
        the gradients: a step the GradScaler skipped leaves it to no later step."""
        return None if self.coef is None else self.coef.reshape(1)

    def scale_all_(self, factor: torch.Tensor):
        """The engine's clip_grad_norm_ folds ``factor`` into its step: keep the statistics in step."""
        self.coef = factor if self.coef is None else self.coef * factor
        self.pnorms = {}
        self.slot_sumsq.mul_(factor * factor)
        if self.maxabs is not None:
            self.maxabs.mul_(factor)

    # ------------------------------------------------------------ placeholders
    def _before_accumulate(self, grad):
        """Runs before autograd accumulates into ``p.grad``: a new backward begins (with
        the placeholders still placed: no zero_grad since the last one)."""
        if self.placed:
            self.clear(from_backward=True)
        return None

    def clear(self, from_backward: bool = False):
        """Give ``p.grad`` back to the source: what it held before the placeholders
        (the next backward accumulates there, or zero_grad frees it)."""
        self.settle()
        self.coef = None
        self.by_hand, self.uncounted_hand = False, None
        gone = [i for i, g in self.placed.items() if g is not None and self.params[i].grad is not g]
        for i, g in self.kept.items():
            if self.params[i].grad is self.placed[i]:
                self.params[i].grad = g
        placed, self.kept, self.placed = self.placed, {}, {}
        if gone and from_backward:
            if len(gone) < sum(g is not None for g in placed.values()):
                raise RuntimeError(
                    self.err(
                        f"p.grad of parameters {gone[:8]} was replaced or set to None outside opt.zero_grad(), "
                        "but not of the others: their sharded gradients cannot be cleared one by one; call "
                        "opt.zero_grad() (or model.zero_grad()) to clear every gradient"
                    )
                )
            self.source.zero_grad(set_to_none=True)  # model.zero_grad() cleared every gradient


def unsupported(grads, i: int, what: str) -> str:
    shape = tuple(grads.params[i].shape)
    return grads.err(
        f"{what} on p.grad of parameter {i} (shape {shape}): after backward its averaged gradient is "
        "sharded over the ranks (p.grad is a zeroshard ShardedGrad with no data of its own). What works "
        "on it: torch.nn.utils.clip_grad_norm_ (or opt.clip_grad_norm_), torch.amp.GradScaler, "
        "torch.nn.utils.clip_grad_value_ (clamp_), p.grad.norm() (any order), mul_/div_ by a "
        "number, zero_(); and any read (comparisons, clone(), abs(), isfinite, ...), which gathers "
        "the full gradient on every rank. For another change, assign the new gradient to p.grad on every "
        "rank (p.grad = p.grad.full_tensor() + ...: it is then the parameter's averaged gradient), or change "
        "the gradients inside opt.no_sync() (local, unreduced)"
    )
