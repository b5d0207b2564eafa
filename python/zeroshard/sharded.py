"""ZeRO-1 and ZeRO-2: ShardedOptimizer, a drop-in replacement for DDP + AdamW.

[Note: sharded optimizer policy]
* Layout. Trainable parameters are laid out in reverse registration order
  (the order backward produces their gradients) in flat buffers, one per
  (param group, dtype), cut into buckets of at most ``bucket_mb``
  (zeroshard.compute_layout). Every parameter becomes a view into its flat
  buffer, so the all-gather after the step writes the parameters in place.
* Reductions are SUM; the 1/N average (and the clipping coefficient) are
  folded into the fused AdamW kernel's gradient scale, so no extra pass runs.
* Stage 1 keeps a persistent full gradient buffer; ``p.grad`` are views into
  it and autograd accumulates there. Each bucket is reduce-scattered in place
  (this rank's chunk receives the sum over ranks) and the chunks of other
  ranks are zeroed afterwards, so later accumulation never counts a
  gradient twice.
* Stage 2 keeps only this rank's gradient shard. Autograd leaves each
  gradient in ``p.grad`` until every gradient of its bucket has arrived; the
  bucket's buffer is allocated only then (not at its first gradient, while
  the activations are still alive), the gradients are copied in and the
  ``p.grad`` freed, and the bucket is reduce-scattered into the shard (or
  into a transient shard that is then added, when the shard already holds an
  earlier micro-batch). The shard itself is allocated by the first reduction
  of a backward and freed by ``zero_grad(set_to_none=True)``, so it is not
  held through the forward, where activations peak. At most _MAX_INFLIGHT
  buckets are in flight; their buffers are recycled within the backward and
  released at its end, so stage 2 holds at most that many buckets of
  gradient (plus the loose gradients of buckets not yet complete) beyond its
  shard, and none between steps.
* Buckets are reduced in one fixed order on every rank: the order their last
  gradient arrived in during the first backward (on rank 0, broadcast to all
  at the end of that backward; before it, the reverse registration order).
  A bucket that completes early waits for the ones before it, and at the end of backward
  every bucket not yet reduced is (gradients that never arrived count as
  zero). So all ranks issue the same collectives in the same order, whatever
  order gradients arrive in and whichever parameters a rank left unused.
* ``p.grad`` after backward is not the averaged gradient (stage 1: partly
  reduced, stage 2: None); the reduced gradient lives in the shards. Use
  ``clip_grad_norm_`` of this optimizer, not torch.nn.utils'.
* Stage 3. Given parameters of a zeroshard.FullyShard model, the optimizer
  is a policy over the FullyShard's units instead of its own buffers: the
  units' fp32 shards are the master weights, their averaged gradient shards
  the gradients; it adds exp_avg/exp_avg_sq shards per unit, and after a step
  drops the units' gathered copies (the next forward gathers the new ones).
* Whatever the stage, the update runs over "segments" (a flat range of
  master, gradient and state shards with one set of hyperparameters: a
  bucket for stages 1/2, a run of a unit's parameters for stage 3), and the
  state dict over "regions" (a bucket or a unit: a range whose shards the
  ranks hold in rank order), so step, clipping and checkpoints are shared.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import math
import weakref
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional

import torch
import torch.distributed as dist

from . import comm
from ._ordered import OrderedReductions
from .fully_shard import _SUPPORTED, owner_of
from .kernels import fused_adamw_
from .layout import compute_layout, fill_flat

# At most this many buckets are being reduced at once: launching one more
# first retires the oldest (waits for it, folds it into the shard, recycles
# its buffer). Two keep the communication busy while backward continues and
# bound the transient gradient memory of stage 2 to two buckets.
_MAX_INFLIGHT = 2
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass
class _Bucket:
    index: int
    buffer: "_FlatBuffer"
    offset: int            # in the buffer
    numel: int             # padded
    shard_numel: int
    shard_offset: int      # where this bucket's shard starts in the buffer's shard tensors
    params: List[int] = field(default_factory=list)  # trainable-parameter indices with data here
    frags: List[tuple] = field(default_factory=list)   # (param index, layout fragment) in this bucket
    pending: int = 0       # parameters whose gradient has not arrived this backward
    grad: Optional[torch.Tensor] = None   # stage 2: transient bucket gradient (reduce dtype)
    handle: Optional[comm.CommHandle] = None
    reduce_out: Optional[torch.Tensor] = None  # where the reduce-scatter wrote
    launched: bool = False

    def own(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's chunk of a bucket-sized range of a buffer-sized tensor."""
        start = self.offset + rank * self.shard_numel
        return t[start:start + self.shard_numel]

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This bucket's piece of a shard-sized tensor."""
        return t[self.shard_offset:self.shard_offset + self.shard_numel]


@dataclass
class _FlatBuffer:
    group: int
    dtype: torch.dtype
    params: torch.Tensor                 # full flat parameters (every param is a view)
    master: Optional[torch.Tensor]       # fp32 shard, None when params are fp32
    exp_avg: torch.Tensor                # fp32 shard
    exp_avg_sq: torch.Tensor             # fp32 shard
    grad_shard: Optional[torch.Tensor]   # stage 2: reduced gradient shard (reduce dtype)
    grads: Optional[torch.Tensor]        # stage 1: full flat gradients (param dtype)
    buckets: List[_Bucket] = field(default_factory=list)
    shard_data_numel: int = 0            # elements of real parameters in this rank's shard


@dataclass
class _Segment:
    """A flat range updated by one fused AdamW launch."""
    group: int
    param: torch.Tensor        # fp32 master (or fp32 parameter) shard range
    grads: object              # holds the gradient: a _FlatBuffer (stages 1/2) or a FullyShard _Unit
    grad_attr: str             # its attribute holding the gradients ("grads" or "grad_shard")
    grad_range: tuple          # (start, stop) in that tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: Optional[torch.Tensor] = None   # low-precision parameter range to write

    @property
    def grad(self) -> torch.Tensor:
        """Looked up at each use: gradient shards are allocated by backward's
        reductions and freed by zero_grad(set_to_none=True)."""
        return getattr(self.grads, self.grad_attr)[self.grad_range[0]:self.grad_range[1]]


@dataclass
class _Region:
    """A range sharded over ranks in rank order (a bucket or a unit), for state dicts."""
    shard_numel: int
    exp_avg: torch.Tensor      # this rank's shard
    exp_avg_sq: torch.Tensor
    frags: List[tuple]         # (param index, offset in param, offset in region, numel)
    values: Optional[torch.Tensor] = None  # stages 1/2: this rank's master (or fp32 parameter)
                                           # shard; stage 3: None (the FullyShard units hold it)

    def owned(self, rank: int):
        """(param index, offset in the param, slice of the rank's shard) for each piece ``rank`` owns."""
        lo = rank * self.shard_numel
        for i, t_off, r_off, n in self.frags:
            a, b = max(lo, r_off), min(lo + self.shard_numel, r_off + n)
            if a < b:
                yield i, t_off + a - r_off, slice(a - lo, b - lo)


def _held_by_ddp(p: torch.Tensor) -> bool:
    """Whether a DistributedDataParallel module holds p (checked once, at construction).

    DDP keeps its parameters in the list attribute ``_module_parameters``,
    next to its ``reducer``; the list is referred to by the DDP instance's
    attribute dict."""
    for lst in gc.get_referrers(p):
        if isinstance(lst, list):
            for attrs in gc.get_referrers(lst):
                if isinstance(attrs, dict) and attrs.get("_module_parameters") is lst and "reducer" in attrs:
                    return True
    return False


class ShardedOptimizer(torch.optim.Optimizer):
    """AdamW with ZeRO stage 1 (sharded optimizer states) or 2 (also sharded gradients).

    Replaces ``DistributedDataParallel`` + ``torch.optim.AdamW``: do not wrap the
    model in DDP. Gradients are reduced bucket by bucket during backward; ``step()``
    updates this rank's shard with the fused AdamW kernel and all-gathers the
    parameters. See [Note: sharded optimizer policy] in this module.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, stage: int = 2, bucket_mb: float = 25,
                 process_group: Optional[dist.ProcessGroup] = None,
                 reduce_dtype: Optional[torch.dtype] = None):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r} (ZeRO-3 is zeroshard.FullyShard)")
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if reduce_dtype is not None and reduce_dtype not in _SUPPORTED:
            raise ValueError(f"reduce_dtype must be one of {_SUPPORTED}, got {reduce_dtype}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=None, capturable=False,
                        differentiable=False, fused=None)
        super().__init__(params, defaults)
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (torchrun sets it up)")
        self.stage = stage
        self.reduce_dtype = reduce_dtype
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._src = dist.get_global_rank(self.process_group, 0) if process_group is not None else 0
        self.last_step_skipped = False
        self.comm_elements = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
        # (what, index) of recent hooks, launches and steps, in order; bounded so
        # a long run does not grow it (tests/test_sharded.py reads it)
        self.events: Deque[tuple] = collections.deque(maxlen=4096)
        self._sync = True
        self._in_backward = False
        self._grads_ready = False
        self._clip_coef: Optional[torch.Tensor] = None
        self._steps = [0] * len(self.param_groups)
        self._peak_bucket_bytes = 0
        self._bucket_bytes = 0
        self._shard_fresh = True    # stage 2: grad shards hold nothing since zero_grad
        self._reductions = OrderedReductions(self._launch, self._retire, _MAX_INFLIGHT)
        self._free: Dict[tuple, List[torch.Tensor]] = {}   # recycled bucket buffers

        # every parameter, in state_dict index order
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._owners: list = []            # stage 3: the FullyShard models whose units we update
        self._unit_states: Dict[tuple, Dict[str, torch.Tensor]] = {}
        self._buffers: List[_FlatBuffer] = []
        self._trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        if not self._trainable:
            raise ValueError(self._err("no parameter requires grad; nothing to optimize"))
        self._trained_groups = {self._group_of[i] for i in self._trainable}
        owned = [owner_of(p) for p in self._params]
        if any(o is not None for o in owned):
            self._build_stage3(owned, process_group)
            return
        self._check_params()
        self._check_same_shapes_across_ranks()
        self._build()
        self._grad_scale = 1.0 / self.world_size
        self._check_finite = any(buf.dtype == torch.float16 for buf in self._buffers)
        self._full_shapes = {i: p.shape for i, p in enumerate(self._params)}
        self._segments = [
            _Segment(buf.group, b.shard(buf.master) if buf.master is not None else b.own(buf.params, self.rank),
                     buf, *self._grad_range(b), b.shard(buf.exp_avg), b.shard(buf.exp_avg_sq),
                     b.own(buf.params, self.rank) if buf.master is not None else None)
            for buf in self._buffers for b in buf.buckets]
        order = list(reversed(self._trainable))
        self._regions = [
            _Region(bk.shard_numel, bk.shard(bk.buffer.exp_avg), bk.shard(bk.buffer.exp_avg_sq),
                    [(order[fr.tensor], fr.tensor_offset, fr.bucket_offset, fr.numel)
                     for fr in (self.layout.fragments[f] for f in self.layout.buckets[bk.index].fragments)],
                    bk.shard(bk.buffer.master) if bk.buffer.master is not None
                    else bk.own(bk.buffer.params, self.rank))
            for bk in self._buckets]
        self._hooks = [self._params[i].register_post_accumulate_grad_hook(self._make_hook(i))
                       for i in self._trainable]

    # ------------------------------------------------------------------ setup
    def _err(self, msg: str) -> str:
        return f"[rank {self.rank}/{self.world_size}] {msg}"

    def _build_stage3(self, owned: list, process_group):
        """Stage 3: see [Note: sharded optimizer policy]."""
        for i, o in enumerate(owned):
            if o is None:
                raise ValueError(self._err(
                    f"parameter {i} (shape {tuple(self._params[i].shape)}) is not a FullyShard parameter but "
                    "others are; wrap the whole model in FullyShard (its root unit takes every parameter "
                    "outside the wrapped blocks) and pass model.parameters()"))
        if self.reduce_dtype is not None:
            raise ValueError(self._err("reduce_dtype is set by FullyShard's mixed_precision for FullyShard "
                                       "parameters; do not pass it to ShardedOptimizer"))
        owners = []
        for fs in owned:
            if all(fs is not o for o in owners):
                owners.append(fs)
        for fs in owners:
            if process_group is not None and fs.process_group is not process_group:
                raise ValueError(self._err(
                    "the FullyShard parameters are sharded over another process group than the one "
                    "given to ShardedOptimizer; pass the FullyShard's process_group (or none)"))
            if fs.process_group is not owners[0].process_group:
                raise ValueError(self._err("the parameters come from FullyShard models on different "
                                           "process groups; use one optimizer per process group"))
        self._owners = owners
        self.process_group = owners[0].process_group
        self.world_size, self.rank = owners[0].world_size, owners[0].rank
        self.device = owners[0]._device
        self.stage = 3
        self._grad_scale = 1.0
        self._check_finite = any(torch.float16 in (fs.param_dtype, fs.reduce_dtype) for fs in owners)
        group_of = {id(self._params[i]): self._group_of[i] for i in self._trainable}
        index_of = {id(p): i for i, p in enumerate(self._params)}
        self._full_shapes, self._segments, self._regions = {}, [], []
        for fs in owners:
            fs._optimizers.append(weakref.ref(self))
            for u in fs._units:
                mine = [q for q in u.trainable if id(q.sharded) in group_of]
                if not mine:
                    continue
                st = {n: torch.zeros(u.shard_numel, device=self.device) for n in ("exp_avg", "exp_avg_sq")}
                self._unit_states[(fs, u.index)] = st
                for q in mine:
                    self._full_shapes[index_of[id(q.sharded)]] = q.shape
                self._regions.append(_Region(u.shard_numel, st["exp_avg"], st["exp_avg_sq"],
                                             [(index_of[id(q.sharded)], 0, q.offset, q.numel) for q in mine]))
                # runs of consecutive pieces with one param group (padding between them is harmless:
                # zero parameters with zero gradients stay zero)
                pieces = sorted((q for q in u.params if q.sharded.numel() > 0), key=lambda q: q.shard_offset)
                for g, run in itertools.groupby(pieces, key=lambda q: group_of.get(id(q.sharded))):
                    if g is None:        # frozen, or not given to this optimizer
                        continue
                    run = list(run)
                    a, b = run[0].shard_offset, run[-1].shard_offset + run[-1].sharded.numel()
                    self._segments.append(_Segment(g, u.shard[a:b], u, "grad_shard", (a, b),
                                                   st["exp_avg"][a:b], st["exp_avg_sq"][a:b]))

    def _check_params(self):
        device = self._params[self._trainable[0]].device
        for i, p in enumerate(self._params):
            if p.device != device:
                raise ValueError(self._err(
                    f"parameter {i} is on {p.device} but parameter {self._trainable[0]} is on {device}; "
                    "move the whole model to one device before creating the optimizer"))
            if p.requires_grad and p.dtype not in _SUPPORTED:
                raise ValueError(self._err(
                    f"parameter {i} has dtype {p.dtype}; supported dtypes are float32, bfloat16, float16"))
        if device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(self._err(f"parameters are on {device}; ShardedOptimizer supports CPU and CUDA "
                                       "(and meta, for planning: zeroshard.plan)"))
        self.device = device
        if _held_by_ddp(self._params[self._trainable[0]]):
            raise ValueError(self._err(
                "the parameters belong to a model wrapped in DistributedDataParallel; DDP would "
                "all-reduce the gradients and ShardedOptimizer would reduce them again. Pass the "
                "unwrapped model's parameters (model.module.parameters()) and drop the DDP wrapper"))

    def _check_same_shapes_across_ranks(self):
        mine = [(tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for p in self._params]
        everyone = comm.all_gather_object(mine, group=self.process_group)
        ref = everyone[0]
        for r, theirs in enumerate(everyone):
            if len(theirs) != len(ref):
                raise ValueError(self._err(
                    f"rank {r} has {len(theirs)} parameters but rank 0 has {len(ref)}; every rank must "
                    "build the same model"))
            for i, (a, b) in enumerate(zip(theirs, ref)):
                if a != b:
                    raise ValueError(self._err(
                        f"parameter {i} differs across ranks: rank {r} has (shape, dtype, requires_grad) "
                        f"= {a} but rank 0 has {b}; every rank must build the same model"))

    def _build(self):
        order = list(reversed(self._trainable))        # backward order
        numels = [self._params[i].numel() for i in order]
        dtypes = [self._params[i].dtype for i in order]
        keys = [self._group_of[i] * 8 + _DTYPE_CODE[self._params[i].dtype] for i in order]
        self.layout = compute_layout(numels, dtypes, self.bucket_bytes, self.world_size, keys=keys)
        L, r, dev = self.layout, self.rank, self.device
        self._where: Dict[int, tuple] = {}  # param index -> (buffer, offset, fragments)
        self._buffers: List[_FlatBuffer] = []
        self._buckets: List[_Bucket] = [None] * len(L.buckets)
        # launch order until the first backward has shown the real one
        last = [max(L.fragments[f].tensor for f in lb.fragments) for lb in L.buckets]
        self._launch_order = sorted(range(len(L.buckets)), key=lambda b: (last[b], b))
        self._order_learned = False
        self._arrival: List[int] = []
        with torch.no_grad():
            for bi, lb in enumerate(L.buffers):
                first = order[lb.tensors[0]]
                dtype = self._params[first].dtype
                flat = torch.zeros(lb.numel, dtype=dtype, device=dev)
                for t in lb.tensors:
                    place, p = L.tensors[t], self._params[order[t]]
                    flat[place.offset:place.offset + place.numel].copy_(p.detach().reshape(-1))
                if self.world_size > 1:
                    dist.broadcast(flat, src=self._src, group=self.process_group)
                shard_len = lb.numel // self.world_size
                buf = _FlatBuffer(
                    group=self._group_of[first], dtype=dtype, params=flat, master=None,
                    exp_avg=torch.zeros(shard_len, device=dev), exp_avg_sq=torch.zeros(shard_len, device=dev),
                    grad_shard=None,    # stage 2: allocated by the first reduction of a backward
                    grads=torch.zeros(lb.numel, dtype=dtype, device=dev) if self.stage == 1 else None)
                shard_off = 0
                for b in lb.buckets:
                    lbk = L.buckets[b]
                    bucket = _Bucket(index=b, buffer=buf, offset=lbk.offset, numel=lbk.numel,
                                     shard_numel=lbk.shard_numel, shard_offset=shard_off)
                    bucket.frags = [(order[L.fragments[f].tensor], L.fragments[f]) for f in lbk.fragments]
                    bucket.params = sorted({i for i, _ in bucket.frags})
                    shard_off += lbk.shard_numel
                    buf.buckets.append(bucket)
                    self._buckets[b] = bucket
                if dtype != torch.float32:
                    buf.master = torch.cat([b.own(flat, r) for b in buf.buckets]).float()
                buf.shard_data_numel = sum(pc.numel for pc in L.shard_pieces(r)
                                           if L.tensors[pc.tensor].buffer == bi)
                self._buffers.append(buf)
                for t in lb.tensors:
                    place, i = L.tensors[t], order[t]
                    p = self._params[i]
                    p.data = flat[place.offset:place.offset + place.numel].view_as(p)
                    frags = [L.fragments[f] for f in place.fragments]
                    self._where[i] = (buf, place.offset, frags)
                    if self.stage == 1:
                        p.grad = None
            # frozen parameters are not sharded, but all ranks start identical
            for i, p in enumerate(self._params):
                if not p.requires_grad and self.world_size > 1:
                    dist.broadcast(p.data, src=self._src, group=self.process_group)

    def _reduce_dtype(self, dtype):
        return self.reduce_dtype or dtype

    # --------------------------------------------------------------- backward
    def _make_hook(self, i: int):
        def hook(p: torch.Tensor):
            self._on_grad(i, p)
        return hook

    def _start_backward(self):
        self._in_backward = True
        self._reductions.start([self._buckets[b] for b in self._launch_order])
        self.events.append(("backward_start", -1))
        for b in self._buckets:
            b.pending, b.launched = len(b.params), False
        # stage 2: buckets still to copy each parameter's gradient (then it is freed)
        self._copies_left = {i: len(self._where[i][2]) for i in self._trainable}
        # runs once, when the whole backward pass has finished
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, i: int, p: torch.Tensor):
        if not self._in_backward:
            self._start_backward()
        self.events.append(("grad", i))
        if not self._order_learned and self._sync:
            self._arrival.append(i)
        buf, offset, frags = self._where[i]
        if self.stage == 1:
            view = buf.grads[offset:offset + p.numel()].view_as(p)
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)   # p.grad was replaced or re-created: it holds the total
                p.grad = view
        if not self._sync:
            return
        for f in frags:
            bucket = self._buckets[f.bucket]
            if bucket.launched:
                raise RuntimeError(self._err(
                    f"parameter {i} received a gradient after its bucket {f.bucket} was reduced in this "
                    "backward pass (a second backward through the same parameters without a new "
                    "forward?); call backward once per forward, or accumulate under no_sync()"))
            bucket.pending -= 1
        # launches every bucket now complete, in order (a tensor split over several
        # buckets recycles their buffers as it goes)
        self._reductions.advance()

    def _launch(self, b: _Bucket):
        """Reduce-scatter (SUM) one bucket; see [Note: sharded optimizer policy]."""
        buf, r = b.buffer, self.rank
        rdt = self._reduce_dtype(buf.dtype)
        if self.stage == 1:
            src = buf.grads[b.offset:b.offset + b.numel]
            if src.dtype != rdt:       # reduce in reduce_dtype, store back in the grad dtype
                src = src.to(rdt)
        else:
            src = b.grad = self._acquire(b.numel, rdt)
            # gradients that never arrived on this rank count as zero, as does padding
            fill_flat(src, [(f.bucket_offset, self._params[i].grad.detach().reshape(-1)[
                f.tensor_offset:f.tensor_offset + f.numel]) for i, f in b.frags if self._params[i].grad is not None])
            for i, _ in b.frags:
                self._copies_left[i] -= 1
                if self._copies_left[i] == 0:
                    self._params[i].grad = None
        # In place into this rank's chunk of the input, except that a stage-2 shard
        # holding nothing yet receives the result directly; _retire folds it in.
        if self.stage == 2 and buf.grad_shard is None:   # freed by zero_grad(set_to_none=True)
            # every bucket writes its whole piece of the shard: no zeroing needed
            buf.grad_shard = torch.empty(buf.exp_avg.numel(), dtype=rdt, device=self.device)
        out = (b.shard(buf.grad_shard) if self.stage == 2 and self._shard_fresh
               else src[r * b.shard_numel:(r + 1) * b.shard_numel])
        b.reduce_out = out
        # the input is never needed afterwards: stage 1 zeroes the other ranks'
        # chunks after the reduction, stage 2's bucket buffer is recycled
        b.handle = comm.reduce_scatter(src, out, group=self.process_group, average=False,
                                       input_is_scratch=True)
        b.launched = True
        self.comm_elements["reduce_scatter"] += b.numel
        self.events.append(("reduce_scatter", b.index))

    def _acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A bucket buffer (uninitialised: _launch writes every element), recycled
        when one of this size is free."""
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self._bucket_bytes += t.numel() * t.element_size()
        self._peak_bucket_bytes = max(self._peak_bucket_bytes, self._bucket_bytes)
        return t

    def _retire(self, b: _Bucket):
        """Wait for a bucket's reduce-scatter and fold its result into the shard."""
        b.handle.wait()
        buf = b.buffer
        if self.stage == 1:
            own = b.own(buf.grads, self.rank)
            if b.reduce_out.data_ptr() != own.data_ptr():
                own.copy_(b.reduce_out)
            # other ranks' chunks were sent: zero them so they are never counted twice
            whole = buf.grads[b.offset:b.offset + b.numel]
            whole[:self.rank * b.shard_numel].zero_()
            whole[(self.rank + 1) * b.shard_numel:].zero_()
        else:
            if b.reduce_out.data_ptr() != b.shard(buf.grad_shard).data_ptr():
                b.shard(buf.grad_shard).add_(b.reduce_out)
            if sum(len(v) for v in self._free.values()) < _MAX_INFLIGHT + 1:
                self._free.setdefault((b.numel, b.grad.dtype), []).append(b.grad)
            else:   # enough kept for reuse: release it
                self._bucket_bytes -= b.grad.numel() * b.grad.element_size()
            b.grad = None
        b.handle, b.reduce_out = None, None

    def _finish_backward(self):
        self._reductions.advance(flush=self._sync)
        self._reductions.drain()
        # Bucket buffers are recycled within a backward only: none is held
        # between steps, so none is alive at the start of the next backward,
        # when the activations peak.
        for bufs in self._free.values():
            self._bucket_bytes -= sum(t.numel() * t.element_size() for t in bufs)
        self._free.clear()
        if self._sync and not self._order_learned:
            self._learn_launch_order()
        if self._sync:
            self._shard_fresh = False
            self._grads_ready = True
        self._in_backward = False
        self.events.append(("backward_end", -1))

    def _learn_launch_order(self):
        """Reduce buckets from now on in the order their last gradient arrived in
        this backward; rank 0's order is used everywhere, so all ranks agree."""
        pos = {p: k for k, p in enumerate(self._arrival)}
        never = len(self._arrival)
        key = [max(pos.get(p, never) for p in b.params) for b in self._buckets]
        order = sorted(range(len(self._buckets)), key=lambda b: (key[b], b))
        if self.world_size > 1:
            order = comm.all_gather_object(order, group=self.process_group)[0]
        self._launch_order = order
        self._order_learned = True
        self._arrival = []

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication; the next backward
        outside this context reduces everything accumulated since the last step."""
        old, self._sync = self._sync, False
        try:
            with contextlib.ExitStack() as stack:
                for fs in self._owners:
                    stack.enter_context(fs.no_sync())
                yield
        finally:
            self._sync = old

    # ------------------------------------------------------------------ step
    def _grad_range(self, b: _Bucket):
        """(attribute of the bucket's _FlatBuffer, (start, stop)) of this rank's reduced gradient of b."""
        if self.stage == 1:
            start = b.offset + self.rank * b.shard_numel
            return "grads", (start, start + b.shard_numel)
        return "grad_shard", (b.shard_offset, b.shard_offset + b.shard_numel)

    def _check_ready(self, what: str):
        if self.device.type == "meta":
            raise RuntimeError(self._err(
                f"{what} on parameters on the meta device: they have no data (an optimizer over meta "
                "parameters is for planning, as zeroshard.plan does); build or materialize the model "
                "on CPU or CUDA to train"))
        ready = all(fs._grads_ready for fs in self._owners) if self._owners else self._grads_ready
        if not ready:
            raise RuntimeError(self._err(
                f"{what} called before any backward() since the last step (or only under no_sync()); "
                "run loss.backward() outside no_sync() first"))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of the averaged gradient, over every shard of
        every rank; returns that norm (the same on all ranks). The scale is
        applied inside the fused step."""
        self._check_ready("clip_grad_norm_")
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise NotImplementedError(f"norm_type {norm_type}: only 2 and inf are supported")
        parts = [seg.grad.float() for seg in self._segments] or [torch.zeros(1, device=self.device)]
        if norm_type == 2.0:
            local = torch.stack([t.pow(2).sum() for t in parts]).sum().reshape(1)
        else:
            local = torch.stack([t.abs().max() for t in parts]).max().reshape(1)
        if norm_type == 2.0:
            self._all_reduce(local)
            total = local.sqrt() * self._grad_scale
        else:
            every = local.new_zeros(self.world_size)
            every[self.rank:self.rank + 1].copy_(local)
            comm.all_gather(every[self.rank:self.rank + 1], every, group=self.process_group).wait()
            total = every.max().reshape(1) * self._grad_scale
        self._clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).float()
        return total.reshape(())

    def _all_reduce(self, t: torch.Tensor):
        comm.all_reduce(t, group=self.process_group).wait()
        self.comm_elements["all_reduce"] += t.numel()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_ready("step()")
        self.last_step_skipped = False
        if self._check_finite:
            found = torch.zeros(1, device=self.device)
            for seg in self._segments:
                found += (~torch.isfinite(seg.grad)).any()
            self._all_reduce(found)
            self.last_step_skipped = bool(found.item() > 0)   # the fp16 path syncs here
        if not self.last_step_skipped:
            for gi, group in enumerate(self.param_groups):
                self._update_group(gi, group)
            self._gather_params()
        for fs in self._owners:      # stage 3: gathered copies are stale; the next forward gathers
            fs._invalidate()
            fs._grads_ready = False
        self._clip_coef = None
        self._grads_ready = False
        self.events.append(("step", -1))
        return loss

    def _gather_params(self):
        """Stages 1/2: all-gather every bucket's parameters in place from each rank's
        chunk; all gathers in flight at once, then wait."""
        handles = []
        for buf in self._buffers:
            for b in buf.buckets:
                region = buf.params[b.offset:b.offset + b.numel]
                handles.append(comm.all_gather(b.own(buf.params, self.rank), region,
                                               group=self.process_group))
                self.comm_elements["all_gather"] += b.numel
        for h in handles:
            h.wait()

    @torch.no_grad()
    def _shards_loaded(self, steps: List[int]):
        """After a checkpoint wrote this rank's region values and states: set the
        step counts and rebuild everything derived from the shards (stages 1/2:
        the low-precision chunks and the full parameters; stage 3: drop the
        units' gathered copies)."""
        self._steps = list(steps)
        for fs in self._owners:
            fs._invalidate()
        if self._owners:
            return
        for buf in self._buffers:
            if buf.master is not None:
                for b in buf.buckets:
                    b.own(buf.params, self.rank).copy_(b.shard(buf.master))
        self._gather_params()     # in place: no transient memory

    def _update_group(self, gi: int, group: dict):
        segs = [seg for seg in self._segments if seg.group == gi]
        if group.get("amsgrad") or group.get("maximize"):
            raise NotImplementedError("amsgrad and maximize are not supported by ShardedOptimizer")
        if gi not in self._trained_groups:
            return
        self._steps[gi] += 1
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], step=self._steps[gi],
                     grad_scale=self._grad_scale, scale=self._clip_coef)
        for with_out in (False, True):   # one call each: one kernel launch per segment
            part = [seg for seg in segs if (seg.out is not None) == with_out]
            if part:
                fused_adamw_([s.param for s in part], [s.grad for s in part], [s.exp_avg for s in part],
                             [s.exp_avg_sq for s in part], outs=[s.out for s in part] if with_out else None,
                             **hyper)

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients (and this rank's reduced shards)."""
        if self._in_backward:
            raise RuntimeError(self._err("zero_grad() called during backward"))
        for fs in self._owners:
            fs.zero_grad(set_to_none)
        if self._owners:
            self._clip_coef = None
            return
        with torch.no_grad():
            for buf in self._buffers:
                if buf.grads is not None:
                    buf.grads.zero_()
                if set_to_none:     # stage 2: the next backward allocates it again
                    buf.grad_shard = None
                elif buf.grad_shard is not None:
                    buf.grad_shard.zero_()
        for i in self._trainable:
            p = self._params[i]
            if self.stage == 1 and not set_to_none:
                buf, offset, _ = self._where[i]
                p.grad = buf.grads[offset:offset + p.numel()].view_as(p)
            else:
                p.grad = None
        self._shard_fresh = True
        self._grads_ready = False
        self._clip_coef = None

    # ---------------------------------------------------------------- memory
    def memory_report(self, reset_peak: bool = False) -> Dict[str, int]:
        """Bytes held on this rank, by category.

        Persistent: ``params`` (full, stages 1 and 2), ``grads`` (stage 1: full;
        stage 2: this rank's shard, held from backward's first reduction to
        ``zero_grad(set_to_none=True)`` and counted whether held at the moment
        or not), ``master`` (fp32 shard, only for bf16/fp16 parameters),
        ``exp_avg`` and ``exp_avg_sq`` (fp32 shards): each counts only elements
        of real parameters. ``padding`` is every byte the layout adds to them.
        ``comm_buffers`` is the bucket memory held for reductions (stage 2:
        buckets being filled or in flight, recycled within a backward and
        released at its end) and ``comm_buffers_peak`` its peak since
        construction or the last call with ``reset_peak=True``. ``total`` is
        the persistent sum including padding.
        """
        if self._owners:   # stage 3: the FullyShard models' reports (they include our states)
            reports = [fs.memory_report(reset_peak=reset_peak) for fs in self._owners]
            return {k: sum(r[k] for r in reports) for k in reports[0]}
        rep = dict(params=0, grads=0, master=0, exp_avg=0, exp_avg_sq=0, padding=0)
        for buf in self._buffers:
            full = sum(self._params[i].numel() for i in self._trainable
                       if self._where[i][0] is buf)
            item = buf.params.element_size()
            mine, shard_len = buf.shard_data_numel, buf.exp_avg.numel()
            rep["params"] += full * item
            rep["padding"] += (buf.params.numel() - full) * item
            if self.stage == 1:
                rep["grads"] += full * item
                rep["padding"] += (buf.grads.numel() - full) * item
            else:
                gi = self._reduce_dtype(buf.dtype).itemsize
                rep["grads"] += mine * gi
                rep["padding"] += (shard_len - mine) * gi
            for name in ("master", "exp_avg", "exp_avg_sq"):
                t = getattr(buf, name)
                if t is not None:
                    rep[name] += mine * 4
                    rep["padding"] += (shard_len - mine) * 4
        rep["total"] = sum(rep.values())
        rep["comm_buffers"] = self._bucket_bytes
        rep["comm_buffers_peak"] = self._peak_bucket_bytes
        if reset_peak:
            self._peak_bucket_bytes = self._bucket_bytes
        return rep

    # ------------------------------------------------------------ state dict
    def _layout_signature(self) -> list:
        """What a sharded state dict is only valid for: world size, rank, stage and every region's cut."""
        return [self.world_size, self.rank, self.stage,
                [[reg.shard_numel, [list(f) for f in reg.frags]] for reg in self._regions]]

    @torch.no_grad()
    def sharded_state_dict(self) -> dict:
        """This rank's shard of the optimizer state, without communication: fast
        to save (e.g. ``torch.save`` per rank) and exact (stages 1/2 include the
        fp32 master of bf16/fp16 parameters). It loads back only with
        ``load_sharded_state_dict`` into the same layout (same model, world size,
        rank, stage and bucket_mb); to change any of those use ``state_dict()``
        or ``zeroshard.save_checkpoint``. The tensors are views of the live
        state (stages 1/2: ``values`` is this rank's chunk of the fp32 master or
        of the fp32 parameters) on its device: copy them (or save) before the
        next step."""
        state = {}
        for k, reg in enumerate(self._regions):
            state[f"{k}.exp_avg"], state[f"{k}.exp_avg_sq"] = reg.exp_avg, reg.exp_avg_sq
            if reg.values is not None:
                state[f"{k}.values"] = reg.values
        return {"format": "zeroshard-sharded-optimizer", "layout": self._layout_signature(),
                "steps": list(self._steps), "param_groups": super().state_dict()["param_groups"],
                "state": state}

    def _take_hyperparameters(self, groups: list):
        """Each param group takes the saved group's hyperparameters (everything but its params)."""
        for g, sg in zip(self.param_groups, groups):
            g.update((k, v) for k, v in sg.items() if k != "params")
            if g.get("amsgrad") or g.get("maximize"):
                raise NotImplementedError("amsgrad and maximize are not supported by ShardedOptimizer")

    def _sharded_mismatch(self, sharded) -> Optional[str]:
        if not isinstance(sharded, dict) or sharded.get("format") != "zeroshard-sharded-optimizer":
            return "it is not a sharded state dict of ShardedOptimizer (load_state_dict takes full ones)"
        mine, theirs = self._layout_signature(), sharded["layout"]
        for name, a, b in zip(("world size", "rank", "stage"), mine[:3], theirs[:3]):
            if a != b:
                return f"it was saved with {name} {b}, this optimizer has {a}"
        if mine[3] != theirs[3]:
            return "it was saved with another flat layout (other parameters, param groups or bucket_mb)"
        return None

    @torch.no_grad()
    def load_sharded_state_dict(self, sharded: dict):
        """Load what ``sharded_state_dict()`` returned on this rank, into the same
        layout. Collective: every rank calls it with its own dict; if any rank's
        does not match its layout, every rank raises, naming the rank and what
        differs. Stages 1/2 restore the parameters too (each rank's chunk, then
        an all-gather); stage 3's are the model's: load the model's state first."""
        problems = comm.all_gather_object(self._sharded_mismatch(sharded), group=self.process_group)
        bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
        if bad:
            raise ValueError(self._err(
                "cannot load the sharded state dict (" + "; ".join(bad) + "); a sharded state dict loads "
                "only into the layout it was saved from: use state_dict()/load_state_dict() or "
                "zeroshard.save_checkpoint/load_checkpoint to change world size, stage or layout"))
        self._take_hyperparameters(sharded["param_groups"])
        for k, reg in enumerate(self._regions):
            reg.exp_avg.copy_(sharded["state"][f"{k}.exp_avg"])
            reg.exp_avg_sq.copy_(sharded["state"][f"{k}.exp_avg_sq"])
            if reg.values is not None:
                reg.values.copy_(sharded["state"][f"{k}.values"])
        self._shards_loaded(list(sharded["steps"]))

    @torch.no_grad()
    def state_dict(self, to: Optional[int] = None):
        """The full state in torch.optim.AdamW's format (loadable by AdamW over the
        unwrapped model's parameters, in the same order).

        Collective: every rank must call it. Gathers one region (bucket, or
        unit for FullyShard parameters) at a time, so the transient extra memory
        is one region; the result is on CPU. With ``to=r`` only global rank
        ``r`` builds and returns the dict; the others return None.
        """
        keep = to is None or dist.get_rank() == to
        packed = super().state_dict()   # param_groups with indices; our torch state is empty
        full = {}
        if keep:
            for i in self._trainable:
                full[i] = {"step": torch.tensor(float(self._steps[self._group_of[i]])),
                           "exp_avg": torch.zeros(self._full_shapes[i], dtype=torch.float32),
                           "exp_avg_sq": torch.zeros(self._full_shapes[i], dtype=torch.float32)}
        for reg in self._regions:
            for name in ("exp_avg", "exp_avg_sq"):
                gathered = torch.empty(reg.shard_numel * self.world_size, dtype=torch.float32,
                                       device=self.device)
                comm.all_gather(getattr(reg, name), gathered, group=self.process_group).wait()
                if not keep:
                    continue
                gathered = gathered.cpu()
                for i, t_off, r_off, n in reg.frags:
                    full[i][name].view(-1)[t_off:t_off + n] = gathered[r_off:r_off + n]
        if not keep:
            return None
        packed["state"] = full
        return packed

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict):
        """Load a full AdamW state dict (ours or torch.optim.AdamW's, from any world
        size), keeping only this rank's shard. Parameters come from the model:
        load the model's state dict first; bf16/fp16 master weights are re-made
        from the parameters."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(self._err(
                f"the state dict has {len(groups)} param groups but this optimizer has "
                f"{len(self.param_groups)}"))
        for gi, (g, sg) in enumerate(zip(self.param_groups, groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(self._err(
                    f"param group {gi} has {len(sg['params'])} parameters in the state dict but "
                    f"{len(g['params'])} here"))
        self._take_hyperparameters(groups)
        saved_ids = [pid for sg in groups for pid in sg["params"]]
        state = state_dict["state"]
        steps = [0] * len(self.param_groups)
        for i in self._trainable:
            st = state.get(saved_ids[i])
            if st is None:
                continue
            numel = self._full_shapes[i].numel()
            for name in ("exp_avg", "exp_avg_sq"):
                if st[name].numel() != numel:
                    raise ValueError(self._err(
                        f"state of parameter {i}: {name} has {st[name].numel()} elements but the "
                        f"parameter has {numel} (shape {tuple(self._full_shapes[i])}); the state dict "
                        "is of another model"))
            steps[self._group_of[i]] = max(steps[self._group_of[i]], int(float(st["step"])))
        for reg in self._regions:
            reg.exp_avg.zero_()
            reg.exp_avg_sq.zero_()
            for i, start, sl in reg.owned(self.rank):
                st = state.get(saved_ids[i])
                if st is None:
                    continue
                for name in ("exp_avg", "exp_avg_sq"):
                    getattr(reg, name)[sl].copy_(st[name].reshape(-1)[start:start + sl.stop - sl.start])
        self._steps = steps
        for buf in self._buffers:
            if buf.master is not None:
                buf.master.copy_(torch.cat([b.own(buf.params, self.rank) for b in buf.buckets]).float())
