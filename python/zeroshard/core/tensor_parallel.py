"""Tensor-parallel (DTensor) parameters under ZeRO: their local pieces.

[Note: tensor-parallel parameters] A model parallelized with torch's
``parallelize_module`` over ``mesh["tp"]`` holds DTensor parameters: each rank
its local piece of each (``Shard`` placements) or a replica (``Replicate``).
A ShardedOptimizer over ``mesh["dp"]`` shards the *local pieces*: the ranks of a
dp group share a tp place, so they hold the same pieces, and the flat buffers
lay out each parameter's local tensor. That tensor becomes a view of its
buffer (the DTensor's inner tensor, reached through the traceable-subclass
protocol ``__tensor_flatten__``, is re-pointed with ``set_``: the parameter
object, its hooks and its placements stay), so forward and backward see the
DTensors as torch's parallel styles made them. Under FullyShard a unit lays out
its parameters' local pieces (``Param.shape`` is the piece's, ``full_shape`` the
global one its ShardedParameter shows) and its modules compute, while it is
gathered, on DTensors over the gathered pieces (``compute_param``); its
``state_dict`` gathers the whole tensors over tp too. Gradients are the local pieces
of the DTensor gradients, reduced over dp only and divided by dp (each tp rank
sees the dp rank's batch). A ``Partial`` gradient (a replicated parameter used
on sequence-sharded activations: the norm weights under ``SequenceParallel``)
is summed over tp as it arrives, once, into its parameter's placement; any
other gradient whose placements are not its parameter's is redistributed to them
(torch's embedding backward gives a vocab-sharded embedding a Replicate one).

Statistics (optim/slots.py): a parameter sharded over tp has one slot per tp
place, its color the rank's tp place; a replicated one has one slot, counted on
tp rank 0 alone. The per-step vector is summed over dp, then over tp, so the
total norm counts every element of the model once and an overflow on any rank
of either axis skips the step everywhere. ``p.grad.full_tensor()`` is the
whole (global) averaged gradient, gathered over both axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A DTensor's local piece (sharing its storage); any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_ptr(t: torch.Tensor) -> int:
    """Where a tensor's data (a DTensor's local piece) starts, without an autograd node."""
    return t.detach().to_local().data_ptr() if isinstance(t, DTensor) else t.data_ptr()


def placed_of(p: torch.Tensor) -> Optional["Placed"]:
    """How a DTensor parameter lies over its tp mesh (None for a plain tensor)."""
    return Placed(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride())) if isinstance(p, DTensor) else None


def settle(p: torch.Tensor) -> None:
    """``p.grad`` redistributed to ``p``'s placements where they differ: a Partial gradient
    summed over tp, once; a Replicate one of a Shard parameter (an embedding's, as torch's
    embedding backward makes it) cut to this rank's piece."""
    g = p.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        with torch.no_grad():
            p.grad = g.redistribute(g.device_mesh, tuple(p.placements))


def check_disjoint(
    tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup, err: Callable[[str], str], fix: str
) -> None:
    """The tp mesh's ranks and the ranks sharding over dp meet in this rank alone."""
    both = set(dist.get_process_group_ranks(tp_group)) & set(dist.get_process_group_ranks(dp_group))
    if both != {dist.get_rank()}:
        raise ValueError(
            err(
                f"the DTensor parameters' mesh (ranks {dist.get_process_group_ranks(tp_group)}) and the ranks sharded "
                f"over (ranks {dist.get_process_group_ranks(dp_group)}) share ranks {sorted(both)}: shard a "
                f"tensor-parallel model over the other axis of its mesh, {fix} for a model parallelized over mesh['tp']"
            )
        )


def check_model(module: nn.Module, dp_group: dist.ProcessGroup, experts: bool, err: Callable[[str], str]) -> None:
    """FullyShard over a model with DTensor parameters: they share one 1-D tp mesh, apart
    from the ranks sharded over, on a device (not meta), without expert modules."""
    mesh = None
    for name, p in module.named_parameters():
        why = refused(p, mesh)
        if why:
            raise ValueError(err(f"parameter '{name}' is a DTensor {why}"))
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            if p.device.type == "meta" or experts:
                raise ValueError(
                    err(
                        f"parameter '{name}' is a DTensor: FullyShard does not shard tensor-parallel "
                        "parameters on meta, nor beside expert_modules, yet"
                    )
                )
    if mesh is not None:
        check_disjoint(mesh.get_group(), dp_group, err, "FullyShard(model, device_mesh=mesh['dp'])")


def local_piece(whole: torch.Tensor, placed: "Placed") -> torch.Tensor:
    """This rank's tp piece of a parameter's whole tensor (no communication)."""
    return distribute_tensor(whole, placed.mesh, placed.placements, src_data_rank=None).to_local()


def point_at(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make parameter ``p`` hold ``view`` (a flat buffer's range, of its local shape): a
    DTensor's inner tensor is re-pointed, keeping the parameter object and placements."""
    if not isinstance(p, DTensor):
        p.data = view
        return
    names, _ = p.__tensor_flatten__()
    with torch.no_grad():
        getattr(p, names[0]).set_(view)


def compute_param(view: torch.Tensor, placed: Optional["Placed"], requires_grad: bool) -> nn.Parameter:
    """FullyShard's compute parameter over ``view`` (its range of the unit's gathered
    buffer): a DTensor parameter's is the DTensor over it, with the placements the model's
    parallel styles gave it."""
    if placed is not None:
        return nn.Parameter(placed.wrap(view), requires_grad=requires_grad)
    p = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=requires_grad)
    p.data = view
    return p


@dataclass(frozen=True)
class Placed:
    """How a DTensor parameter is laid over its tp mesh."""

    mesh: object  # its 1-D DeviceMesh
    placements: Tuple[object, ...]
    shape: torch.Size  # the global shape
    stride: Tuple[int, ...]
    expert: bool = False  # an expert over an ep mesh ([Note: expert DTensors]), not tp

    @property
    def sharded(self) -> bool:
        """Each tp rank holds another piece (else every one holds the whole)."""
        return any(isinstance(pl, Shard) for pl in self.placements)

    def runs(self, start: int, n: int) -> List[Tuple[int, int, int]]:
        """Elements ``start .. start+n`` of this rank's flattened local piece as ranges of the
        flattened global tensor: (global start, offset from ``start``, length), in order
        (torch's chunks: ceil(size / tp) along the sharded dimension, the last ones shorter)."""
        dims = [pl.dim for pl in self.placements if isinstance(pl, Shard)]
        if not dims:
            return [(start, 0, n)] if n else []
        d, g = dims[0], list(self.shape)
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        chunk = -(-g[d] // size)
        lo = min(rank * chunk, g[d])
        local = g[:d] + [max(0, min(g[d], lo + chunk) - lo)] + g[d + 1 :]
        block, inner = math.prod(local[d:]), math.prod(g[d + 1 :])
        out, at = [], start
        while at < start + n:
            outer, k = divmod(at, block)
            length = min(block - k, start + n - at)
            out.append((outer * math.prod(g[d:]) + lo * inner + k, at - start, length))
            at += length
        return out

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` as this parameter's DTensor (no communication, no copy)."""
        return DTensor.from_local(
            local, self.mesh, self.placements, shape=self.shape, stride=self.stride, run_check=False
        )


class TensorParallel:
    """The DTensor parameters of a ShardedOptimizer: their placements over the one tp
    mesh they share, and what sharding their local pieces needs."""

    def __init__(self, placed: Dict[int, Placed], group: dist.ProcessGroup, n: int):
        self.placed, self.n = placed, n  # (``n``: the optimizer's parameters, DTensors or not)
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    @staticmethod
    def of(
        params: List[Optional[torch.Tensor]], dp_group: dist.ProcessGroup, err: Callable[[str], str]
    ) -> Optional["TensorParallel"]:
        """The tensor-parallel parameters among ``params`` (None: none is a DTensor; a None
        entry is left out), checked."""
        placed, mesh = {}, None
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                continue
            why = refused(p, mesh)
            if why:
                raise ValueError(err(f"parameter {i} (shape {tuple(p.shape)}) is a DTensor {why}"))
            mesh = p.device_mesh
            placed[i] = placed_of(p)
        if not placed:
            return None
        check_disjoint(mesh.get_group(), dp_group, err, "ShardedOptimizer(..., device_mesh=mesh['dp'])")
        return TensorParallel(placed, mesh.get_group(), len(params))

    # --------------------------------------------------------------- tensors
    def grad(self, i: int, local: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """What ``p.grad`` of parameter ``i`` holds for its local gradient ``local``."""
        placed = self.placed.get(i)
        return local if placed is None or local is None else placed.wrap(local)

    def full(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s global tensor from this rank's local piece (collective over tp)."""
        placed = self.placed.get(i)
        return local if placed is None else placed.wrap(local).full_tensor()

    # ------------------------------------------------------------ statistics
    def colors(self) -> List[Tuple[int, int]]:
        """Per parameter, (color, count) of its statistics slots: a tp-sharded one one slot
        per tp place (its color this rank's), any other one."""
        return [(self.rank, self.size) if self.sharded(i) else (0, 1) for i in range(self.n)]

    def uncounted(self) -> List[int]:
        """The parameters whose statistics this rank leaves to tp rank 0: every one tp does
        not split (a replicated DTensor or a plain tensor: every tp rank holds the same
        reduced gradient)."""
        return [] if self.rank == 0 else [i for i in range(self.n) if not self.sharded(i)]

    def refuse_whole(self, err: Callable[[str], str]) -> None:
        """A whole-tensor optimizer (Muon, Adafactor) over tp-sharded matrices: not yet."""
        split = [i for i in self.placed if self.sharded(i)]
        if split:
            raise ValueError(
                err(
                    f"parameter {split[0]} is sharded over the tensor-parallel mesh ({self.placed[split[0]].placements}): "
                    "a whole-tensor optimizer (Muon, Adafactor) steps each matrix whole, and zeroshard does not gather "
                    "its tp pieces yet. Give it the replicated matrices only and AdamW the tp-sharded ones, or train "
                    "without tensor parallelism"
                )
            )

    def sharded(self, i: int) -> bool:
        pl = self.placed.get(i)
        return pl is not None and pl.sharded


def expert_placements(
    params: List[torch.Tensor], own: set, groups: List[dist.ProcessGroup], err: Callable[[str], str]
) -> Dict[int, Placed]:
    """[Note: expert DTensors] An expert-parallel model whose experts are DTensors over the
    ep dimension of an (edp, ep) mesh (transformers' ``ep_plan``: each layer's experts one
    tensor ``Shard(0)`` over ep, each rank computing on its local experts) has them in a
    param group over mesh["edp"]: its local pieces are what this rank holds of the experts,
    sharded and reduced over edp as any expert's ([Note: param groups over their own
    ranks] in comm/mesh.py); their gradients are DTensors of the same placements, and a
    checkpoint writes each piece as the ranges of the global tensor it covers. Returns
    parameter index -> Placed for those among ``params`` (``own``: the indices in such
    groups, ``groups[i]``: parameter i's ranks), checked."""
    out: Dict[int, Placed] = {}
    for i in sorted(own):
        p = params[i]
        if not isinstance(p, DTensor):
            continue
        pl = placed_of(p)
        if p.device_mesh.ndim != 1 or any(type(x) is not Shard for x in p.placements):
            raise ValueError(
                err(
                    f"parameter {i} (shape {tuple(p.shape)}) is a DTensor with placements {p.placements} "
                    "in a param group over its own ranks: an expert there is a Shard DTensor over one "
                    "mesh dimension (mesh['ep']) or a plain tensor"
                )
            )
        check_disjoint(p.device_mesh.get_group(), groups[i], err, "{'params': experts, 'device_mesh': mesh['edp']}")
        out[i] = replace(pl, expert=True)
    return out


def refused(p: DTensor, mesh=None) -> Optional[str]:
    """Why a DTensor parameter cannot be sharded over dp (None: it can, or it is no DTensor);
    ``mesh``: the other DTensor parameters' (they must share one)."""
    if not isinstance(p, DTensor):
        return None
    if p.device_mesh.ndim != 1:
        return (
            f"over a {p.device_mesh.ndim}-D mesh: ShardedOptimizer takes parameters parallelized over one "
            "mesh dimension (mesh['tp']) and shards them over another (device_mesh=mesh['dp'])"
        )
    for pl in p.placements:
        if type(pl) not in (Shard, Replicate):
            return (
                f"with placement {pl}: tensor-parallel parameters are Shard or Replicate over mesh['tp'] "
                "(torch's ColwiseParallel, RowwiseParallel, SequenceParallel)"
            )
    if mesh is not None and p.device_mesh != mesh:
        return (
            f"over another mesh ({p.device_mesh}) than the other DTensor parameters ({mesh}): every "
            "tensor-parallel parameter must share one tp mesh"
        )
    return None
