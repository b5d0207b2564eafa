"""The gradient reduction pipeline every stage runs on: one record for a range
of gradients reduced together, the order they are reduced in, and the
pipeline that launches, retires and folds them.

[Note: reduction pipeline]
A *reduction* (``Reduction``) is a flat range of gradients reduced by one
reduce-scatter: a ZeRO-1/2 bucket, a ZeRO-3 unit. It carries what the
pipeline needs and nothing of its stage: how many gradients it still waits
for in this backward, the process group its reduce-scatter runs over (and
under hybrid sharding the replicas it is all-reduced across after), its
buffer, where the reduce-scatter wrote this rank's chunk, the collective
in flight, and the averaged gradient it folds into (a ``GradShard``, core/segments.py,
which the optimizer's segments read: the buckets of one flat buffer share
their buffer's, each writing its own range). The group is the record's, not the pipeline's, so records of one
backward may reduce over different groups.

``ReductionPipeline`` runs one backward's reductions:
* in one fixed order on every rank (``ReductionOrder``): a record whose
  gradients have all arrived waits for the ones before it, and at the end of
  backward the rest are launched, missing gradients counting as zero; so all
  ranks issue the same collectives in the same order whatever order their
  gradients arrive in;
* at most ``max_inflight`` reduce-scatters in flight: launching one more
  first retires the oldest, which bounds the gradient buffers they hold;
* hybrid sharding ([Note: hybrid sharding] in comm/mesh.py): a retired
  record's reduced chunk is all-reduced across the replicas, and that
  all-reduce stays in flight until the next record retires, so it overlaps
  the backward too;
* then the chunk is *folded* where the optimizer reads it. Only the fold
  and what the reduce-scatter reads differ by stage, and they are the
  ``FoldPolicy``'s: stage 1 keeps the chunk in place in its persistent
  gradient buffer, stage 2 adds it into the gradient shard, ZeRO-3 divides
  it into the fp32 gradient shard (or copies it to a host-memory shard).
* ``no_sync()``: nothing is launched; the policy accumulates locally and the
  next synced backward reduces everything.
* A record with ``all_reduce`` False (hybrid sharding, FSDP2's
  ``set_requires_all_reduce(False)``): reduce-scattered within its replica, then
  its chunk kept in ``partial`` (the policy ``release``s the rest) and added to
  the next chunk that is all-reduced; nothing is folded until then.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .segments import GradShard

# Reduce-scatters in flight at once. A bucket holds at most bucket_mb of gradients:
# two keep the communication busy while backward continues and bound stage 2's
# transient gradient memory to two buckets. A unit holds a whole layer's gradients
# (as large as the model's layers are): one in flight, as FSDP2 keeps one.
MAX_INFLIGHT_BUCKETS = 2
MAX_INFLIGHT_UNITS = 1


@dataclass(kw_only=True, eq=False)
class Reduction:
    """A range of gradients reduced together by one reduce-scatter (a bucket, a unit)."""

    name: str  # in the collectives' labels: "bucket 3", "unit 'layers.0'"
    owner: object  # the bucket or unit whose gradients these are
    group: dist.ProcessGroup  # the reduce-scatter's ranks
    replicate: Optional[dist.ProcessGroup] = None  # hybrid sharding: all-reduced across these after
    pending: int = 0  # gradients (or inputs) still to arrive in this backward
    buffer: Optional[torch.Tensor] = None  # the flat gradients reduced (when the policy allocates them)
    out: Optional[torch.Tensor] = None  # where the reduce-scatter wrote this rank's chunk of the sum
    handle: Optional[comm.CommHandle] = None  # the collective in flight on ``out``
    launched: bool = False  # its reduce-scatter was issued in this backward
    # what the fold writes: the averaged gradient ([Note: one meaning for a gradient])
    grad: GradShard = field(default_factory=GradShard)
    # hybrid sharding: all-reduced across the replicas in this backward; False (FSDP2's
    # set_requires_all_reduce(False)): this replica's sum is kept in ``partial`` and added to
    # the next all-reduced one, and nothing is folded until then
    all_reduce: bool = True
    partial: Optional[torch.Tensor] = None


class ReductionOrder:
    """Items with a ``pending`` count launched in one fixed order, at most ``max_inflight``
    launched and not yet retired. The pipeline runs on it, and the planner replays a
    backward's buffers with it (plan/trace.py)."""

    def __init__(self, launch: Callable, retire: Callable, max_inflight: int):
        self._launch, self._retire, self.max_inflight = launch, retire, max_inflight
        self.order: List = []
        self.next = 0
        self.inflight: List = []

    def start(self, order: List):
        """A new backward: launch ``order`` from its first item."""
        self.order, self.next = list(order), 0

    def advance(self, flush: bool = False):
        """Launch items in order while the next has nothing pending (``flush``: all the rest)."""
        while self.next < len(self.order):
            item = self.order[self.next]
            if item.pending > 0 and not flush:
                return
            self.next += 1
            self._launch(item)
            self.inflight.append(item)
            while len(self.inflight) > self.max_inflight:
                self._retire(self.inflight.pop(0))

    def retire_done(self, done: Callable):
        """Retire, oldest first, the launched items for which ``done(item)`` holds."""
        while self.inflight and done(self.inflight[0]):
            self._retire(self.inflight.pop(0))

    def reset(self):
        """Forget the current backward (its launched items are the caller's to wait on first)."""
        self.order, self.next, self.inflight = [], 0, []

    def drain(self):
        """Retire every launched item."""
        self.retire_done(lambda item: True)


class FoldPolicy(abc.ABC):
    """What one stage does around the pipeline's collectives ([Note: reduction pipeline])."""

    @abc.abstractmethod
    def reduce_input(self, r: Reduction) -> Tuple[torch.Tensor, torch.Tensor, Optional[List[int]]]:
        """At launch: (the tensor the reduce-scatter reads, where this rank's chunk of the
        sum goes, the chunks' bounds or None for equal chunks)."""

    @abc.abstractmethod
    def fold(self, r: Reduction) -> None:
        """``r.out`` holds this rank's reduced chunk (summed over the replicas too): put it
        where the optimizer reads it and free what the reduction held."""

    @abc.abstractmethod
    def label(self, r: Reduction, what: str) -> str:
        """The name the watchdog and the flight record give ``r``'s collective ``what``."""

    def release(self, r: Reduction) -> None:
        """Free what ``r`` held for a reduction that folds nothing now (its sum kept aside)."""


class ReductionPipeline:
    """One source's reductions, backward after backward; see [Note: reduction pipeline]."""

    def __init__(self, policy: FoldPolicy, max_inflight: int, comm_elements: Dict[str, int]):
        self.policy, self.comm_elements = policy, comm_elements
        self.sync = True  # False under no_sync(): nothing is launched
        self._order = ReductionOrder(self._launch, self._retire, max_inflight)
        self._replicating: List[Reduction] = []  # hybrid: replica all-reduces in flight

    def start(self, order: List[Reduction]):
        """A backward begins: ``order`` is the launch order (the caller has set each
        record's ``pending``: what it waits for in this backward)."""
        self._order.start(order)
        for r in order:
            r.launched = False

    def arrived(self, r: Reduction, n: int = 1):
        """``n`` of the things ``r`` waits for have come (its reductions launch when due)."""
        r.pending -= n

    def advance(self):
        """Launch every record now due, in order (none under no_sync())."""
        if self.sync:
            self._order.advance()

    def retire_completed(self):
        """Fold the oldest in-flight reductions that have completed (frees their buffers early)."""
        self._order.retire_done(lambda r: r.handle.completed())

    def finish(self):
        """The end of a synced backward: launch the rest, retire and fold everything."""
        if not self.sync:
            return
        self._order.advance(flush=True)
        self._order.drain()
        while self._replicating:
            self._fold(self._replicating.pop(0))

    def abandon(self):
        """Forget a backward that stopped half-way: wait for what is in flight, fold nothing
        (the buffers are the policy's to drop: it counts them)."""
        for r in self._order.inflight + self._replicating:
            if r.handle is not None:
                r.handle.wait()
            r.handle, r.out = None, None
        self._order.reset()
        self._replicating = []

    @contextlib.contextmanager
    def no_sync(self):
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def _launch(self, r: Reduction):
        """Reduce-scatter (SUM) ``r``; the 1/N average is the fold's or the optimizer's."""
        src, r.out, bounds = self.policy.reduce_input(r)
        # the input is never read afterwards (stage 1 zeroes the other ranks' chunks,
        # the other buffers are recycled), so the transport may use it as scratch
        r.handle = comm.reduce_scatter(
            src,
            r.out,
            group=r.group,
            average=False,
            input_is_scratch=True,
            bounds=bounds,
            what=self.policy.label(r, "reduce-scatter"),
        )
        r.launched = True
        self.comm_elements["reduce_scatter"] += src.numel()

    def _retire(self, r: Reduction):
        r.handle.wait()
        r.handle = None
        if r.replicate is None:
            self._fold(r)
            return
        if not r.all_reduce:  # this replica's sum, kept for the next all-reduce
            r.partial = r.out.clone() if r.partial is None else r.partial.add_(r.out)
            r.out = None
            self.policy.release(r)
            return
        if r.partial is not None:
            r.out.add_(r.partial)
            r.partial = None
        r.handle = comm.all_reduce(r.out, group=r.replicate, what=self.policy.label(r, "replica all-reduce"))
        self.comm_elements["replica_all_reduce"] += r.out.numel()
        self._replicating.append(r)
        while len(self._replicating) > 1:
            self._fold(self._replicating.pop(0))

    def _fold(self, r: Reduction):
        if r.handle is not None:
            r.handle.wait()
            r.handle = None
        self.policy.fold(r)
        r.out = None
