"""ZeRO-1/2 flat buffers: their records, the checks on the parameters, and
how the buffers are built (the parameters become views of them).

See [Note: sharded optimizer policy] in zero12/reducer.py for how they are used.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import comm
from ..comm.mesh import ShardGroup
from ..offload import Placement, Storage, on_accelerator
from ..core.reduction import Reduction
from ..core.segments import GradShard
from ..core.source import SUPPORTED
from ..core.tensor_parallel import local_ptr, local_tensor, point_at
from ..native.layout import compute_layout, update_cost


@dataclass(eq=False)
class FlatBucket:
    """One of the layout's buckets (``zeroshard.Layout.buckets``, the C++ core's
    ``Bucket``: a contiguous range of a flat buffer, reduced by one reduce-scatter)
    placed in this rank's FlatBuffer: its geometry is the layout's (the three numbers
    the hooks use copied once, here); this record adds the tensors and the reduction
    it has on this rank."""

    index: int
    layout: object  # the layout's Bucket (offset, numel, shard_numel, fragments)
    buffer: "FlatBuffer"
    shard_offset: int  # where this bucket's shard starts in the buffer's shard tensors
    params: List[int] = field(default_factory=list)  # trainable-parameter indices with data here
    frags: List[tuple] = field(default_factory=list)  # (param index, layout fragment) in this bucket
    # its gradients' reduction ([Note: reduction pipeline] in core/reduction.py)
    reduction: Optional[Reduction] = None

    def __post_init__(self):  # read once: the hooks of every backward use them
        self.offset = self.layout.offset  # in the buffer
        self.numel = self.layout.numel  # padded
        self.shard_numel = self.layout.shard_numel  # each rank's chunk

    def own(self, t: torch.Tensor, start: Optional[int] = None) -> torch.Tensor:
        """This rank's chunk of a bucket-sized range of a buffer-sized tensor (of a
        bucket-sized tensor: ``start=0``)."""
        start = (self.offset if start is None else start) + self.buffer.shard.rank * self.shard_numel
        return t[start : start + self.shard_numel]

    def shard_of(self, t: torch.Tensor) -> torch.Tensor:
        """This bucket's piece of a shard-sized tensor."""
        return t[self.shard_offset : self.shard_offset + self.shard_numel]


@dataclass
class FlatBuffer:
    """One (param group, dtype)'s parameters, laid out flat, and this rank's shards of them."""

    group: int
    dtype: torch.dtype
    params: torch.Tensor  # full flat parameters (every param is a view)
    master: Optional[torch.Tensor]  # fp32 shard, None when params are fp32
    exp_avg: Optional[torch.Tensor]  # fp32 shard (None: the optimizer is not the fused AdamW)
    exp_avg_sq: Optional[torch.Tensor]  # fp32 shard
    grads: Optional[torch.Tensor]  # stage 1: full flat gradients (param dtype)
    # the averaged gradient its buckets' reductions fold into (each Reduction.grad is this
    # record): stage 1 ``grads`` (this rank's chunks reduced), stage 2 this rank's shard in the
    # reduce dtype, allocated by the first reduction of a backward
    reduced: GradShard = field(default_factory=GradShard)
    buckets: List[FlatBucket] = field(default_factory=list)
    shard_data_numel: int = 0  # elements of real parameters in this rank's shard
    shard_numel: int = 0  # this rank's shard, padding included
    placement: Placement = Placement.DEVICE  # where master / exp_avg / exp_avg_sq live ([Note: offload])
    shard: Optional[ShardGroup] = None  # the ranks it is sharded over (comm/mesh.py)
    # host copy of this rank's reduced gradient shard, for state the CPU steps while the
    # gradients are on a device ([Note: offloaded gradients]); else None
    grad_mirror: Optional[torch.Tensor] = None
    # stage 2 on CPU: the storage of the shard zero_grad(set_to_none=True) dropped, which the
    # next backward's first reduction takes ([Note: bucket buffers between steps] in zero12/reducer.py)
    spare_shard: Optional[torch.Tensor] = None


def check_views(params: List[torch.Tensor], trainable: List[int], where: dict, err: Callable[[str], str]):
    """Every trainable parameter is still the view of its flat buffer that build_flat made it:
    code that replaced ``p.data`` since (``model.to(dtype or device)``, ``model.half()``,
    ``model.cuda()``, ``p.data = ...``) would leave the model computing on a copy that no
    step writes, and its gradients reduced into a buffer of another dtype or device."""
    for i in trainable:
        p, buf, offset = params[i], where[i].buffer, where[i].offset
        flat = buf.params
        if local_ptr(p) != flat.data_ptr() + offset * flat.element_size():  # (a new dtype or device: new memory)
            raise RuntimeError(
                err(
                    f"parameter {i} (shape {tuple(p.shape)}, now {p.dtype} on {p.device}) is no longer the view of "
                    f"the flat {flat.dtype} buffer on {flat.device} that ShardedOptimizer made it: its data was "
                    "replaced after the optimizer was built (model.to(...), model.half()/.bfloat16()/.cuda(), or "
                    "p.data = ...), so the model would compute on a copy that step() never updates. Convert and "
                    "move the model before building the ShardedOptimizer"
                )
            )


def held_by_ddp(p: torch.Tensor) -> bool:
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


def check_params(params: List[torch.Tensor], trainable: List[int], err: Callable[[str], str]) -> torch.device:
    """The one device every parameter is on; raises on mixed devices, unsupported
    dtypes or devices, and parameters of a DistributedDataParallel model."""
    first = trainable[0]
    device = params[first].device
    for i, p in enumerate(params):
        if p.device != device:
            raise ValueError(
                err(
                    f"parameter {i} is on {p.device} but parameter {first} is on {device}; "
                    "move the whole model to one device before creating the optimizer"
                )
            )
        if p.requires_grad and p.dtype not in SUPPORTED:
            raise ValueError(err(f"parameter {i} has dtype {p.dtype}; supported dtypes are float32, bfloat16, float16"))
    if device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(
            err(
                f"parameters are on {device}; ShardedOptimizer supports CPU and CUDA "
                "(and meta, for planning: zeroshard.plan)"
            )
        )
    if held_by_ddp(params[first]):
        raise ValueError(
            err(
                "the parameters belong to a model wrapped in DistributedDataParallel; DDP would "
                "all-reduce the gradients and ShardedOptimizer would reduce them again. Pass the "
                "unwrapped model's parameters (model.module.parameters()) and drop the DDP wrapper"
            )
        )
    return device


def check_same_across_ranks(
    params: List[torch.Tensor],
    group,
    err: Callable[[str], str],
    names: Optional[List[Optional[str]]] = None,
    shards: Optional[list] = None,
):
    """Every rank has the same parameters (name where known, shape, dtype, requires_grad);
    collective. ``shards``: each parameter's ShardGroup, where some param group has its
    own ranks: its parameters' names are compared over those ranks only (the other
    groups' ranks hold other experts of the same shapes)."""
    names = names or [None] * len(params)
    own = [s is not None and s.own for s in (shards or [None] * len(params))]
    _compare(
        [
            (None if own[i] else names[i], tuple(p.shape), str(p.dtype), bool(p.requires_grad))
            for i, p in enumerate(params)
        ],
        group,
        err,
    )
    for sg in dict.fromkeys(s for s, o in zip(shards or [], own) if o):
        _compare(
            [
                (names[i], tuple(p.shape), str(p.dtype), bool(p.requires_grad)) if shards[i] is sg else None
                for i, p in enumerate(params)
            ],
            sg.group,
            err,
        )


def _compare(mine: list, group, err: Callable[[str], str]) -> None:
    everyone = comm.all_gather_object(mine, group=group, what="setup: same parameters on every rank")
    ref = everyone[0]
    for r, theirs in enumerate(everyone):
        r = dist.get_global_rank(group, r)
        if len(theirs) != len(ref):
            raise ValueError(
                err(
                    f"rank {r} has {len(theirs)} parameters but rank 0 has {len(ref)}; every "
                    "rank must build the same model"
                )
            )
        for i, (a, b) in enumerate(zip(theirs, ref)):
            if a is None or b is None:
                continue
            if a[0] is not None and b[0] is not None and a[0] != b[0]:
                raise ValueError(
                    err(
                        f"parameter {i} is '{a[0]}' on rank {r} but '{b[0]}' on rank {dist.get_global_rank(group, 0)}: "
                        "the ranks hold different parameters in the same place (an expert-parallel model, each rank "
                        "with its own experts?). Each parameter's gradient is averaged over the ranks, as DDP does, "
                        "so different parameters would be mixed. Give every rank the same model, or put the "
                        "expert-parallel parameters in a param group of their own whose 'device_mesh' is the ranks "
                        "holding the same experts (mesh['edp'] of an (edp, ep) DeviceMesh)"
                    )
                )
            if a[1:] != b[1:]:
                raise ValueError(
                    err(
                        f"parameter {i} differs across ranks: rank {r} has (shape, dtype, requires_grad) = {a[1:]} "
                        f"but rank {dist.get_global_rank(group, 0)} has {b[1:]}{f' (it is {a[0]!r})' if a[0] else ''}; "
                        "every rank must build the same model"
                    )
                )


@dataclass(frozen=True)
class ParamPlace:
    """Where a trainable parameter lives: its flat buffer, its offset there and its
    fragments (one per bucket it lies in)."""

    buffer: FlatBuffer
    offset: int
    frags: List["Frag"]


@dataclass(frozen=True)
class BuildOptions:
    """What every buffer build_flat makes shares: the stage, whether the fused AdamW keeps
    the state (another optimizer keeps its own, optim/rules.py), the device, where state
    goes (``storage``) and which parameters' state is offloaded."""

    stage: int
    adam: bool
    device: torch.device
    storage: Storage
    offloaded: frozenset


@dataclass(frozen=True)
class GroupFill:
    """One shard group's layout being filled: its ranks, the number of buckets laid out
    before its own, and where its values come from (global rank ``first`` over
    ``copy_group``)."""

    shards: ShardGroup
    base: int
    first: int
    copy_group: object


@dataclass
class FlatState:
    """What build_flat made: the layouts, their buffers and buckets, where each parameter lives."""

    layouts: List[object]  # zeroshard.compute_layout's results, one per shard group
    buffers: List[FlatBuffer]
    buckets: List[FlatBucket]  # every shard group's, numbered in turn
    where: Dict[int, ParamPlace]  # param index -> its buffer, offset and fragments
    launch_order: List[int]  # bucket indices, until the first backward shows the real order
    # whole parameters: index -> the rank whose shard holds all of it ([Note: owner-aligned layout])
    whole_owners: Dict[int, int] = field(default_factory=dict)


def _has_master(dtype: torch.dtype, placement: Placement, device: torch.device) -> bool:
    """An fp32 master shard for low-precision parameters, and for any whose state is
    offloaded from an accelerator (the host steps it; the device parameter takes the
    result). On meta as on CUDA, unless the planner plans CPU processes."""
    return dtype != torch.float32 or (placement is not Placement.DEVICE and on_accelerator(device))


def _warn_padding(laid_out: int, numel: int, world: int):
    """Warn where an owner-aligned layout's equal shards pad the flat buffers past the
    parameters' own size: with more ranks than whole tensors most shards hold nothing,
    yet every shard is as long as the fullest one."""
    if laid_out > 2 * numel:
        warnings.warn(
            f"[rank {dist.get_rank()}/{dist.get_world_size()}] ShardedOptimizer: a whole-tensor optimizer at "
            f"stage 1/2 over {world} ranks lays each of its tensors whole in one rank's shard, and the shards are "
            f"equal, so the flat buffers hold {laid_out:,} elements for {numel:,} of parameters "
            f"({laid_out / numel:.0f}x: every full-size buffer, parameters and gradients, is that much larger). "
            "Shard it over fewer ranks (shard_size=8, say: a copy of its state per group of 8 ranks, owners "
            "inside each) or use FullyShard, whose uneven chunks need no padding.",
            ResourceWarning,
            stacklevel=4,
        )


@dataclass(frozen=True)
class Frag:
    """A layout fragment (a parameter's piece in one bucket), its bucket numbered among
    every bucket of the reducer (each shard group's layout numbers its own from 0)."""

    bucket: int
    tensor_offset: int
    bucket_offset: int
    numel: int


def build_flat(
    params: List[torch.Tensor],
    group_of: List[int],
    trainable: List[int],
    *,
    stage: int,
    adam: bool,
    bucket_bytes: int,
    device: torch.device,
    shards: list,
    src: int,
    everyone,
    storage: Storage,
    offloaded=frozenset(),
    whole: bool = False,
) -> FlatState:
    """Lay the trainable parameters out in flat buffers (reverse registration order,
    one buffer per (param group, dtype, offloaded or not)), each param group's sharded
    over its ShardGroup ``shards[group]`` (one layout per shard group: [Note: param
    groups over their own ranks] in comm/mesh.py), copy global rank ``src``'s values in
    on every rank of ``everyone`` (a param group's own ranks: from the first of them),
    and make every parameter a view of its buffer; frozen parameters are broadcast. The
    state shards of buffers of ``offloaded`` parameters go where ``storage`` puts
    offloaded state ([Note: offload] in offload/policy.py). ``whole``: every parameter
    lies inside one rank's shard, for an optimizer that updates it whole there ([Note:
    owner-aligned layout] in csrc/layout.h). A DTensor parameter's local piece is laid out
    ([Note: tensor-parallel parameters] in core/tensor_parallel.py)."""
    with torch.no_grad():
        pieces = [local_tensor(p) for p in params]
    order = list(reversed(trainable))  # backward order
    position = {i: k for k, i in enumerate(order)}
    st = FlatState(layouts=[], buffers=[], buckets=[], where={}, launch_order=[])
    opts = BuildOptions(stage=stage, adam=adam, device=device, storage=storage, offloaded=frozenset(offloaded))
    last: List[int] = []
    by_shard: Dict[int, list] = {}
    for i in order:
        by_shard.setdefault(id(shards[group_of[i]]), []).append(i)
    for part in by_shard.values():
        sg = shards[group_of[part[0]]]
        base = len(st.buckets)
        L = _lay_out(pieces, group_of, part, sg.world, bucket_bytes, opts.offloaded, whole)
        st.layouts.append(L)
        st.buckets.extend([None] * len(L.buckets))
        last += [max(position[part[L.fragments[f].tensor]] for f in lb.fragments) for lb in L.buckets]
        st.whole_owners.update({part[t]: place.owner for t, place in enumerate(L.tensors) if place.owner >= 0})
        first = src if not sg.own else dist.get_global_rank(sg.group, 0)
        fill = GroupFill(shards=sg, base=base, first=first, copy_group=everyone if not sg.own else sg.group)
        _fill(L, part, params, pieces, group_of, fill, st, opts)
    st.launch_order = sorted(range(len(st.buckets)), key=lambda b: (last[b], b))
    copies = dist.get_world_size(everyone)
    for p, piece in zip(params, pieces):  # frozen parameters are not sharded, but all ranks start identical
        if not p.requires_grad and copies > 1:
            dist.broadcast(piece, src=src, group=everyone)
    return st


def _lay_out(params, group_of, part: List[int], world: int, bucket_bytes: int, offloaded, whole: bool):
    """The layout of one shard group's parameters ``part`` (in backward order)."""
    # whole: a parameter of at most a bucket's bytes lies whole in its owner's shard; a larger
    # one stays split (optim/whole.py exchanges it), so no bucket passes (world + 1) x the cap
    kept = {i for i in part if whole and params[i].numel() * params[i].element_size() <= bucket_bytes}
    # one buffer per (param group, dtype, offloaded or not, whole or not): the layout's keys
    # only tell buffers apart, numbered as first met
    kinds: Dict[tuple, int] = {}
    keys = [kinds.setdefault((group_of[i], params[i].dtype, i in offloaded, i in kept), len(kinds)) for i in part]
    L = compute_layout(
        [params[i].numel() for i in part],
        [params[i].dtype for i in part],
        bucket_bytes,
        world,
        keys=keys,
        costs=[update_cost(params[i].shape) if i in kept else -1 for i in part],
    )
    if whole:
        _warn_padding(sum(lb.numel for lb in L.buffers), sum(params[i].numel() for i in part), world)
    return L


def _fill(
    L,
    part: List[int],
    params: List[torch.Tensor],
    pieces: List[torch.Tensor],
    group_of,
    fill: GroupFill,
    st: "FlatState",
    opts: BuildOptions,
) -> None:
    """One shard group's flat buffers from its layout ``L``: the values copied in, each
    parameter (``pieces``: their local pieces) a view of its buffer."""
    off = opts.storage.offload.placement
    places = [off if part[lb.tensors[0]] in opts.offloaded else Placement.DEVICE for lb in L.buffers]
    dtypes = [pieces[part[lb.tensors[0]]].dtype for lb in L.buffers]
    opts.storage.reserve_disk(
        sum(
            lb.numel // fill.shards.world * (2 * opts.adam + _has_master(dt, pl, opts.device))
            for lb, pl, dt in zip(L.buffers, places, dtypes)
            if pl is Placement.DISK
        )
    )
    for bi, lb in enumerate(L.buffers):
        flat = torch.zeros(lb.numel, dtype=dtypes[bi], device=opts.device)
        for t in lb.tensors:
            place = L.tensors[t]
            flat[place.offset : place.offset + place.numel].copy_(pieces[part[t]].detach().reshape(-1))
        if dist.get_world_size(fill.copy_group) > 1:
            dist.broadcast(flat, src=fill.first, group=fill.copy_group)
        buf = _make_buffer(
            L, bi, flat, part, group=group_of[part[lb.tensors[0]]], fill=fill, st=st, opts=opts, placement=places[bi]
        )
        for t in lb.tensors:
            place, i = L.tensors[t], part[t]
            point_at(params[i], flat[place.offset : place.offset + place.numel].view(pieces[i].shape))
            st.where[i] = ParamPlace(buf, place.offset, [_frag(L.fragments[f], fill.base) for f in place.fragments])
            if opts.stage == 1:
                params[i].grad = None


def _frag(f, base: int) -> Frag:
    return Frag(base + f.bucket, f.tensor_offset, f.bucket_offset, f.numel)


def _make_buffer(
    L,
    bi: int,
    flat: torch.Tensor,
    order: List[int],
    *,
    group: int,
    fill: GroupFill,
    st: FlatState,
    opts: BuildOptions,
    placement: Placement,
) -> FlatBuffer:
    """The record of the layout's buffer ``bi`` (its values ``flat``), its buckets and this
    rank's shards; ``order``: the layout's tensors' parameter indices."""
    lb, sg, base, storage, adam = L.buffers[bi], fill.shards, fill.base, opts.storage, opts.adam
    world, rank = sg.world, sg.rank
    shard_len, dev = lb.numel // world, flat.device
    moments = [storage.zeros(placement, shard_len) if adam else None for _ in range(2)]
    grads = torch.zeros(lb.numel, dtype=flat.dtype, device=dev) if opts.stage == 1 else None
    buf = FlatBuffer(
        group=group,
        dtype=flat.dtype,
        params=flat,
        master=None,
        exp_avg=moments[0],
        exp_avg_sq=moments[1],
        placement=placement,
        shard=sg,
        grads=grads,
        reduced=GradShard(tensor=grads),
    )
    shard_off = 0
    for b in lb.buckets:
        lbk = L.buckets[b]
        bucket = FlatBucket(index=base + b, layout=lbk, buffer=buf, shard_offset=shard_off)
        bucket.frags = [(order[L.fragments[f].tensor], _frag(L.fragments[f], base)) for f in lbk.fragments]
        bucket.params = sorted({i for i, _ in bucket.frags})
        shard_off += lbk.shard_numel
        buf.buckets.append(bucket)
        st.buckets[base + b] = bucket
    if _has_master(flat.dtype, placement, dev):
        buf.master = storage.zeros(placement, shard_len)
        for b in buf.buckets:
            storage.copy_in(b.shard_of(buf.master), b.own(flat))
    buf.shard_numel = shard_len
    buf.shard_data_numel = sum(pc.numel for pc in L.shard_pieces(rank) if L.tensors[pc.tensor].buffer == bi)
    st.buffers.append(buf)
    return buf
