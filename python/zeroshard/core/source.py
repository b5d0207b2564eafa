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
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..comm.mesh import Groups
from ..offload import Storage
from .regions import Region
from .segments import Segment

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)  # parameter, gradient and reduce dtypes


class GradState(enum.Enum):
    """Where a gradient source stands between two steps (both sources use it)."""

    EMPTY = "empty"  # no reduced gradients to step on: after a step, zero_grad, or a no_sync() backward
    BACKWARD = "backward"  # a backward is running
    READY = "ready"  # a backward outside no_sync() finished: the shards hold the reduced gradients


@dataclass(frozen=True)
class Rebind:
    """What a source over model-owned shards (ZeRO-3's) reports to whoever bound it (an
    optimizer) when the model lays those shards out again for another party:
    ``blocker()``: why that may not happen now, or None; ``relaid()``: it happened, bind
    anew. The model side calls these and knows nothing of who answers."""

    blocker: Callable[[], Optional[str]]
    relaid: Callable[[], None]


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
        """The DTensor parameters' TensorParallel (core/tensor_parallel.py), None without."""
        return None

    def expert_placements(self) -> dict:
        """Parameter index -> Placed of the experts that are DTensors over an ep mesh
        ([Note: expert DTensors] in core/tensor_parallel.py)."""
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
        others ([Note: construction order] in core/claims.py)."""

    def settle(self) -> None:
        """Finish what is still in flight after a step (ZeRO-1/2 with
        overlap_param_gather: the parameter all-gathers); a no-op otherwise."""

    @abc.abstractmethod
    def params_loaded(self) -> None:
        """The model's parameters were loaded (load_state_dict): re-make master shards."""
