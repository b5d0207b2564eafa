"""The shard-source interface: what the update engine (ShardedOptimizer) needs
from a gradient source, and the two records it is made of.

[Note: shard sources] The optimizer has no stage branches. A *source* owns
the sharded tensors of one way of producing gradients and says what to
update:
* ``zero12.reducer.FlatReducer`` (ZeRO-1/2): flat buffers cut into buckets,
  reduced by backward hooks; the optimizer's own master and state shards.
* ``zero3.source.UnitSource`` (ZeRO-3): the units of one or more FullyShard
  models; their fp32 shards are the master weights.
Both yield *segments* (flat ranges updated by one fused AdamW call: master
or fp32 parameter shard, gradient shard, state shards, param group,
optional low-precision output) and *regions* (ranges sharded over the ranks
in rank order, which state dicts and checkpoints read), say when gradients
are ready, and are told when a step is done.
"""
from __future__ import annotations

import abc
import contextlib
import enum
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from ..comm.mesh import Groups
from ..offload import Placement, Storage
from ..native.layout import chunk_span

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)   # parameter, gradient and reduce dtypes

# memory_report()'s persistent categories, bytes on this rank; "total" is their sum. Every
# report (ZeRO-1/2, FullyShard) and the planner use this one schema.
PERSISTENT = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "padding")
# where the persistent bytes live: "device" (with the parameters), "host", "disk"
# (offloaded state, see [Note: offload] in offload/policy.py); their sum is "total"
LOCATIONS = ("device", "host", "disk")


def empty_report() -> Dict[str, int]:
    return dict.fromkeys(PERSISTENT, 0)


def add_locations(rep: Dict[str, int], placed) -> Dict[str, int]:
    """Sets ``rep``'s LOCATIONS from its ``total`` and the state tensors (all of them,
    padding included) with where each was placed: (tensor, Placement) pairs."""
    for loc in LOCATIONS:
        rep[loc] = 0
    for t, where in placed:
        if where is not Placement.DEVICE:
            rep[where.value] += t.numel() * t.element_size()
    rep["device"] = rep["total"] - rep["host"] - rep["disk"]
    return rep


def weak_hook(method):
    """``method`` (bound) as a tensor hook that does not keep its object alive: hooks
    are held by the parameters' autograd metadata, out of the garbage collector's
    sight, so a strong reference would keep an optimizer (and its state) alive
    for as long as the model lives, and its offload file on disk."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        fn = ref()
        return None if fn is None else fn(*args)
    return hook


def remove_hooks(hooks: list) -> None:
    """Remove every handle in ``hooks`` (emptying the list, which a weakref.finalize may hold)."""
    while hooks:
        hooks.pop().remove()


class GradState(enum.Enum):
    """Where a gradient source stands between two steps (both sources use it)."""
    EMPTY = "empty"        # no reduced gradients to step on: after a step, zero_grad, or a no_sync() backward
    BACKWARD = "backward"  # a backward is running
    READY = "ready"        # a backward outside no_sync() finished: the shards hold the reduced gradients


def check_dense_grad(grad: torch.Tensor, what: Callable[[], str], err: Callable[[str], str]) -> None:
    """Refuse a sparse gradient of parameter ``what()`` (e.g. from ``nn.Embedding(sparse=True)``);
    the name is made only then: this runs once per parameter every backward."""
    if grad.layout != torch.strided:
        raise RuntimeError(err(
            f"{what()} got a sparse gradient ({grad.layout}): zeroshard reduces dense gradients in flat "
            "buffers. Build its module with sparse=False (nn.Embedding, nn.EmbeddingBag), or keep the "
            "parameter out of the optimizer"))


def squared_norms(views: List[torch.Tensor]) -> torch.Tensor:
    """Each view's squared 2-norm, in fp32: one foreach kernel on CUDA (a norm and a
    square per view cost every step two launches per parameter, ~300 at GPT-2's 148
    parameters, whose host time falls at the end of the backward), as torch's clip_grad_norm_ does."""
    return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).square()


class GradHolder(Protocol):
    """What holds a segment's gradient: a ZeRO-1/2 flat buffer, a ZeRO-3 unit.

    [Note: one meaning for a gradient] Whatever the stage, the gradient a segment
    reads is the *averaged* gradient: the mean over every rank it was reduced over
    (replicas included), in the reduce dtype, as DDP's ``p.grad`` holds it
    (FullyShard's ``set_gradient_divide_factor`` changes the divisor, as FSDP2's).
    Each fold divides as it writes (zero12/folds.py, zero3/fold.py), so the update
    rules, the statistics, ``p.grad`` reads and anything later (a quantized
    reduction's error feedback, a gradient shard written to disk) take it as it is:
    no scale travels with it."""
    reduced_grads: Optional[torch.Tensor]   # the averaged gradient (None: not allocated)
    grad_sumsq: Optional[dict]              # see Segment.norms_taken


@dataclass(kw_only=True)
class Segment:
    """A flat range updated by one fused AdamW call."""
    group: int                 # param group index
    param: torch.Tensor        # fp32 master (or fp32 parameter) shard range
    # the record holding the averaged gradient (a GradHolder: its ``reduced_grads``, allocated and
    # freed as backward and zero_grad go, [Note: one meaning for a gradient]), and the range in it
    holder: "GradHolder"
    grad_range: tuple          # (start, stop) in that tensor
    exp_avg: Optional[torch.Tensor] = None      # the fused AdamW's state (None for another optimizer_class)
    exp_avg_sq: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None   # low-precision parameter range to write, or None
    # (param index, start, stop, offset in the flattened parameter): each trainable
    # parameter's range within this segment
    pieces: List[tuple] = field(default_factory=list)
    streamed: bool = False     # the state is offloaded: stepped window by window ([Note: offload])
    # ZeRO-1/2, state the CPU steps: the host copy of the gradient, refreshed as backward
    # reduces it, that the step reads ([Note: offloaded gradients] in offload/copies.py)
    mirror: Optional[torch.Tensor] = None
    # ZeRO-3, gradient shards in host memory: the holder's ``grad_sumsq`` maps a piece's offset
    # in the shard to its squared norm, taken on the device before the copy to host (None: not
    # taken this backward)
    norms_taken: bool = False

    @property
    def grad(self) -> torch.Tensor:
        """Looked up at each use: gradient shards are allocated by backward's
        reductions and freed by zero_grad(set_to_none=True)."""
        return self.holder.reduced_grads[self.grad_range[0]:self.grad_range[1]]

    @property
    def has_grad(self) -> bool:
        """Whether the gradient tensor is allocated (no backward since zero_grad(set_to_none=True): not)."""
        return self.holder.reduced_grads is not None

    def sumsq_before_copy(self, a: int, b: int) -> Optional[torch.Tensor]:
        """The squared norm of the gradient's range [a, b) (one piece), as taken on the
        device before its copy to host memory this backward; None if it was not."""
        taken = self.holder.grad_sumsq if self.norms_taken else None
        return None if taken is None else taken.get(self.grad_range[0] + a)

    def grad_views(self, a: int, b: int) -> List[torch.Tensor]:
        """Every copy of the gradient's range [a, b) an in-place change must reach."""
        return [self.grad[a:b]] + ([] if self.mirror is None else [self.mirror[a:b]])


def update_parts(segments: List[Segment], used: List[bool], steps: List[int]) -> List[tuple]:
    """What one step updates: ``(param group, step count after this step, streamed,
    (param, grad, exp_avg, exp_avg_sq, out))`` per flat range. As torch's AdamW: a
    parameter no rank gave a gradient (``used[i]`` false) is not updated, and each
    parameter's own step count sets its bias correction. A segment whose
    parameters all step with one count is updated whole (padding included: zeros
    stay zero); otherwise piece by piece."""
    parts: List[tuple] = []
    for seg in segments:
        if not seg.pieces:
            continue
        ids = [i for i, *_ in seg.pieces]
        if all(used[i] and steps[i] == steps[ids[0]] for i in ids):
            ranges = [(ids[0], 0, seg.param.numel())]
        else:
            ranges = [(i, a, b) for i, a, b, _ in seg.pieces if used[i]]
        grad = seg.grad if seg.mirror is None else seg.mirror
        for i, a, b in ranges:
            parts.append((seg.group, steps[i] + 1, seg.streamed,
                          (seg.param[a:b], grad[a:b], seg.exp_avg[a:b], seg.exp_avg_sq[a:b],
                           None if seg.out is None else seg.out[a:b])))
    return parts


class Piece(NamedTuple):
    """A parameter's piece of a region: which parameter, where the piece starts in it and
    in the region, how many elements."""
    param: int
    param_offset: int
    region_offset: int
    numel: int


@dataclass(kw_only=True)
class Region:
    """A range sharded over the ranks in rank order (a bucket or a unit): what this rank
    holds of it, for state dicts and checkpoints ([Note: shard sources])."""
    shard_numel: int
    frags: List[Piece]         # each parameter's piece of the region
    exp_avg: Optional[torch.Tensor] = None      # this rank's shard (None for another optimizer_class)
    exp_avg_sq: Optional[torch.Tensor] = None
    # this rank's fp32 values: ZeRO-1/2 the master (or fp32 parameter) shard, the optimizer's
    # to save; ZeRO-3 the unit's shard, the model's to save (``model_owned``)
    values: Optional[torch.Tensor] = None
    model_owned: bool = False
    # chunks of different lengths (a unit laid out for a whole-tensor optimizer): rank r's
    # is [bounds[r], bounds[r + 1]) and shard_numel this rank's length; None: equal chunks
    bounds: Optional[List[int]] = None
    # this rank's place among the ranks the region is sharded over, where those are its own
    # (an expert param group's or expert unit's, [Note: param groups over their own ranks]
    # in comm/mesh.py); None: the optimizer's or model's ranks, where the rank is theirs
    place: Optional[int] = None

    def span(self, rank: int) -> Tuple[int, int]:
        """Rank ``rank``'s chunk of the region: [start, end)."""
        return chunk_span(self.bounds, self.shard_numel, rank)

    def numel(self, world_size: int) -> int:
        """The whole region's length (every rank's chunk)."""
        return self.bounds[-1] if self.bounds is not None else world_size * self.shard_numel

    def owned(self, rank: int) -> Iterator[tuple]:
        """(param index, offset in the param, slice of the rank's shard) for each piece ``rank`` owns."""
        lo, hi = self.span(rank)
        for i, t_off, r_off, n in self.frags:
            a, b = max(lo, r_off), min(hi, r_off + n)
            if a < b:
                yield i, t_off + a - r_off, slice(a - lo, b - lo)


@dataclass(frozen=True)
class Rebind:
    """What a source over model-owned shards (ZeRO-3's) reports to whoever bound it (an
    optimizer) when the model lays those shards out again for another party:
    ``blocker()``: why that may not happen now, or None; ``relaid()``: it happened, bind
    anew. The model side calls these and knows nothing of who answers."""
    blocker: Callable[[], Optional[str]]
    relaid: Callable[[], None]


@dataclass(frozen=True)
class HeldParam:
    """A parameter of a sharded model as checkpoints see it: the object the model yields
    (its name is the model's for it), its full shape and the model's dtype for it.
    ``whole_name``: an expert's parameter, its name in the whole (non-parallel) model,
    where the model was told it (FullyShard's ``expert_names``); None otherwise. ``placed``:
    a tensor-parallel parameter's placements (its regions hold its local piece, ``shape``
    is the global one); None otherwise."""
    param: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    whole_name: Optional[str] = None
    placed: Optional[object] = None


class ShardedModel(abc.ABC):
    """A model whose parameters are sharded over the ranks (FullyShard), seen through
    regions: what checkpoints read and write. Set by the constructor: ``module`` (the
    wrapped model), ``device``, ``process_group``, ``groups`` (as ShardSource's),
    ``uninitialised_buffers`` (a model built on meta: the non-persistent buffers its
    modules' own code did not set; ``load_pretrained`` sets a Hugging Face model's)."""
    module: torch.nn.Module
    device: torch.device
    process_group: dist.ProcessGroup
    groups: Groups
    uninitialised_buffers: List[str]     # built on meta: non-persistent buffers nothing set

    @abc.abstractmethod
    def held_regions(self) -> Tuple[List[HeldParam], List[Region]]:
        """Every sharded parameter, and this rank's regions of them (``values`` its fp32
        shards, ``model_owned``); the regions' frags index the parameter list."""

    @abc.abstractmethod
    def shards_loaded(self) -> None:
        """The shards were written (a checkpoint loaded): drop whatever derives from them."""


class ShardSource(abc.ABC):
    """A gradient source the update engine steps over; see [Note: shard sources].

    Set by the constructor: ``segments``, ``regions``, ``full_shapes`` (param
    index -> full shape, trainable parameters only; the segments' gradients
    are averaged: [Note: one meaning for a gradient]), ``check_finite`` (fp16 anywhere: the step checks for inf/NaN first),
    ``stage``, ``device``, ``process_group`` (the group the state is sharded
    over), ``world_size``, ``rank`` (in it), ``groups`` (with the replica
    and statistics groups of hybrid sharding; see [Note: hybrid sharding] in
    comm/mesh.py)."""
    segments: List[Segment]
    regions: List[Region]
    full_shapes: Dict[int, torch.Size]
    check_finite: bool
    stage: int
    device: torch.device
    process_group: dist.ProcessGroup
    world_size: int
    rank: int
    groups: Groups
    storage: Storage

    def __init__(self):
        # elements each kind of collective moved (the optimizer adds its all-reduces)
        self.comm_elements = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0, "replica_all_reduce": 0}
        # called with no argument when a backward outside no_sync() has finished and
        # every gradient shard holds its reduced value (the engine takes its statistics)
        self.listeners: List[Callable[[], None]] = []
        # called with no argument when a backward begins, before its first reduction
        # (the engine's part in torch's Join: [Note: uneven inputs] in optim/join.py)
        self.backward_listeners: List[Callable[[], None]] = []
        # parameter index -> its owner, where the layout keeps parameters whole (whole_owner)
        self.whole_owners: Dict[int, int] = {}

    def whole_owner(self, i: int) -> Optional[int]:
        """The rank whose shard holds all of parameter ``i``: where the layout keeps it
        whole for a whole-tensor optimizer ([Note: owner-aligned layout] in
        csrc/layout.h), or where a FullyShard unit's chunk happens to; None where
        it may be split."""
        return self.whole_owners.get(i)

    def param_colors(self) -> Optional[List[Tuple[int, int]]]:
        """Per parameter, (color, count) of the ranks it is sharded over where some param
        group has its own ([Note: param groups over their own ranks] in comm/mesh.py);
        None where every parameter shards over ``process_group``."""
        return None

    def tensor_parallel(self):
        """The DTensor parameters' TensorParallel (common/tensor_parallel.py), None without."""
        return None

    def expert_placements(self) -> dict:
        """Parameter index -> Placed of the experts that are DTensors over an ep mesh
        ([Note: expert DTensors] in common/tensor_parallel.py)."""
        return {}

    def param_process_group(self, i: int) -> dist.ProcessGroup:
        """The ranks parameter ``i`` is sharded over."""
        return self.process_group

    def notify_grads_ready(self):
        for fn in self.listeners:
            fn()

    @abc.abstractmethod
    def grads_ready(self) -> bool:
        """Whether a backward outside no_sync() finished since the last step or zero_grad."""

    @abc.abstractmethod
    def in_backward(self) -> bool:
        """Whether a backward is running now."""

    @abc.abstractmethod
    def arrived(self) -> List[int]:
        """Parameter indices that received a gradient on this rank since the last
        ``zero_grad(set_to_none=True)``: what torch's AdamW would see a ``p.grad`` for."""

    @abc.abstractmethod
    def step_done(self, updated: bool) -> None:
        """The shards were updated (``updated``) or the step was skipped: rebuild what
        derives from them (ZeRO-1/2: all-gather the parameters; ZeRO-3: drop gathered
        copies) and mark the gradients consumed."""

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool) -> None:
        """Zero or free the gradients and gradient shards."""

    @abc.abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients without communication inside the context."""

    @abc.abstractmethod
    def memory_report(self, reset_peak: bool) -> Dict[str, int]:
        """Bytes held on this rank by category (see ShardedOptimizer.memory_report)."""

    @abc.abstractmethod
    def shards_loaded(self) -> None:
        """Region values and states were written (a checkpoint or sharded state dict
        loaded): rebuild everything derived from the shards."""

    def resting_grad(self, i: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """What ``p.grad`` of parameter ``i`` goes back to when the placeholders of
        [Note: sharded gradients] are cleared (the next backward accumulates there);
        ``grad``: what it held at the end of the backward."""
        return grad

    def at_rest(self, i: int, grad: torch.Tensor) -> bool:
        """Whether ``grad`` (not None) is what ``p.grad`` of parameter ``i`` holds between
        steps by the source's doing (else the script assigned it: [Note: gradients set by the
        script] in optim/hand_grads.py)."""
        return False

    def allocate_grads(self) -> None:
        """Zeroed gradient shards where none are held (gradients assigned by hand with no
        backward since zero_grad(set_to_none=True) are written into them)."""
        raise NotImplementedError(f"{type(self).__name__} holds no gradient shards to allocate")

    def lay_out_trainable(self) -> None:
        """Before the optimizer binds a new source over these parameters ([Note: new
        parameters] in optim/regroup.py): whatever the source's owners must lay out again for
        parameters unfrozen since (FullyShard's units); nothing by default (collective)."""

    def release(self) -> None:
        """Stop following the parameters (hooks removed): the optimizer is rebound to
        others ([Note: construction order] in common/claims.py)."""

    def settle(self) -> None:
        """Finish what is still in flight after a step (ZeRO-1/2 with
        overlap_param_gather: the parameter all-gathers); a no-op otherwise."""

    @abc.abstractmethod
    def params_loaded(self) -> None:
        """The model's parameters were loaded (load_state_dict): re-make master shards."""
