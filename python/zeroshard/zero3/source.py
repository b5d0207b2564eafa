"""ZeRO-3 gradient source: the units of FullyShard models, seen by the optimizer.

The units' fp32 shards are the master weights and their averaged gradient
shards the gradients; this source adds exp_avg/exp_avg_sq shards per unit,
and after a step drops the units' gathered copies (the next forward gathers
the new ones). See [Note: shard sources] in core/source.py.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import comm
from ..comm.mesh import Sharding
from ..offload import NO_OFFLOAD, Offload, Placement, Storage, choose
from ..core.hooks import weak_hook
from ..core.regions import Piece, Region
from ..core.segments import Segment, SegmentPiece
from ..core.source import Rebind, ShardSource
from ..core.tensor_parallel import TensorParallel
from .param import ShardedTensor
from ..native.layout import keep_balanced, update_cost


class UnitSource(ShardSource):
    """The ZeRO-3 source over the FullyShard models that own ``params``
    (``owners[i]`` is the FullyShard of ``params[i]``; none is None)."""

    def __init__(
        self,
        params: List[torch.Tensor],
        group_of: List[int],
        owners: list,
        sharding: Sharding,
        reduce_dtype,
        adam: bool = True,
        offload: Offload = NO_OFFLOAD,
        whole: bool = False,
        rebind: Optional[Rebind] = None,
    ):
        """``sharding``: the optimizer's policy (FullyShard's decides; see ``_check``);
        ``offload``: where the state shards of which units go ([Note: offload]);
        ``whole``: a whole-tensor optimizer's (each of its tensors is laid inside one
        rank's chunk first: [Note: uneven chunks] in zero3/relayout.py); ``rebind``: what
        to report when another party has the units laid out again."""
        super().__init__()
        self._rebind = rebind
        self.owners = []  # each FullyShard once (``owners`` has one entry per parameter)
        for fs in owners:  # (None: an integer parameter FullyShard left out of sharding)
            if fs is not None and all(fs is not o for o in self.owners):
                self.owners.append(fs)
        first, self.adam = self.owners[0], adam
        self.world_size, self.rank = first.world_size, first.rank
        self._check(sharding, reduce_dtype)
        self.process_group, self.device, self.stage = first.process_group, first.device, 3
        self.groups = first.groups
        self.check_finite = any(torch.float16 in (fs.param_dtype, fs.reduce_dtype) for fs in self.owners)
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.full_shapes, self.segments, self.regions = {}, [], []
        self._ranks: Dict[int, object] = {}  # param index -> its unit's ShardGroup
        group = {id(params[i]): group_of[i] for i in self.trainable}
        index = self._index = {id(p): i for i, p in enumerate(params)}
        # tensor-parallel parameters ([Note: tensor-parallel parameters] in core/tensor_parallel.py)
        placed = {
            index[id(q.sharded)]: q.placed
            for fs in self.owners
            for u in fs.units
            for q in u.params
            if q.placed is not None and id(q.sharded) in index
        }
        self.tp = TensorParallel(placed, next(iter(placed.values())).mesh.get_group(), len(params)) if placed else None
        if self.tp is not None and whole:
            self.tp.refuse_whole(self.err)
        if whole:
            load = [0] * self.world_size
            for fs in self.owners:
                fs.lay_out_for_owners(
                    {id(params[i]): update_cost(params[i].shape) for i in self.trainable}, load, by=self
                )
        self.storage = Storage(offload, self.device, dist.get_rank(), self.err)
        placed = self._placements(offload, group)
        for fs in self.owners:
            states, places = {}, {}
            for u in fs.units:
                places[u.index] = placed.get(id(u), Placement.DEVICE)
                st = self._add_unit(u, group, index, places[u.index])
                if st is not None:
                    states[u.index] = st
            fs.steppers.register(self, states, places)
            fs.add_grads_ready_listener(weak_hook(self._owner_ready))
        # a parameter inside one rank's chunk is whole there by chance of the units' layout: a
        # rank holding too much of the update cost so gives some back (they are exchanged);
        # laid out for this optimizer (``whole``), the owners are already the balanced packing's
        if not whole:
            costs = {i: update_cost(s) for i, s in self.full_shapes.items()}
            dense = {i: o for i, o in self.whole_owners.items() if not self._ranks[i].own}
            self.whole_owners = keep_balanced(dense, costs, self.world_size)

    def tensor_parallel(self):
        return self.tp

    def param_colors(self):
        if self.tp is not None:
            return self.tp.colors()
        if not any(sg.own for sg in self._ranks.values()):
            return None
        return [
            (sg.color, sg.count) if (sg := self._ranks.get(i)) is not None else (0, 1) for i in range(len(self._index))
        ]

    def param_process_group(self, i: int):
        sg = self._ranks.get(i)
        return sg.group if sg is not None else self.process_group

    def _owner_ready(self):
        # the last of the models whose backward this step needed (a released source has no owners)
        if self.owners and self.grads_ready():
            self.notify_grads_ready()

    def err(self, msg: str) -> str:
        return comm.on_rank(self, msg)

    def _check(self, sharding: Sharding, reduce_dtype):
        process_group = sharding.process_group
        if (sharding.shard_size, sharding.device_mesh, sharding.expert_modules) != (None, None, None):
            raise ValueError(
                self.err(
                    "these are FullyShard parameters: their sharding is FullyShard's, so pass shard_size / "
                    "device_mesh / expert_modules to zeroshard.FullyShard (its sharding=...), not to ShardedOptimizer"
                )
            )
        if reduce_dtype is not None:
            raise ValueError(
                self.err(
                    "reduce_dtype is set by FullyShard's mixed_precision for FullyShard "
                    "parameters; do not pass it to ShardedOptimizer"
                )
            )
        for fs in self.owners:
            if process_group is not None and fs.process_group is not process_group:
                raise ValueError(
                    self.err(
                        "the FullyShard parameters are sharded over another process group than the one "
                        "given to ShardedOptimizer; pass the FullyShard's process_group (or none)"
                    )
                )
            if fs.process_group is not self.owners[0].process_group:
                raise ValueError(
                    self.err(
                        "the parameters come from FullyShard models on different "
                        "process groups; use one optimizer per process group"
                    )
                )

    def _placements(self, offload: Offload, group: Dict[int, int]) -> Dict[int, Placement]:
        """id(unit) -> where its state goes: whole units in the order backward reduces
        them (the last first), and this rank's file sized for them; [Note: offload params]."""
        units = [
            u for fs in self.owners for u in reversed(fs.units) if any(id(q.sharded) in group for q in u.trainable)
        ]
        k = choose([u.shard_numel for u in units], offload.fraction) if offload.active and self.adam else 0
        self.storage.reserve_disk(
            2 * sum(u.shard_numel for u in units[:k]) if offload.placement is Placement.DISK else 0
        )
        placed = {id(u): offload.placement for u in units[:k]}
        for fs in self.owners:  # offload_params: the state joins the shard in host memory at least
            placed.update({id(u): Placement.HOST for u in fs.units if fs.offload_params and id(u) not in placed})
        return placed

    def _add_unit(self, u, group: Dict[int, int], index: Dict[int, int], placement: Placement):
        """The unit's state shards, region and segments (None if it has nothing to train here)."""
        mine = [q for q in u.trainable if id(q.sharded) in group]
        if not mine:
            return None
        # the fused AdamW's state shards (another optimizer keeps its own: optim/rules.py), over
        # this rank's chunk of the unit's gradients ([Note: frozen parameters] in zero3/wrap.py)
        lo, hi = u.grad_span(u.ranks.rank)
        st = {n: self.storage.zeros(placement, hi - lo) if self.adam else None for n in ("exp_avg", "exp_avg_sq")}
        for q in mine:
            self.full_shapes[index[id(q.sharded)]] = q.shape
            self._ranks[index[id(q.sharded)]] = u.ranks
            holder = u.holder(q.offset, q.numel, u.ranks.world) if q.numel else None  # (its place in u.ranks)
            if holder is not None:
                self.whole_owners[index[id(q.sharded)]] = holder  # inside one chunk
        u.grad_to_host = u.grad_to_host or self.storage.grads_to_host(placement)
        self.regions.append(
            Region(
                shard_numel=hi - lo,
                exp_avg=st["exp_avg"],
                exp_avg_sq=st["exp_avg_sq"],
                frags=[Piece(index[id(q.sharded)], 0, q.offset, q.numel) for q in mine],
                values=u.shard[: hi - lo],
                model_owned=True,
                bounds=u.reduce_bounds(),
                place=u.ranks.rank if u.ranks.own else None,
            )
        )
        # runs of consecutive pieces with one param group (padding between them is harmless:
        # zero parameters with zero gradients stay zero)
        pieces = sorted((q for q in u.params if q.local.numel() > 0), key=lambda q: q.shard_offset)
        for g, run in itertools.groupby(pieces, key=lambda q: group.get(id(q.sharded))):
            if g is None:  # frozen, or not given to this optimizer
                continue
            run = list(run)
            a, b = run[0].shard_offset, run[-1].shard_offset + run[-1].local.numel()
            pieces = [
                SegmentPiece(
                    index[id(q.sharded)], q.shard_offset - a, q.shard_offset - a + q.local.numel(), q.tensor_offset
                )
                for q in run
            ]
            ea, eas = (None if t is None else t[a:b] for t in (st["exp_avg"], st["exp_avg_sq"]))
            self.segments.append(
                Segment(
                    group=g,
                    param=u.shard[a:b],
                    reduced=u.reduction.grad,
                    grad_range=(a, b),
                    exp_avg=ea,
                    exp_avg_sq=eas,
                    pieces=pieces,
                    streamed=self.storage.streamed(placement),
                    norms_taken=True,
                )
            )
        return {n: t for n, t in st.items() if t is not None}

    # ------------------------------------------- a relayout by another party
    def relayout_blocker(self) -> Optional[str]:
        """Why the units under this source cannot be laid out again, or None."""
        return self._rebind.blocker() if self._rebind is not None else None

    def lay_out_trainable(self):
        for fs in self.owners:
            fs.lay_out_trainable(by=self)

    def relaid(self):
        """The units were laid out again: whoever bound this source binds a new one."""
        if self._rebind is not None:
            self._rebind.relaid()

    def release(self):
        """Inert from now on (until collected: its hooks are weak): no state counted, no
        statistics taken after a backward (the optimizer bound a new source)."""
        for fs in self.owners:
            fs.steppers.unregister(self)
        self.owners = []

    # ------------------------------------------------------- ShardSource API
    def grads_ready(self) -> bool:
        return all(fs.grads_ready() for fs in self.owners)

    def in_backward(self) -> bool:
        return any(fs.in_backward() for fs in self.owners)

    def arrived(self) -> List[int]:
        return sorted(
            self._index[id(q.sharded)]
            for fs in self.owners
            for u in fs.units
            for q in u.trainable
            if q.got_grad and id(q.sharded) in self._index
        )

    def at_rest(self, i: int, grad: torch.Tensor) -> bool:
        """Between steps a FullyShard parameter's p.grad is its gradient shard's ShardedTensor."""
        return isinstance(grad, ShardedTensor)

    @torch.no_grad()
    def allocate_grads(self):
        for fs in self.owners:
            for u in fs.units:
                if u.reduction.grad.tensor is None and u.trainable:
                    lo, hi = u.grad_span(u.ranks.rank)
                    where = torch.device("cpu") if u.grad_to_host else u.shard.device
                    u.reduction.grad.tensor = torch.zeros(hi - lo, dtype=torch.float32, device=where)

    def step_done(self, updated: bool):
        for fs in self.owners:  # gathered copies are stale; the next forward gathers
            fs.step_done(updated, by=self)

    def zero_grad(self, set_to_none: bool):
        for fs in self.owners:
            fs.zero_grad(set_to_none, by=self)

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for fs in self.owners:
                stack.enter_context(fs.no_sync())
            yield

    def memory_report(self, reset_peak: bool) -> Dict[str, int]:
        """The FullyShard models' reports (they include this source's states)."""
        reports = [fs.memory_report(reset_peak=reset_peak) for fs in self.owners]
        return {k: sum(r[k] for r in reports) for k in reports[0]}

    def shards_loaded(self):
        for fs in self.owners:
            fs.invalidate()

    def params_loaded(self):
        """The units' shards are the master weights: nothing derives from them here."""
