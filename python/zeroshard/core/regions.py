"""What state dicts, checkpoints and memory reports read of the shards: regions (ranges
sharded over the ranks in rank order), the parameters a sharded model holds, and the
one memory-report schema.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..comm.mesh import Groups
from ..native.layout import chunk_span
from ..offload import Placement


# memory_report()'s persistent categories, bytes on this rank; "total" is their sum. Every
# report (ZeRO-1/2, FullyShard) and the planner use this one schema.
PERSISTENT = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "padding")
# where the persistent bytes live: "device" (with the parameters), "host", "disk"
# (offloaded state, see [Note: offload] in offload/policy.py); their sum is "total"
LOCATIONS = ("device", "host", "disk")


def persistent_buffers(module: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, buffer) of every buffer ``module``'s state dict holds (registered persistent),
    found without calling its ``state_dict``, whose hooks may read the parameters ([Note:
    state-dict hooks] in zero3/state_dict.py)."""
    for path, m in module.named_modules(remove_duplicate=False):
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), b


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
    frags: List[Piece]  # each parameter's piece of the region
    exp_avg: Optional[torch.Tensor] = None  # this rank's shard (None for another optimizer_class)
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
    uninitialised_buffers: List[str]  # built on meta: non-persistent buffers nothing set

    @abc.abstractmethod
    def held_regions(self) -> Tuple[List[HeldParam], List[Region]]:
        """Every sharded parameter, and this rank's regions of them (``values`` its fp32
        shards, ``model_owned``); the regions' frags index the parameter list."""

    @abc.abstractmethod
    def shards_loaded(self) -> None:
        """The shards were written (a checkpoint loaded): drop whatever derives from them."""


_IN_PLACE = "_zeroshard_sharded_model"  # a model sharded in place keeps its ShardedModel here


def register_sharded_model(module: torch.nn.Module, sharded: ShardedModel) -> None:
    """``module`` is sharded in place by ``sharded`` (``zeroshard.fully_shard``): what
    ``sharded_model_of(module)`` returns (kept in the instance's own ``__dict__``)."""
    vars(module)[_IN_PLACE] = sharded


def sharded_model_of(model) -> Optional[ShardedModel]:
    """The ShardedModel ``model`` is (a FullyShard) or is sharded in place by, else None."""
    if isinstance(model, ShardedModel):
        return model
    return vars(model).get(_IN_PLACE) if isinstance(model, torch.nn.Module) else None
