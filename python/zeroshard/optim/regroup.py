"""Parameters that join a ShardedOptimizer after it was built.

[Note: new parameters] ``add_param_group`` after construction (a new head,
progressive unfreezing as torch's ZeroRedundancyOptimizer supports it), and
a parameter frozen when the optimizer was built and unfrozen later, each
need a place in the shards. The optimizer lays every parameter out again
(``relayout``), as its constructor does: a new shard source and update rule
over all the param groups, the new parameters broadcast from rank 0, as
DDP's constructor makes them equal. What the old layout held is carried
over region by region (``carry_state``): each old region's fp32 values
(stages 1/2: the master weights) and the update rule's per-element state
are all-gathered one region at a time and each rank keeps the pieces the
new layout gives it; per-parameter scalars (a class's ``step``) and step
counts go with their parameters. So a run that adds a group is exactly the
run whose optimizer had it from the start, with its state empty until it
first steps, as in torch. The cost: collective (every rank calls it, as
torch's ZeroRedundancyOptimizer requires), once per call: both layouts'
state are alive until the copy ends, plus one region gathered.

When: between a ``step()`` (or ``zero_grad()``) and the next backward, as
no reduced gradient may be pending. A parameter unfrozen after
construction is laid out by the next ``zero_grad()``: from that backward on
it trains. If a backward ran with it unfrozen before that, its gradient was
not averaged over the ranks, so ``step()`` refuses, naming ``zero_grad()``.
A whole-tensor ``optimizer_class`` (Muon, Adafactor) keeps each
parameter's state on an owner rank chosen for the whole layout: a new group
is refused there (build another ShardedOptimizer for it).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from .. import comm
from ..core.claims import check_unclaimed, unclaim
from ..core.hooks import remove_hooks
from .rules import gather_scalars


def unfrozen(params: List[torch.Tensor], frozen: List[int]) -> List[int]:
    """Indices of the parameters frozen at the last layout that now require grad."""
    return [i for i in frozen if params[i].requires_grad]


def refuse_unaveraged(params: List[torch.Tensor], frozen: List[int], err) -> None:
    """step() after a backward that gave an unfrozen, not yet laid out parameter a gradient:
    that gradient was not averaged over the ranks; refused, naming the call that fixes it."""
    for i in unfrozen(params, frozen):
        if params[i].grad is not None:
            raise RuntimeError(
                err(
                    f"parameter {i} (shape {tuple(params[i].shape)}) was frozen when the ShardedOptimizer laid "
                    "out its parameters and requires grad now: the backward gave it a gradient that was not "
                    "averaged over the ranks. Call opt.zero_grad() after unfreezing it and before the next "
                    "backward: zero_grad() lays it out, and it trains from that backward on"
                )
            )


def _targets(regions, rank: int) -> Dict[int, list]:
    """param index -> [(offset in the param, region, slice of the shard)] this rank owns."""
    mine: Dict[int, list] = {}
    for reg in regions:
        for i, start, sl in reg.owned(rank):
            mine.setdefault(i, []).append((start, reg, sl))
    return mine


@torch.no_grad()
def carry_streams(opt, old_regions, read: Callable, write: Callable, names: List[str]) -> None:
    """For each stream ``name``: every old region's shard (``read(reg, name)``, the same
    None-ness on every rank) is all-gathered and this rank copies the elements of each of
    its new pieces into ``write(reg, i, start, sl, name)`` (a 1-D tensor of the piece)."""
    mine = _targets(opt.regions, opt.rank)
    for name in names:
        for reg in old_regions:
            local = read(reg, name)
            if local is None:
                continue
            whole = torch.empty(reg.numel(opt.world_size), dtype=local.dtype, device=opt.device)
            comm.all_gather(
                local.to(opt.device), whole, group=opt.process_group, bounds=reg.bounds, what=f"add_param_group: {name}"
            ).wait()
            for i, t_off, r_off, n in reg.frags:
                for start, new, sl in mine.get(i, ()):
                    a, b = max(t_off, start), min(t_off + n, start + sl.stop - sl.start)
                    if a < b:
                        dest = write(new, i, start, sl, name)
                        dest[a - start : b - start].copy_(whole[r_off + a - t_off : r_off + b - t_off])


def carry_state(opt, old_regions, old_rule, old_steps: List[int]) -> None:
    """The old layout's values and update-rule state into ``opt``'s new one (collective)."""

    def read(reg, name):
        if name == "values":
            return reg.values if reg.values is not None and not reg.model_owned else None
        if old_rule.fused:
            return getattr(reg, name)
        return old_rule.region_state(reg, name, opt.rank, opt.device)

    new_rule, states = opt.elementwise_rule, {}

    def write(reg, i, start, sl, name):
        if name == "values" or new_rule is None:
            return getattr(reg, name)[sl]
        st = states.setdefault((i, start), {})
        if name not in st:
            st[name] = torch.zeros(sl.stop - sl.start, dtype=torch.float32, device=opt.device)
        return st[name]

    keys = ["values"] + sorted(old_rule.elementwise_keys)
    carry_streams(opt, old_regions, read, write, keys)
    if new_rule is not None:
        scalars = gather_scalars(opt, old_rule)  # (collective)
        for i, t_off in new_rule.piece_leaves():
            if i < len(old_steps) and old_steps[i]:  # (a new parameter has no state yet)
                st = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.get(i, {}).items()}
                st.update(states.get((i, t_off), {}))
                new_rule.set_piece_state(i, t_off, st)


class Regrouping:
    """A ShardedOptimizer bound over a new layout of its parameters: ``add_param_group`` after
    construction, parameters unfrozen since ([Note: new parameters]), a FullyShard wrapping
    them ([Note: construction order]) or laying its units out again. It is the optimizer's
    claimant of its plain parameters (core/claims.py) and answers a relayout (``Rebind``)."""

    def __init__(self, opt):
        self._opt = weakref.ref(opt)  # (the optimizer holds this part)

    @property
    def opt(self):
        return self._opt()

    def err(self, msg: str) -> str:
        return comm.on_rank(self.opt, msg)

    def add(self, param_group: dict) -> None:
        """A param group joins the shards (collective); see [Note: new parameters]."""
        opt = self.opt
        self.check_can_relayout("add_param_group()")
        n = len(opt.param_groups)
        torch.optim.Optimizer.add_param_group(opt, param_group)
        try:
            check_unclaimed(self, opt.param_groups[n]["params"], self.err)
            self.relayout()
        except BaseException:
            del opt.param_groups[n:]  # (refused before anything changed)
            raise

    def check_can_relayout(self, what: str) -> None:
        opt = self.opt
        opt.state_dicts.refuse_own_ranks(what)
        if opt.whole_tensor_rule is not None:
            raise NotImplementedError(
                self.err(
                    f"{what} with the whole-tensor optimizer_class {opt.optimizer_class.__name__}: each "
                    "parameter's state lives on an owner rank chosen for the whole layout; build another "
                    "ShardedOptimizer over the new parameters"
                )
            )
        if opt.source.in_backward() or opt.source.grads_ready():
            raise RuntimeError(
                self.err(
                    f"{what} while reduced gradients wait for step(): call it after step() (or zero_grad()) "
                    "and before the next backward"
                )
            )

    def relayout(self, lay_out: bool = True) -> None:
        """Lay every parameter out again, carrying the state over; see [Note: new parameters].
        ``lay_out``: have the source's owners lay out parameters unfrozen since (else they did)."""
        opt, old = self.opt, self.opt.bound
        old.source.settle()
        old_steps, old_regions = list(old.param_steps), old.source.regions  # (each keeps its cut)
        if lay_out:
            old.source.lay_out_trainable()
        opt.bind()
        carry_state(opt, old_regions, old.rule, old_steps)
        old.source.release()
        opt.shards_loaded([old_steps[i] if i < len(old_steps) else 0 for i in range(len(opt.params))])

    def lay_out_unfrozen(self) -> bool:
        """zero_grad(): lay out the parameters unfrozen since the last layout, if any
        (collective when there are: every rank unfreezes the same ones)."""
        bound = self.opt.bound
        if not unfrozen(bound.params, bound.frozen):
            return False
        self.check_can_relayout("unfreezing a parameter frozen at construction")
        self.relayout()
        return True

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the parameters the optimizer steps (a claimant's answer:
        [Note: construction order] in core/claims.py)."""
        opt = self.opt
        return opt is not None and id(p) in opt.bound.held

    def params_replaced(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """FullyShard wrapped the model whose parameters the optimizer was built over
        (DDP's order: the optimizer, then the wrap): each (plain, sharded) pair names the
        sharded parameter that replaced a plain one, which the optimizer then steps as
        ZeRO-3, in the same param groups. See [Note: construction order]."""
        opt = self.opt
        if any(opt.param_steps) or opt.source.in_backward() or opt.source.grads_ready():
            raise RuntimeError(
                self.err(
                    "FullyShard wrapped parameters of a ShardedOptimizer that has already run a backward or a "
                    "step: wrap the model before training (the optimizer may be built before or after)"
                )
            )
        replaced = {id(plain): sharded for plain, sharded in pairs}
        for g in opt.param_groups:
            g["params"] = [replaced.get(id(p), p) for p in g["params"]]
        opt.source.release()
        opt.bind()

    def release(self) -> None:
        """Let go of the parameters (``ShardedOptimizer.release``)."""
        bound = self.opt.bound
        if bound.source.in_backward():
            raise RuntimeError(self.err("release() during backward; call it after the step"))
        bound.grads.clear()
        bound.source.zero_grad(set_to_none=True)
        remove_hooks(bound.grads.hooks)
        bound.source.release()
        if bound.buffers is not None:
            bound.buffers.release()
            bound.buffers = None
        unclaim(self)

    def units_relaid(self) -> None:
        """The FullyShard units the optimizer steps were laid out again: for a whole-tensor
        optimizer before anything stepped ([Note: uneven chunks] in zero3/relayout.py), or
        for parameters unfrozen since wrapping: bind over the new layout, the state carried."""
        opt = self.opt
        if any(opt.param_steps):
            self.check_can_relayout("laying FullyShard units out again")
            self.relayout(lay_out=False)
            return
        opt.source.release()
        opt.bind()
