"""ZeRO-1 and ZeRO-2 gradient source: flat buffers, buckets, backward hooks.

[Note: sharded optimizer policy]
* Layout. Trainable parameters are laid out in reverse registration order
  (the order backward produces their gradients) in flat buffers, one per
  (param group, dtype), cut into buckets of at most ``bucket_mb``
  (zeroshard.compute_layout). Every parameter becomes a view into its flat
  buffer, so the all-gather after the step writes the parameters in place.
* Reductions are SUM; each bucket's fold divides this rank's chunk by N as it
  writes it, so the shards hold the averaged gradient ([Note: one meaning for
  a gradient] in core/segments.py); the clipping coefficient is folded into
  the fused AdamW kernel.
* Stage 1 keeps a persistent full gradient buffer; ``p.grad`` are views into
  it and autograd accumulates there. Each bucket is reduce-scattered in place
  (this rank's chunk receives the sum over ranks); what the other ranks'
  chunks hold afterwards is zeroed only if a backward will add to it, and
  the buffer is never zeroed for a backward that writes it anew
  ([Note: stage-1 gradient buffer]).
* Stage 2 keeps only this rank's gradient shard. Autograd leaves each
  gradient in ``p.grad`` until every gradient of its bucket has arrived; the
  bucket's buffer is allocated only then (not at its first gradient, while
  the activations are still alive), the gradients are copied in and the
  ``p.grad`` freed, and the bucket is reduce-scattered into the shard (or
  into a transient shard that is then added, when the shard already holds an
  earlier micro-batch). The shard itself is allocated by the first reduction
  of a backward and freed by ``zero_grad(set_to_none=True)``, so on CUDA it
  is not held through the forward, where activations peak (on CPU its
  storage is kept for the next backward: [Note: bucket buffers between
  steps]). At most MAX_INFLIGHT_BUCKETS are in flight; their buffers are
  recycled within the backward and released at its end (CUDA; CPU keeps
  them), so stage 2 holds at most that many buckets of gradient (plus the
  loose gradients of buckets not yet complete) beyond its shard.
* Buckets are reduced in one fixed order on every rank: the order their last
  gradient arrived in during the first backward (on rank 0, broadcast to all
  at the end of that backward; before it, the reverse registration order).
  A bucket that completes early waits for the ones before it, and at the end
  of backward every bucket not yet reduced is (gradients that never arrived
  count as zero). So all ranks issue the same collectives in the same order,
  whatever order gradients arrive in and whichever parameters a rank left
  unused.
* After a backward outside no_sync() the reduced gradient lives in the
  shards; ``p.grad`` is then a placeholder whose operations run on them
  (see [Note: sharded gradients] in optim/grads.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import comm
from .flat import FlatBucket, build_flat, check_params, check_same_across_ranks, check_views
from ..comm.mesh import Groups, ShardGroup, shard_group
from ..offload import NO_OFFLOAD, HostCopies, Offload, Placement, Storage, offloaded_params
from ..core.pool import BufferPool
from ..core.reduction import MAX_INFLIGHT_BUCKETS, Reduction, ReductionPipeline
from .folds import AddToShardFold, InPlaceFold
from .param_gather import ParamGather
from ..core.hooks import check_dense_grad, weak_hook
from ..core.regions import Piece, Region, add_locations, empty_report
from ..core.segments import Segment, SegmentPiece
from ..core.source import GradState, ShardSource
from ..core.tensor_parallel import TensorParallel, expert_placements, local_tensor, settle

# [Note: bucket buffers between steps] Stage 2 copies each bucket's gradients
# into a pooled buffer (at most MAX_INFLIGHT_BUCKETS + 1 kept free). On CUDA the pool
# is emptied at the end of every backward, so no bucket buffer is alive at
# the next forward, when the activations peak; the caching allocator keeps
# the blocks, and the next backward gets them back at no cost. On CPU the
# pool is kept between steps, as DDP keeps its buckets: glibc hands blocks
# this large back to the OS, and touching fresh pages again cost more than
# the reduction itself, a sizeable share of the step. For the same reason, on
# CPU the gradient shard that zero_grad(set_to_none=True) drops keeps its
# storage for the next backward's first reduction, which overwrites all of it:
# faulting the whole shard's pages in again was a sizeable cost every step,
# against a small rise of the tensor peak, the shard now being alive through
# the forward (the figures are in benchmarks/history.md). memory_report()'s
# comm_buffers counts the pool (the shard is in "grads" either way), and the
# planner's CPU plans (transport="gloo") replay both.


class FlatReducer(ShardSource):
    """The ZeRO-1/2 source; see [Note: sharded optimizer policy] in this module."""

    def __init__(
        self,
        params: List[torch.Tensor],
        group_of: List[int],
        *,
        stage: int,
        adam: bool,
        bucket_bytes: int,
        reduce_dtype: Optional[torch.dtype],
        groups: Groups,
        offload: Offload = NO_OFFLOAD,
        overlap_param_gather: bool = False,
        whole: bool = False,
        names: Optional[List[Optional[str]]] = None,
        shards: Optional[List[Optional[ShardGroup]]] = None,
    ):
        super().__init__()
        self.params, self.group_of, self.stage = params, group_of, stage
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.bucket_bytes, self.reduce_dtype = bucket_bytes, reduce_dtype
        self.groups = groups
        self.process_group = process_group = groups.shard
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self._state = GradState.EMPTY
        self.steps_done = 0  # steps that updated the shards (names the collectives)
        self.arrived_since_zero = set()  # parameters with a gradient since zero_grad(set_to_none=True)
        # what the stage does around the one reduction pipeline ([Note: reduction pipeline])
        self.fold = InPlaceFold(self) if stage == 1 else AddToShardFold(self)
        self._pipeline = ReductionPipeline(self.fold, MAX_INFLIGHT_BUCKETS, self.comm_elements)
        # stage 2's bucket buffers, recycled ([Note: bucket buffers between steps])
        self.pool = BufferPool(MAX_INFLIGHT_BUCKETS + 1, lambda n, dt: torch.empty(n, dtype=dt, device=self.device))
        # each param group's ranks ([Note: param groups over their own ranks] in comm/mesh.py)
        dense = shard_group(process_group)
        self.shards = [s or dense for s in (shards or [None] * (max(group_of, default=0) + 1))]
        self.own_shards = [s for s in dict.fromkeys(self.shards) if s.own]
        # DTensors: local pieces sharded ([Note: tensor-parallel parameters], [Note: expert DTensors])
        own = {i for i, g in enumerate(group_of) if self.shards[g].own}
        self.tp = TensorParallel.of([None if i in own else p for i, p in enumerate(params)], groups.every, self.err)
        self.experts_placed = expert_placements(params, own, [self.shards[g].group for g in group_of], self.err)
        self.device = check_params(params, self.trainable, self.err)
        _check_tensor_parallel(self.tp, self.own_shards, whole, self.err)
        check_same_across_ranks(params, groups.every, self.err, names, [self.shards[g] for g in group_of])
        self.storage = Storage(offload, self.device, dist.get_rank(), self.err)
        offloaded = offloaded_params(params, self.trainable, offload)
        flat = build_flat(
            params,
            group_of,
            self.trainable,
            stage=stage,
            adam=adam,
            bucket_bytes=bucket_bytes,
            device=self.device,
            shards=self.shards,
            src=dist.get_global_rank(groups.every, 0),
            everyone=groups.every,
            storage=self.storage,
            offloaded=offloaded,
            whole=whole,
        )
        self._adopt(flat, params, overlap_param_gather)
        self._order_learned = False
        self._arrival: List[int] = []
        # the folds divide the sums by N, every data-parallel rank ([Note: one meaning for a gradient]),
        # for a param group over its own ranks too ([Note: param groups over their own ranks])
        self.divisor = dist.get_world_size(groups.every)
        self.check_finite = any(buf.dtype == torch.float16 for buf in self.buffers)
        with torch.no_grad():  # (a DTensor's: its local piece's)
            self.full_shapes = {i: local_tensor(params[i]).shape for i in self.trainable}
        self.regions, self.segments = _regions_and_segments(self, self.stage)
        self.host_copies = HostCopies(self.device)  # to the mirrors ([Note: offloaded gradients])
        on_grad = weak_hook(self._on_grad)
        self._hooks = [
            params[i].register_post_accumulate_grad_hook(lambda p, i=i: on_grad(i, p)) for i in self.trainable
        ]
        if stage == 1:  # [Note: stage-1 gradient buffer]
            self._hooks += [params[i].register_hook(weak_hook(self.fold.before_grad)) for i in self.trainable]

    def _adopt(self, flat, params: List[torch.Tensor], overlap_param_gather: bool):
        """The flat buffers ``build_flat`` made: their buckets, each with its reduction,
        and the gather of the parameters after a step."""
        self.buffers, self.buckets, self.where = flat.buffers, flat.buckets, flat.where
        # the layout of each shard group's parameters (the optimizer's ranks' first)
        self.layouts = flat.layouts
        self.layout = flat.layouts[0]
        self.launch_order, self.whole_owners = flat.launch_order, flat.whole_owners
        for b in self.buckets:
            b.reduction = Reduction(
                name=f"bucket {b.index}",
                owner=b,
                group=b.buffer.shard.group,
                replicate=self.groups.replicate,
                grad=b.buffer.reduced,
            )
        self._gather = ParamGather(
            self.buffers,
            params,
            self.where,
            overlap=overlap_param_gather,
            comm_elements=self.comm_elements,
            hook_factory=weak_hook,
        )

    # ------------------------------------------------------------------ setup
    def err(self, msg: str) -> str:
        return comm.on_rank(self, msg)

    def reduce_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``dtype`` parameters are reduced and held in."""
        return self.reduce_dtype or dtype

    # --------------------------------------------------------------- backward
    def _start_backward(self):
        check_views(self.params, self.trainable, self.where, self.err)
        self.settle()  # parameters no forward waited for: done before the reductions start
        for fn in self.backward_listeners:
            fn()
        self._state = GradState.BACKWARD
        for b in self.buckets:  # (a parameter frozen since construction takes no gradient)
            b.reduction.pending = sum(self.params[i].requires_grad for i in b.params)
        self._pipeline.start([self.buckets[b].reduction for b in self.launch_order])
        self.fold.backward_started()
        # runs once, when the whole backward pass has finished
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, i: int, p: torch.Tensor):
        check_dense_grad(p.grad, lambda: f"parameter {i} (shape {tuple(p.shape)})", self.err)
        if self.tp is not None:
            settle(p)
        if self._state != GradState.BACKWARD:
            self._start_backward()
        self.arrived_since_zero.add(i)
        sync = self._pipeline.sync
        if not self._order_learned and sync:
            self._arrival.append(i)
        self.fold.grad_arrived(i, p)
        if not sync:
            return
        for f in self.where[i].frags:
            r = self.buckets[f.bucket].reduction
            if r.launched:
                raise RuntimeError(
                    self.err(
                        f"parameter {i} received a gradient after its bucket {f.bucket} was reduced in this "
                        "backward pass (a second backward through the same parameters without a new "
                        "forward?); call backward once per forward, or accumulate under no_sync()"
                    )
                )
            self._pipeline.arrived(r)
        # launches every bucket now complete, in order (a tensor split over several
        # buckets recycles their buffers as it goes)
        self._pipeline.advance()

    def _finish_backward(self):
        sync = self._pipeline.sync
        self._pipeline.finish()
        if self.device.type != "cpu":  # [Note: bucket buffers between steps]
            self.pool.clear()
        if sync and not self._order_learned:
            self._learn_launch_order()
        self.host_copies.wait()  # the CPU step reads the mirrors
        self._state = GradState.READY if sync else GradState.EMPTY
        if sync:
            self.fold.synced()
            self.notify_grads_ready()

    def _learn_launch_order(self):
        self.launch_order = _arrival_order(self.buckets, self._arrival, self.groups.every)
        self._order_learned = True
        self._arrival = []

    # ------------------------------------------------------- ShardSource API
    def param_colors(self) -> Optional[List[tuple]]:
        if self.tp is not None:
            return self.tp.colors()
        if not self.own_shards:
            return None
        return [(s.color, s.count) for s in (self.shards[g] for g in self.group_of)]

    def param_process_group(self, i: int) -> dist.ProcessGroup:
        return self.shards[self.group_of[i]].group

    def tensor_parallel(self) -> Optional[TensorParallel]:
        return self.tp

    def expert_placements(self) -> Dict[int, object]:
        return self.experts_placed

    def grad_for(self, i: int, local: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """What ``p.grad`` of parameter ``i`` holds for the local gradient ``local`` (a
        DTensor parameter's: the DTensor over it)."""
        placed = self.experts_placed.get(i)
        if placed is not None and local is not None:
            return placed.wrap(local)
        return local if self.tp is None else self.tp.grad(i, local)

    def release(self):
        while self._hooks:
            self._hooks.pop().remove()

    def grads_ready(self) -> bool:
        return self._state == GradState.READY

    def in_backward(self) -> bool:
        return self._state == GradState.BACKWARD

    def arrived(self) -> List[int]:
        return sorted(self.arrived_since_zero)

    def no_sync(self):
        return self._pipeline.no_sync()

    def resting_grad(self, i: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Stage 1: the reduced gradient lives in the parameter's view of the buffer even
        where this rank gave it none, so a backward accumulating onto it adds there."""
        return self.grad_for(i, self.grad_view(i)) if self.stage == 1 and grad is None else grad

    def at_rest(self, i: int, grad: torch.Tensor) -> bool:
        """Stage 1: the parameter's view of the flat buffer (zero_grad(set_to_none=False) leaves it)."""
        if self.stage != 1:
            return False
        view, mine = self.grad_view(i), local_tensor(grad)
        return mine.data_ptr() == view.data_ptr() and mine.shape == view.shape

    @torch.no_grad()
    def allocate_grads(self):
        for buf in self.buffers:  # (stage 1's full buffer is always held)
            if self.stage == 2 and buf.reduced.tensor is None:
                shard, buf.spare_shard = buf.spare_shard, None
                if shard is None:
                    shard = torch.empty(buf.shard_numel, dtype=self.reduce_dtype_of(buf.dtype), device=self.device)
                buf.reduced.tensor = shard.zero_()
            if buf.grad_mirror is not None:
                buf.grad_mirror.zero_()

    def grad_view(self, i: int) -> torch.Tensor:
        """Stage 1: parameter ``i``'s view of its flat buffer's full gradient."""
        buf, offset = self.where[i].buffer, self.where[i].offset
        shape = self.full_shapes[i]
        return buf.grads[offset : offset + shape.numel()].view(shape)

    def step_done(self, updated: bool):
        if updated:
            self.steps_done += 1
            self.gather_params()
        self._state = GradState.EMPTY

    def gather_params(self):
        """All-gather every bucket's parameters in place from each rank's chunk (in
        flight after this returns with overlap_param_gather: [Note: overlapped parameter
        gather] in zero12/param_gather.py)."""
        self._gather.launch(self.steps_done)

    def settle(self):
        self._gather.settle()

    @torch.no_grad()
    def shards_loaded(self):
        self.settle()
        for buf in self.buffers:
            if buf.master is not None:
                for b in buf.buckets:
                    b.own(buf.params).copy_(b.shard_of(buf.master))
        self.gather_params()  # in place: no transient memory
        self.settle()

    @torch.no_grad()
    def params_loaded(self):
        self.settle()
        for buf in self.buffers:
            if buf.master is not None:
                for b in buf.buckets:
                    self.storage.copy_in(b.shard_of(buf.master), b.own(buf.params))

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool):
        for buf in self.buffers:
            if buf.grads is not None and not set_to_none:  # [Note: stage-1 gradient buffer]
                buf.grads.zero_()
            if set_to_none and self.stage == 2:  # the next backward allocates it again
                if self.device.type == "cpu" and buf.reduced.tensor is not None:
                    buf.spare_shard = buf.reduced.tensor  # [Note: bucket buffers between steps]
                buf.reduced.tensor = None
            elif self.stage == 2 and buf.reduced.tensor is not None:
                buf.reduced.tensor.zero_()
            if set_to_none:
                self.arrived_since_zero.clear()
        for i in self.trainable:
            p = self.params[i]
            if self.stage == 1 and not set_to_none:
                p.grad = self.grad_for(i, self.grad_view(i))
            else:
                p.grad = None
        self.fold.zeroed(set_to_none)
        self._state = GradState.EMPTY

    def memory_report(self, reset_peak: bool) -> Dict[str, int]:
        return _memory_report(self, reset_peak)


def _arrival_order(buckets: List[FlatBucket], arrival: List[int], everyone) -> List[int]:
    """The bucket order to reduce in from now on: the order their last gradient arrived
    in this backward (``arrival``); rank 0's order is used everywhere (every replica
    too: their all-reduces pair up bucket by bucket), so all ranks agree."""
    pos = {p: k for k, p in enumerate(arrival)}
    never = len(arrival)
    key = [max(pos.get(p, never) for p in b.params) for b in buckets]
    order = sorted(range(len(buckets)), key=lambda b: (key[b], b))
    if dist.get_world_size(everyone) > 1:
        order = comm.all_gather_object(order, group=everyone, what="bucket order")[0]
    return order


def _regions_and_segments(src: "FlatReducer", stage: int):
    """One region per bucket (what state dicts read) and one segment per bucket
    shard (what a fused call updates), with each parameter's piece of it."""
    regions = [
        Region(
            shard_numel=bk.shard_numel,
            exp_avg=_shard_of(bk, bk.buffer.exp_avg),
            exp_avg_sq=_shard_of(bk, bk.buffer.exp_avg_sq),
            frags=[Piece(i, fr.tensor_offset, fr.bucket_offset, fr.numel) for i, fr in bk.frags],
            values=bk.shard_of(bk.buffer.master) if bk.buffer.master is not None else bk.own(bk.buffer.params),
        )
        for bk in src.buckets
    ]
    region_of = {bk.index: reg for bk, reg in zip(src.buckets, regions)}
    for buf in src.buffers:  # a param group's own ranks: the region's chunks are theirs
        for b in buf.buckets if buf.shard.own else ():
            region_of[b.index].place = buf.shard.rank
    segments = []
    for buf in src.buffers:  # the host copy the CPU step reads ([Note: offloaded gradients])
        buf.grad_mirror = src.storage.grad_mirror(
            buf.placement, buf.shard_numel, buf.dtype if stage == 1 else src.reduce_dtype_of(buf.dtype)
        )
        rank = buf.shard.rank
        for b in buf.buckets:
            # stage 1: this rank's reduced chunk of the full gradient buffer; stage 2: the shard
            start = b.offset + rank * b.shard_numel if stage == 1 else b.shard_offset
            low = buf.master is not None
            segments.append(
                Segment(
                    group=buf.group,
                    param=b.shard_of(buf.master) if low else b.own(buf.params),
                    reduced=buf.reduced,
                    grad_range=(start, start + b.shard_numel),
                    exp_avg=_shard_of(b, buf.exp_avg),
                    exp_avg_sq=_shard_of(b, buf.exp_avg_sq),
                    out=b.own(buf.params) if low else None,
                    pieces=[
                        SegmentPiece(i, sl.start, sl.stop, t_off) for i, t_off, sl in region_of[b.index].owned(rank)
                    ],
                    streamed=src.storage.streamed(buf.placement),
                    mirror=_shard_of(b, buf.grad_mirror),
                )
            )
    return regions, segments


def _check_tensor_parallel(tp: Optional[TensorParallel], own_shards: list, whole: bool, err) -> None:
    """What tensor-parallel parameters do not combine with yet, refused by name."""
    if tp is None:
        return
    if own_shards:
        raise ValueError(
            err(
                "a param group over its own ranks ('device_mesh': expert parallelism) together with "
                "tensor-parallel (DTensor) parameters is not supported yet"
            )
        )
    if whole:
        tp.refuse_whole(err)


def _shard_of(b: FlatBucket, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else b.shard_of(t)


def _memory_report(src: "FlatReducer", reset_peak: bool) -> Dict[str, int]:
    """Bytes by category (see ShardedOptimizer.memory_report)."""
    rep = empty_report()
    for buf in src.buffers:
        full = sum(src.full_shapes[i].numel() for i in src.trainable if src.where[i].buffer is buf)
        item = buf.params.element_size()
        mine, shard_len = buf.shard_data_numel, buf.shard_numel
        rep["params"] += full * item
        rep["padding"] += (buf.params.numel() - full) * item
        if src.stage == 1:
            rep["grads"] += full * item
            rep["padding"] += (buf.grads.numel() - full) * item
        else:
            gi = src.reduce_dtype_of(buf.dtype).itemsize
            rep["grads"] += mine * gi
            rep["padding"] += (shard_len - mine) * gi
        if buf.grad_mirror is not None:  # its host copy ([Note: offloaded gradients])
            rep["grads"] += mine * buf.grad_mirror.element_size()
            rep["padding"] += (shard_len - mine) * buf.grad_mirror.element_size()
        for name in ("master", "exp_avg", "exp_avg_sq"):
            if getattr(buf, name) is not None:
                rep[name] += mine * 4
                rep["padding"] += (shard_len - mine) * 4
    rep["total"] = sum(rep.values())
    add_locations(
        rep,
        [(t, buf.placement) for buf in src.buffers for t in (buf.master, buf.exp_avg, buf.exp_avg_sq) if t is not None]
        + [(buf.grad_mirror, Placement.HOST) for buf in src.buffers if buf.grad_mirror is not None],
    )
    rep["comm_buffers"] = src.pool.live
    rep["comm_buffers_peak"] = src.pool.peak
    if reset_peak:
        src.pool.reset_peak()
    return rep
