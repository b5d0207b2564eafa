"""Update rules: what ShardedOptimizer's step does with each segment.

[Note: update rules] The engine (ShardedOptimizer) decides *which* ranges
step (used parameters, their step counts, clipping, the non-finite skip); a
rule decides *how*:
* ``FusedAdamW``: zeroshard's fused AdamW kernel over the segments, with
  exp_avg / exp_avg_sq in the sources' flat state shards (the default).
* ``TorchElementwise``: any elementwise torch optimizer (SGD, Adam, Adagrad,
  ...), run by an instance of its own class over this rank's pieces of each
  parameter: one fp32 tensor per (parameter, segment) piece, a view of the
  master or fp32 shard, so the class updates the shard in place and keeps its
  state per piece. An update that needs a parameter's whole shape (LBFGS,
  Adafactor) cannot run on such pieces: only the classes in ``ELEMENTWISE``
  are taken unless the user vouches for another (``elementwise=True``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import comm
from ..core.segments import update_parts
from ..native.kernels import fused_adamw_multi_
from .grads import scaled_grad
from .whole import WHOLE_TENSOR

# torch optimizers whose update of each element depends only on that element's
# gradient, state and parameter (and per-parameter scalars such as the step)
ELEMENTWISE = tuple(
    getattr(torch.optim, n)
    for n in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, n)
)


def check_class(cls, elementwise: bool, whole_tensor: bool = False) -> bool:
    """Whether ``cls`` runs as a whole-tensor rule ([Note: whole-tensor optimizers] in
    optim/whole.py) rather than over pieces; refuses a class known as neither."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {cls!r}")
    if elementwise and whole_tensor:
        raise ValueError(
            "pass elementwise=True or whole_tensor=True, not both: an elementwise class runs on "
            "this rank's pieces, a whole-tensor one on each parameter's owner"
        )
    if whole_tensor or (cls in WHOLE_TENSOR and not elementwise):
        return True
    if cls not in ELEMENTWISE and not elementwise:
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        whole = ", ".join(c.__name__ for c in WHOLE_TENSOR)
        raise ValueError(
            f"optimizer_class {cls.__name__} is neither a known elementwise optimizer ({names}) nor a known "
            f"whole-tensor one ({whole}). ShardedOptimizer runs an elementwise class on each rank's flat "
            "pieces of every parameter, so an update that needs a parameter's whole shape (LBFGS's line "
            "search, row/column factors, an orthogonalisation) would be silently wrong there. If every "
            "element's update depends only on that element's gradient, state and value (and per-parameter "
            "scalars), pass elementwise=True to vouch for it; if it needs each parameter whole, pass "
            "whole_tensor=True (each parameter is then updated whole, on one rank)"
        )
    return False


def require_fused(opt, what: str) -> None:
    """Refuse ``what`` (a sharded state dict) for an elementwise ``optimizer_class``."""
    if not opt.sharded_state:
        raise NotImplementedError(
            comm.on_rank(
                opt,
                f"{what} with optimizer_class={opt.optimizer_class.__name__}: sharded state dicts hold the "
                "fused AdamW's and whole-tensor optimizers' state only; use zeroshard.save_checkpoint "
                "(any world size, every optimizer) or opt.consolidate_state_dict(to=0) and "
                "opt.state_dict() (the class's own format)",
            )
        )


class FusedAdamW:
    """The fused kernel over the segments; see [Note: update rules]. Segments whose
    state is offloaded go through ``storage``'s streamer ([Note: offload])."""

    fused = True
    elementwise_keys = frozenset({"exp_avg", "exp_avg_sq"})

    def __init__(self, storage=None):
        self.storage = storage

    def update(
        self,
        segments,
        groups: List[dict],
        used: List[bool],
        steps: List[int],
        scale: Optional[torch.Tensor],
        step_kwargs: Optional[dict] = None,
        closure=None,
    ):
        """Every range of the step in one kernel call (one launch on CUDA, one
        parallel loop on CPU), one hyperparameter set per (param group, step
        count); offloaded ranges then go window by window through the streamer."""
        hypers = [_adamw_hyper(group) for group in groups]
        sets: List[dict] = []
        index: Dict[tuple, int] = {}
        which, parts, streamed = [], [], {}
        for gi, step, is_streamed, part in update_parts(segments, used, steps):
            if is_streamed:
                streamed.setdefault((gi, step), []).append(part)
                continue
            if (gi, step) not in index:
                index[(gi, step)] = len(sets)
                sets.append(dict(hypers[gi], step=step))
            which.append(index[(gi, step)])
            parts.append(part)
        if parts:  # first: on CUDA it runs while the CPU steps the offloaded windows
            p, g, m, v, out = zip(*parts)
            fused_adamw_multi_(p, g, m, v, sets, which, outs=out, scale=scale)
        for (gi, step), ps in streamed.items():
            self.storage.streamer_for_step().update(ps, dict(hypers[gi], scale=scale), step)

    @torch.no_grad()
    def gather_full(self, opt, keep: bool) -> Optional[Dict[int, dict]]:
        """The full AdamW state on CPU of every trainable parameter that has stepped,
        gathered one region at a time (collective); None where ``keep`` is false."""
        full, steps = {}, opt.param_steps
        if keep:
            for i in opt.trainable:
                full[i] = {
                    "step": torch.tensor(float(steps[i])),
                    "exp_avg": torch.zeros(opt.full_shape(i), dtype=torch.float32),
                    "exp_avg_sq": torch.zeros(opt.full_shape(i), dtype=torch.float32),
                }
        for reg in opt.regions:
            for name in ("exp_avg", "exp_avg_sq"):
                gathered = torch.empty(reg.numel(opt.world_size), dtype=torch.float32, device=opt.device)
                comm.all_gather(
                    getattr(reg, name).to(opt.device),
                    gathered,
                    group=opt.process_group,
                    bounds=reg.bounds,
                    what=f"state_dict gather: {name}",
                ).wait()
                if not keep:
                    continue
                gathered = gathered.cpu()
                for i, t_off, r_off, n in reg.frags:
                    full[i][name].view(-1)[t_off : t_off + n] = gathered[r_off : r_off + n]
        if not keep:
            return None
        # as torch's AdamW: no state for a parameter that never stepped
        return {i: st for i, st in full.items() if steps[i] > 0}

    @torch.no_grad()
    def load_full(self, opt, state: dict, saved_ids: list) -> None:
        """This rank's pieces of a full AdamW state dict (ours or torch's) into the regions."""
        for reg in opt.regions:
            reg.exp_avg.zero_()
            reg.exp_avg_sq.zero_()
            for i, start, sl in reg.owned(opt.rank):
                st = state.get(saved_ids[i])
                if st is None:
                    continue
                for name in ("exp_avg", "exp_avg_sq"):
                    getattr(reg, name)[sl].copy_(st[name].reshape(-1)[start : start + sl.stop - sl.start])


def _adamw_hyper(group: dict) -> dict:
    if group.get("amsgrad") or group.get("maximize"):
        raise NotImplementedError(
            "amsgrad and maximize are not supported by the fused AdamW; pass "
            "optimizer_class=torch.optim.AdamW with them to run torch's"
        )
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])


class TorchElementwise:
    """An instance of ``cls`` over this rank's pieces; see [Note: update rules]."""

    fused = False

    def __init__(self, cls, kwargs: dict, segments, param_groups: List[dict]):
        self.cls = cls
        # (param index, offset in the flattened parameter) -> (segment, start, stop, fp32 leaf)
        self.pieces: Dict[Tuple[int, int], tuple] = {}
        by_group: List[list] = [[] for _ in param_groups]
        for seg in segments:
            for i, a, b, t_off in seg.pieces:
                leaf = seg.param[a:b]
                self.pieces[(i, t_off)] = (seg, a, b, leaf)
                by_group[seg.group].append(leaf)
        groups = [dict(_hyper(g), params=ps) for g, ps in zip(param_groups, by_group) if ps]
        self.group_index = [gi for gi, ps in enumerate(by_group) if ps]
        self.inner = cls(groups, **kwargs) if groups else None
        self.kwargs = kwargs
        self._elementwise: Optional[set] = None

    @property
    def elementwise_keys(self) -> set:
        """The state keys the class keeps one value per element for (the others are
        per-parameter scalars): read from its state once it has stepped here, else from one
        step on a dummy parameter (not at construction: a class's step may need arguments)."""
        if self._elementwise is None:
            states = [
                (leaf, self.inner.state[leaf])
                for *_, leaf in self.pieces.values()
                if self.inner is not None and self.inner.state.get(leaf)
            ]
            if states:
                self._elementwise = {
                    k
                    for leaf, st in states
                    for k, v in st.items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == leaf.shape
                }
            else:
                self._elementwise = {k for k, each in probe_state(self.cls, self.kwargs).items() if each}
        return self._elementwise

    def update(
        self,
        segments,
        groups: List[dict],
        used: List[bool],
        steps: List[int],
        scale: Optional[torch.Tensor],
        step_kwargs: Optional[dict] = None,
        closure=None,
    ):
        """One call of the class's ``step`` over every param group, with ``closure`` (None: not
        passed) and ``step_kwargs`` as given; keys the class set in its param groups during
        the step are copied to ours (as torch's ZeroRedundancyOptimizer does)."""
        if self.inner is None:
            return
        for inner_group, gi in zip(self.inner.param_groups, self.group_index):
            inner_group.update(_hyper(groups[gi]))  # an LR scheduler changes ours; the instance follows
        for (i, _), (seg, a, b, leaf) in self.pieces.items():
            if used[i]:  # None: the class skips it, as torch's optimizers skip a None gradient
                leaf.grad = scaled_grad(seg.grad[a:b], scale, leaf.device)
        args = () if closure is None else (closure,)
        self.inner.step(*args, **(step_kwargs or {}))
        for inner_group, gi in zip(self.inner.param_groups, self.group_index):
            groups[gi].update(_hyper(inner_group))
        for (i, _), (seg, a, b, leaf) in self.pieces.items():
            leaf.grad = None
            if used[i] and seg.out is not None:
                seg.out[a:b].copy_(leaf)  # round to the low-precision parameter

    # ------------------------------------------------------------ state dicts
    def piece_state(self, i: int, t_off: int) -> Optional[dict]:
        piece = self.pieces.get((i, t_off))
        return None if piece is None or self.inner is None else self.inner.state.get(piece[3])

    def piece_leaves(self) -> Dict[Tuple[int, int], torch.Tensor]:
        """(param index, offset in the flattened parameter) -> this rank's fp32 piece there."""
        return {key: piece[3] for key, piece in self.pieces.items()}

    def set_piece_state(self, i: int, t_off: int, st: Optional[dict]):
        """The class's state of this rank's piece of parameter ``i`` at ``t_off``, as it keeps it
        (None: no state, as for a parameter that never stepped)."""
        leaf = self.pieces[(i, t_off)][3]
        if st is None:
            self.inner.state.pop(leaf, None)
        else:
            self.inner.state[leaf] = st

    def load_piece_state(self, i: int, t_off: int, st: dict):
        """This rank's piece (if any) of parameter ``i`` at ``t_off`` takes its part of
        the full per-parameter state ``st`` (the class's own format)."""
        piece = self.pieces.get((i, t_off))
        if piece is None:
            return
        leaf = piece[3]
        self.inner.state[leaf] = {
            k: (
                v.reshape(-1)[t_off : t_off + leaf.numel()].to(leaf.device, torch.float32).clone()
                if k in self.elementwise_keys
                else (v.clone() if isinstance(v, torch.Tensor) else v)
            )
            for k, v in st.items()
        }

    @torch.no_grad()
    def region_state(self, reg, key: str, rank: int, device: torch.device) -> torch.Tensor:
        """State ``key`` of this rank's pieces of region ``reg``, laid out as its shard (fp32;
        zero where a piece has none)."""
        local = torch.zeros(reg.shard_numel, dtype=torch.float32, device=device)
        for i, t_off, sl in reg.owned(rank):
            st = self.piece_state(i, t_off)
            if st is not None and isinstance(st.get(key), torch.Tensor):
                local[sl].copy_(st[key].reshape(-1))
        return local

    @torch.no_grad()
    def gather_full(self, opt, keep: bool) -> Optional[Dict[int, dict]]:
        """The full state in the class's own per-parameter format, on CPU, gathered
        one region and one state key at a time (collective); None where ``keep`` is false."""
        scalars = gather_scalars(opt, self)  # (collective: every rank)
        full = {i: dict(d) for i, d in scalars.items()} if keep else {}
        for i in full:
            for k in self.elementwise_keys:
                full[i][k] = torch.zeros(opt.full_shape(i), dtype=torch.float32)
        for reg in opt.regions:
            for k in sorted(self.elementwise_keys):
                local = self.region_state(reg, k, opt.rank, opt.device)
                gathered = torch.empty(reg.numel(opt.world_size), dtype=torch.float32, device=opt.device)
                comm.all_gather(
                    local, gathered, group=opt.process_group, bounds=reg.bounds, what=f"state_dict gather: {k}"
                ).wait()
                gathered = gathered.cpu() if keep else None
                for i, t_off, r_off, n in reg.frags if keep else ():
                    if i in full:
                        full[i][k].view(-1)[t_off : t_off + n] = gathered[r_off : r_off + n]
        return full if keep else None

    @torch.no_grad()
    def load_full(self, opt, state: dict, saved_ids: list) -> None:
        """Every piece on this rank takes its part of a full state dict in the class's format."""
        for i, t_off in list(self.pieces):
            st = state.get(saved_ids[i])
            if st is not None:
                self.load_piece_state(i, t_off, st)

    def state_bytes(self) -> int:
        if self.inner is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for st in self.inner.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def probe_state(cls, kwargs: dict) -> Dict[str, bool]:
    """The state keys ``cls`` keeps for a parameter, each with whether it keeps one value per
    element (else it is a per-parameter scalar), from one step on a two-element dummy
    parameter (the keys of a 1-D state, when several elements make that ambiguous: none here)."""
    p = torch.zeros(2, requires_grad=True)
    o = cls([p], **kwargs)
    p.grad = torch.ones(2)
    o.step()
    return {k: isinstance(v, torch.Tensor) and v.numel() == 2 for k, v in o.state[p].items()}


def probe_defaults(cls, kwargs: dict) -> dict:
    """``cls``'s defaults with ``kwargs`` (an instance over a dummy matrix: the class
    validates its own arguments)."""
    return dict(cls([torch.zeros(2, 2, requires_grad=True)], **kwargs).defaults)


def add_group_keys(cls, kwargs: dict, groups: List[dict]) -> None:
    """The keys ``cls`` adds to a param group beyond its defaults (in its ``__init__``), added
    to each of ``groups`` where missing, from an instance over a dummy matrix with the
    group's hyperparameters: code reading ``opt.param_groups`` sees what the class's own
    groups hold (the class's step() is never called here)."""
    for g in groups:
        probe = cls([dict(_hyper(g), params=[torch.zeros(2, 2, requires_grad=True)])], **kwargs)
        for k, v in probe.param_groups[0].items():
            if k != "params":
                g.setdefault(k, v)


def gather_scalars(opt, rule: TorchElementwise) -> Dict[int, dict]:
    """Per parameter: its non-elementwise state values (e.g. "step"), from whichever
    rank holds a piece of it (collective)."""
    mine = {}
    for i, t_off in rule.pieces:
        st = rule.piece_state(i, t_off)
        if st is not None:  # the class made state for it (possibly none but the entry)
            mine.setdefault(i, {}).update(
                {
                    k: v.clone() if isinstance(v, torch.Tensor) else v
                    for k, v in st.items()
                    if k not in rule.elementwise_keys
                }
            )
    out: Dict[int, dict] = {}
    for theirs in comm.all_gather_object(
        {i: {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()} for i, d in mine.items()},
        group=opt.process_group,
        what="state_dict scalars",
    ):
        for i, d in theirs.items():
            out.setdefault(i, {}).update(d)
    return out
