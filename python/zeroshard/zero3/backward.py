"""ZeRO-3 backward: each unit is gathered again before its backward, its
gradients are moved into one flat buffer once all have arrived, and the
buffers are reduce-scattered (SUM) in one fixed order on every rank, then
divided by N and written (or added) into the fp32 gradient shards. See
[Note: fully shard policy] in zero3/fully_shard.py."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .. import comm
from .gather import Gatherer
from ..offload import HostCopies
from ..common.order import OrderedReductions
from ..common.source import GradState, check_dense_grad, squared_norms
from .param import ShardedTensor
from .records import Param, Unit, UnitState
from .wrap import host_or_device_empty
from ..native.layout import fill_flat

MAX_INFLIGHT = 1        # reduce-scatters in flight at once (each holds one unit's gradients)


class UnitBackward:
    """The backward of one FullyShard's units."""

    def __init__(self, units: List[Unit], gatherer: Gatherer, *, device: torch.device, group, rank: int,
                 world: int, replicate, reduce_dtype: torch.dtype, events, comm_elements: dict,
                 calls: Callable[[], List[int]], err: Callable[[str], str]):
        self.units, self.gatherer, self.device, self.group = units, gatherer, device, group
        self.rank, self.world, self.reduce_dtype = rank, world, reduce_dtype
        # hybrid sharding: each reduced shard is all-reduced across these replicas
        # ([Note: hybrid sharding] in comm/mesh.py); the gradient is divided by every rank
        self.replicate = replicate
        self.divisor = world * (dist.get_world_size(replicate) if replicate is not None else 1)
        self._replicating: List[Unit] = []    # units whose replica all-reduce is in flight
        # the units called since the last backward began, in call order (FullyShard keeps them)
        self.events, self.comm_elements, self._calls, self.err = events, comm_elements, calls, err
        self.state = GradState.EMPTY
        self.sync = True             # reduce (False under no_sync(): accumulate locally)
        self.order: List[int] = []   # reverse call order of the non-root units, fixed at backward start
        self._cursor = 0             # how far the backward has come along ``order`` (prefetch)
        self.grad_bytes = 0          # flat gradient buffers alive now
        self.grad_bytes_peak = 0
        self.listeners: List[Callable[[], None]] = []   # told when a synced backward has finished
        self._reductions = OrderedReductions(self._launch, self._retire, MAX_INFLIGHT)
        # to gradient shards in host memory ([Note: offloaded gradients] in offload/copies.py)
        self.host_copies = HostCopies(device)

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
        self._reductions.start([self.units[ui] for ui in first + rest + [0] if self.units[ui].trainable])
        for u in self.units:     # (a parameter frozen since wrapping takes no gradient: see _swap)
            u.pending = sum(q.full.requires_grad for q in u.trainable) + u.input_waits
            u.input_waits = 0
            for q in u.params:
                q.arrived = False
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    @torch.no_grad()
    def pre_backward(self, u: Optional[Unit]):
        """Before ``u``'s backward (None: the root's outputs, the first of the backward): gather it, prefetch."""
        self.start()
        bwd = self.order
        if u is None:              # root: its outputs' gradient is the first of the backward
            self.gatherer.gather(self.units[0])
            self.gatherer.prefetch_after(bwd, -1)
            return
        self._retire_completed()
        self.gatherer.gather(u)
        if u.index in bwd[self._cursor:]:
            pos = bwd.index(u.index, self._cursor)
            self._cursor = pos + 1
            self.gatherer.prefetch_after(bwd, pos)

    @torch.no_grad()
    def on_grad(self, u: Unit, q: Param):
        """Autograd accumulated ``q``'s gradient on its full parameter."""
        self.start()
        if u.state != UnitState.GATHERED:     # [Note: unit outputs]
            raise RuntimeError(self.err(
                f"the gradient of '{q.names[0]}' was computed while unit '{u.name or '<root>'}' was not gathered "
                f"({u.state.value}): the backward reached the unit through a tensor its output hooks did not see "
                "(kept on a module or a global, or inside an object). Return every tensor the loss depends on "
                "from the unit's forward, in a tuple, list, dict, namedtuple or dataclass"))
        check_dense_grad(q.full.grad, f"'{q.names[0]}'", self.err)
        if u.grad_flat is not None:   # accumulating into an existing flat buffer: add as they come
            self._move_grad(u, q)
        self.events.append(("grad", u.name))
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
        u.pending -= 1
        if u.pending == 0:
            if not u.is_root:
                self.gatherer.reshard(u)
            if u.trainable:
                self._flatten_grads(u)
                if self.sync:
                    self._reductions.advance()

    def _move_grad(self, u: Unit, q: Param):
        u.grad_flat[q.offset:q.offset + q.numel].add_(q.full.grad.reshape(-1))
        q.full.grad = None

    def _flatten_grads(self, u: Unit):
        """Move the gradients autograd left on the unit's full parameters into its
        flat gradient buffer, allocated now: not at the unit's first gradient,
        while the unit's activations are still alive (the peak of backward)."""
        if u.grad_flat is not None:       # accumulating: add what arrived since
            for q in u.trainable:
                if q.full.grad is not None:
                    self._move_grad(u, q)
            return
        self._retire_completed()          # free finished reductions' buffers before taking another
        u.grad_flat = torch.empty(u.grad_numel, dtype=self.reduce_dtype, device=self.device)
        self.grad_bytes += u.grad_flat.numel() * u.grad_flat.element_size()
        self.grad_bytes_peak = max(self.grad_bytes_peak, self.grad_bytes)
        # one pass: gradients copied in; padding and gradients that never arrived are zero
        fill_flat(u.grad_flat, [(q.offset, q.full.grad.reshape(-1))
                                for q in u.trainable if q.full.grad is not None])
        for q in u.trainable:
            q.full.grad = None

    def _launch(self, u: Unit):
        self._flatten_grads(u)        # a unit some gradient never reached: the rest count as zero
        # overwrite the shard unless the user kept gradients from an earlier backward
        u.fresh = u.grad_shard is None
        u.reduce = comm.reduce_scatter(u.grad_flat, u.own_grad(u.grad_flat, self.rank), group=self.group,
                                       average=False, input_is_scratch=True, bounds=u.reduce_bounds(),
                                       what=self.gatherer.label(f"unit '{u.name}' reduce-scatter", phase=False))
        self.comm_elements["reduce_scatter"] += u.grad_numel
        self.events.append(("reduce_scatter", u.name))

    def _retire_completed(self):
        self._reductions.retire_done(lambda u: u.reduce.completed())

    def _retire(self, u: Unit):
        u.reduce.wait()
        u.reduce = None
        if self.replicate is None:
            self._fold(u)
            return
        # stays in flight until the next unit retires: it overlaps the backward too
        u.reduce = comm.all_reduce(u.own_grad(u.grad_flat, self.rank), group=self.replicate,
                                   what=self.gatherer.label(f"unit '{u.name}' replica all-reduce", phase=False))
        self.comm_elements["replica_all_reduce"] += u.own_grad(u.grad_flat, self.rank).numel()
        self._replicating.append(u)
        while len(self._replicating) > 1:
            self._fold(self._replicating.pop(0))

    def _fold(self, u: Unit):
        """Divide the reduced chunk by every rank and write (or add) it into the fp32 shard."""
        if u.reduce is not None:
            u.reduce.wait()
            u.reduce = None
        chunk = u.own_grad(u.grad_flat, self.rank)
        if u.grad_shard is None:     # first reduction since zero_grad(set_to_none=True)
            # with the fp32 shard, or in host memory ([Note: offloaded gradients]); not
            # zeroed: u.fresh, so each path below overwrites the whole chunk's length
            where = torch.device("cpu") if u.grad_to_host else u.shard.device
            u.grad_shard = host_or_device_empty(chunk.numel(), where, self.device)
            u.fresh = True
        written = u.grad_shard       # the fresh values, on the reducing device
        if u.grad_shard.device != chunk.device:      # in host memory: divide here, then to host
            written = chunk.float().div_(self.divisor)   # (the chunk is scratch: freed below)
            if u.fresh:     # asynchronous into pinned memory; _finish waits before the step reads it
                self.host_copies.copy(u.grad_shard, written)
            else:
                u.grad_shard.add_(written.cpu())
        elif u.fresh and chunk.dtype == torch.float32:
            torch.div(chunk, self.divisor, out=u.grad_shard)     # one pass
        elif u.fresh:
            u.grad_shard.copy_(chunk).div_(self.divisor)          # divide in fp32
        else:
            u.grad_shard.add_(chunk.float().div_(self.divisor))
        # the statistics' squared norms of a shard bound for host memory, taken here on the
        # device rather than over host memory on the CPU after the backward
        u.grad_sumsq = _sumsq_of_pieces(u, written) if u.grad_to_host and u.fresh else None
        _expose_grads(u)
        self.grad_bytes -= u.grad_flat.numel() * u.grad_flat.element_size()
        u.grad_flat = None

    @torch.no_grad()
    def _finish(self):
        if self.sync:
            self._reductions.advance(flush=True)
            self._reductions.drain()
            while self._replicating:
                self._fold(self._replicating.pop(0))
            self.host_copies.wait()     # the gradient shards in host memory are complete: the CPU steps them
        self.gatherer.reshard_all()
        self.gatherer.phase = "forward"
        self.state = GradState.READY if self.sync else GradState.EMPTY
        if self.sync:
            for fn in self.listeners:
                fn()

    @torch.no_grad()
    def abandon(self):
        """Forget a backward that stopped half-way (it raised): its gradients are dropped."""
        for u in self._reductions.inflight + self._replicating:
            if u.reduce is not None:
                u.reduce.wait()
        self._reductions.reset()
        self._replicating = []
        for u in self.units:
            u.reduce, u.grad_flat = None, None
            for q in u.trainable:
                q.full.grad = None
        self.grad_bytes = 0
        self.gatherer.reshard_all()
        self.gatherer.phase = "forward"
        self.state = GradState.EMPTY
        warnings.warn("FullyShard: the previous backward did not finish (it raised); its partial "
                      "gradients were dropped")

    def step_done(self, updated: bool):
        """The optimizer stepped the shards (``updated``) or skipped the step: the gradients are consumed."""
        self.state = GradState.EMPTY
        self.gatherer.steps_done += bool(updated)

    def zero_grad(self, set_to_none: bool):
        """Free (``set_to_none``) or zero the gradient shards; see FullyShard.zero_grad."""
        for u in self.units:
            u.grad_sumsq = None
            if set_to_none or u.grad_shard is None:
                u.grad_shard = None
                for q in u.trainable:
                    q.sharded.grad, q.got_grad = None, False
                continue
            u.grad_shard.zero_()
            _expose_grads(u)
        self.state = GradState.EMPTY

    @property
    def active(self) -> bool:
        """A backward is running."""
        return self.state == GradState.BACKWARD

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (full size, in reduce_dtype) without
        communication; the next backward outside this context reduces them all."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old


def _sumsq_of_pieces(u: Unit, shard: torch.Tensor) -> dict:
    """{piece's offset in the shard: its squared norm} over ``shard``, a unit's fresh
    averaged gradient shard (one foreach launch over the unit's pieces)."""
    pieces = [q for q in u.trainable if q.local.numel() > 0]
    if not pieces:
        return {}
    vals = squared_norms([shard[q.shard_offset:q.shard_offset + q.local.numel()] for q in pieces])
    return {q.shard_offset: vals[k] for k, q in enumerate(pieces)}


def _expose_grads(u: Unit):
    """Each sharded parameter's ``.grad``: its view of the unit's gradient shard. None
    when the shard is in host memory and the parameter is not (``grad_to_host``:
    torch keeps ``.grad`` on the parameter's device; the optimizer reads the shard),
    and for a parameter no backward reached here since ``zero_grad(set_to_none=True)``,
    as torch leaves it (a ShardedOptimizer then puts in the gradient any rank gave)."""
    same = u.grad_shard.device == u.shard.device
    for q in u.trainable:
        piece = u.grad_shard[q.shard_offset:q.shard_offset + q.local.numel()]
        q.sharded.grad = ShardedTensor(piece, q.shape, q.names[0]) if same and q.got_grad else None
