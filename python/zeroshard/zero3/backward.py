"""ZeRO-3 backward: each unit is gathered again before its backward, resharded
once everything its backward waits for has come, and its gradients reduced on
the one reduction pipeline ([Note: reduction pipeline] in
core/reduction.py) with ZeRO-3's fold (zero3/fold.py). See [Note: fully
shard policy] in zero3/fully_shard.py."""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .fold import DivideIntoShardFold, expose_agreed, expose_grads
from .gather import Gatherer
from ..core.reduction import MAX_INFLIGHT_UNITS, Reduction, ReductionPipeline
from ..core.hooks import check_dense_grad
from ..core.source import GradState
from ..core.tensor_parallel import settle
from .records import Param, Unit, UnitState


@dataclass(frozen=True, kw_only=True)
class BackwardContext:
    """What one FullyShard's backward works with besides its units and gatherer."""

    device: torch.device
    world: int  # FullyShard's shard ranks (x the replicas: the gradients' divisor)
    replicate: Optional[dist.ProcessGroup]  # hybrid sharding's replicas ([Note: hybrid sharding])
    reduce_dtype: torch.dtype
    comm_elements: dict  # elements each kind of collective moved (FullyShard's)
    calls: Callable[[], List[int]]  # the units called since the last backward began, in call order
    every: Optional[dist.ProcessGroup]  # every rank of the model (replicas too)
    stepped_here: Callable[[], bool]  # whether a ShardedOptimizer steps the model (else a torch one may)
    err: Callable[[str], str]


class UnitBackward:
    """The backward of one FullyShard's units."""

    def __init__(self, units: List[Unit], gatherer: Gatherer, ctx: BackwardContext):
        self.units, self.gatherer, self.err, self._calls, self._ctx = units, gatherer, ctx.err, ctx.calls, ctx
        # the gradient is divided by every rank, the replicas' too (an expert unit's too: its
        # group's sum covers the whole batch, [Note: param groups over their own ranks])
        divisor = ctx.world * (dist.get_world_size(ctx.replicate) if ctx.replicate is not None else 1)
        self.fold = DivideIntoShardFold(
            device=ctx.device,
            reduce_dtype=ctx.reduce_dtype,
            divisor=divisor,
            label=lambda what: gatherer.label(what, phase=False),
        )
        self._pipeline = ReductionPipeline(self.fold, MAX_INFLIGHT_UNITS, ctx.comm_elements)
        self.fold.retire_completed = self._pipeline.retire_completed
        for u in units:
            u.reduction = Reduction(name=f"unit '{u.name}'", owner=u, group=u.ranks.group, replicate=ctx.replicate)
        self.state = GradState.EMPTY
        self.order: List[int] = []  # reverse call order of the non-root units, fixed at backward start
        self._cursor = 0  # how far the backward has come along ``order`` (prefetch)
        self.listeners: List[Callable[[], None]] = []  # told when a synced backward has finished

    @property
    def sync(self) -> bool:
        """Gradients are reduced (False under no_sync(): accumulated locally)."""
        return self._pipeline.sync

    def start(self):
        """A backward begins (first hook of it): fix the reduction order, reset the counts."""
        if self.state == GradState.BACKWARD:
            return
        self.state = GradState.BACKWARD
        self.gatherer.phase = "backward"
        calls = self._calls()
        self.order, self._cursor = list(reversed(calls)), 0
        # a unit called several times reduces once, after the backward of its first call
        first = list(reversed(dict.fromkeys(calls)))
        called = set(first)
        rest = [u.index for u in self.units[1:] if u.index not in called]
        for u in self.units:  # (a parameter frozen since wrapping takes no gradient: see _swap)
            u.reduction.all_reduce = u.settings.requires_all_reduce
            u.reduction.pending = sum(q.full.requires_grad for q in u.trainable) + u.input_waits
            u.input_waits = 0
            for q in u.params:
                q.arrived = False
        self._pipeline.start([self.units[ui].reduction for ui in first + rest + [0] if self._reduces(self.units[ui])])
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    @staticmethod
    def _reduces(u: Unit) -> bool:
        """``u``'s gradients are reduced in this backward (trainable and, by its own setting,
        synced: ``set_requires_gradient_sync(False)`` on its module accumulates them locally)."""
        return bool(u.trainable) and u.settings.requires_gradient_sync

    @torch.no_grad()
    def pre_backward(self, u: Optional[Unit]):
        """Before ``u``'s backward (None: the root's outputs, the first of the backward): gather it, prefetch."""
        self.start()
        bwd = self.order
        if u is None:  # root: its outputs' gradient is the first of the backward
            self.gatherer.gather(self.units[0])
            self._prefetch(self.units[0], bwd, -1)
            return
        self._pipeline.retire_completed()
        self.gatherer.gather(u)
        if u.settings.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            self.gatherer.prefetch_these(u.settings.backward_prefetch)
        elif u.index in bwd[self._cursor :]:
            pos = bwd.index(u.index, self._cursor)
            self._cursor = pos + 1
            self.gatherer.prefetch_after(bwd, pos)

    def _prefetch(self, u: Unit, order: List[int], pos: int):
        if u.settings.backward_prefetch is not None:
            self.gatherer.prefetch_these(u.settings.backward_prefetch)
        else:
            self.gatherer.prefetch_after(order, pos)

    @torch.no_grad()
    def on_grad(self, u: Unit, q: Param):
        """Autograd accumulated ``q``'s gradient on its full parameter."""
        self.start()
        if u.state != UnitState.GATHERED:  # [Note: unit outputs]
            raise RuntimeError(
                self.err(
                    f"the gradient of '{q.names[0]}' was computed while unit '{u.name or '<root>'}' was not gathered "
                    f"({u.state.value}): the backward reached the unit through a tensor its output hooks did not see "
                    "(kept on a module or a global, or inside an object). Return every tensor the loss depends on "
                    "from the unit's forward, in a tuple, list, dict, namedtuple or dataclass"
                )
            )
        check_dense_grad(q.full.grad, lambda: f"'{q.names[0]}'", self.err)
        if q.placed is not None:  # [Note: tensor-parallel parameters]
            settle(q.full)
        if u.reduction.buffer is not None:  # accumulating into an existing flat buffer: add as they come
            self.fold.move_grad(u, q)
        q.got_grad = True
        if not q.arrived:
            q.arrived = True
            self._arrive(u)

    @torch.no_grad()
    def inputs_done(self, u: Unit):
        """The gradients of one call's inputs of ``u`` (a unit with frozen parameters) are computed."""
        self.start()
        self._arrive(u)

    def _arrive(self, u: Unit):
        """One thing ``u``'s backward waited for has come; after the last, it is resharded and reduced."""
        self._pipeline.arrived(u.reduction)
        if u.reduction.pending == 0:
            if not u.is_root and u.settings.reshard_after_backward:
                self.gatherer.reshard(u)
            if u.trainable:
                self.fold.flatten(u)
                self._pipeline.advance()

    @torch.no_grad()
    def _finish(self):
        self._pipeline.finish()
        if self.sync:
            self.fold.host_copies.wait()  # the gradient shards in host memory are complete: the CPU steps them
        for u in self.units:  # (set_reshard_after_backward(False): kept gathered to the next step)
            if u.settings.reshard_after_backward:
                self.gatherer.reshard(u)
        self.gatherer.phase = "forward"
        # (a unit its module's set_requires_gradient_sync(False) left unreduced: not ready either)
        # (nor one whose replicas' all-reduce set_requires_all_reduce(False) put off)
        synced = self.sync and all(
            u.settings.requires_gradient_sync and u.reduction.partial is None for u in self.units if u.trainable
        )
        self.state = GradState.READY if synced else GradState.EMPTY
        if synced and not self._ctx.stepped_here():  # p.grad for a torch optimizer, wherever a rank gave one
            expose_agreed(self.units, self._ctx.every, self.gatherer.label("which parameters got gradients"))
        if synced:
            for fn in self.listeners:
                fn()

    @torch.no_grad()
    def abandon(self):
        """Forget a backward that stopped half-way (it raised): its gradients are dropped."""
        self._pipeline.abandon()
        for u in self.units:
            self.fold.drop_buffer(u)
            for q in u.trainable:
                q.full.grad = None
        self.gatherer.reshard_all()
        self.gatherer.phase = "forward"
        self.state = GradState.EMPTY
        warnings.warn(
            "FullyShard: the previous backward did not finish (it raised); its partial gradients were dropped"
        )

    def step_done(self, updated: bool):
        """The optimizer stepped the shards (``updated``) or skipped the step: the gradients are consumed."""
        self.state = GradState.EMPTY
        self.gatherer.steps_done += bool(updated)

    def set_divide_factor(self, factor: float, units: Optional[List[Unit]] = None):
        """Each reduced gradient (of ``units``, None: every unit) is the sum over every rank (the
        replicas' too) divided by ``factor`` from the next reduction on
        (``set_gradient_divide_factor``: FullyShard's for every unit, FSDP2's per module)."""
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor < math.inf:
            raise ValueError(self.err(f"set_gradient_divide_factor takes a positive, finite number, got {factor!r}"))
        if self.active:
            raise RuntimeError(self.err("set_gradient_divide_factor() called during backward; call it before"))
        if units is None:
            self.fold.divisor = float(factor)
        for u in self.units if units is None else units:
            u.settings.divide_factor = None if units is None else float(factor)

    def zero_grad(self, set_to_none: bool):
        """Free (``set_to_none``) or zero the gradient shards; see FullyShard.zero_grad."""
        for u in self.units:
            g = u.reduction.grad
            g.sumsq, u.reduction.partial = None, None
            if set_to_none or g.tensor is None:
                g.tensor = None
                for q in u.trainable:
                    q.sharded.grad, q.got_grad, q.exposed = None, False, None
                continue
            g.tensor.zero_()
            expose_grads(u)
        self.state = GradState.EMPTY

    @property
    def active(self) -> bool:
        """A backward is running."""
        return self.state == GradState.BACKWARD

    def no_sync(self):
        """Accumulate gradients locally (full size, in reduce_dtype) without
        communication; the next backward outside this context reduces them all."""
        return self._pipeline.no_sync()
