"""Whole-tensor update rules: optimizers whose update of a parameter needs all of it.

[Note: whole-tensor optimizers] ``torch.optim.Muon`` orthogonalises each
matrix's momentum with Newton-Schulz iterations and ``torch.optim.Adafactor``
factors the second moment over rows and columns: neither can run on the flat
pieces the shard sources hand out (see [Note: update rules] in rules.py). So
each such parameter gets one *owner* rank, and its update runs exactly once
in the job, there:

* Owners are chosen once, the same on every rank, to balance the update's
  cost (``update_cost``: rows x cols x min(rows, cols) for a matrix, as
  Newton-Schulz grows) over the ranks.
* ZeRO-1/2 lay the parameters out so that each lies inside its owner's shard
  ([Note: owner-aligned layout] in csrc/layout.h, which also picks the
  owners): the stage's reduce-scatter hands the owner the whole reduced
  gradient, its fp32 shard holds the whole value, the owner steps it in
  place, and the stage's parameter all-gather carries the result to every
  rank. No collective is added; the bytes sent are AdamW's (but for the
  layout's padding).
* A param group over its own ranks (an expert-parallel group's ``"device_mesh"``) is
  laid out over those ranks, so each of its parameters' owner is one of them
  (``rank_of``): each expert is stepped once in each of its expert-data-parallel
  groups, by one of that group's ranks. At ZeRO-1/2 such a parameter must fit a
  bucket (the window exchange below runs over the optimizer's ranks only); under
  FullyShard an expert unit is laid out again over its own ranks, the owners
  packed among them.
* FullyShard's units are laid out again when this optimizer is built, each
  parameter inside its owner's chunk ([Note: uneven chunks] in
  zero3/relayout.py), and stepped in place there, as at ZeRO-1/2
  (``whole_owner``).
* A parameter the layout still splits (at ZeRO-1/2 one larger than a
  bucket; a chunk that falls inside one rank by chance of an equal layout
  is kept only while that rank holds at most its share of the cost,
  ``keep_balanced``) gets its owner from longest-processing-time packing on
  the cost (on top of the load the whole ones already put on each rank),
  and a step moves, window by window (``plan_windows``: at most about one
  bucket of elements per rank), each such parameter's reduced gradient and
  fp32 value from the ranks' pieces to its owner in one reduce-scatter
  (SUM): every rank writes its pieces at their place in the owner's chunk
  and zeros elsewhere; pieces are disjoint, so the sum is the whole tensor.
* The owner runs one instance of the user's class over the whole tensors it
  owns (its state, Muon's momentum or Adafactor's factors, lives there only),
  then an all-gather brings the updated values back and every rank writes its
  pieces into its shard (and low-precision parameter). The stage then does
  what it does after any update (ZeRO-1/2: the parameter all-gather;
  ZeRO-3: drop the gathered copies).

The price of that exchange: besides the stage's own collectives, each step
moves the split parameters (none under FullyShard) three more times (gradient and value to the
owner, value back) instead of running every matrix's update on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import comm
from .grads import scaled_grad
from ..native.layout import assign_owners, update_cost

# torch optimizers whose update of a parameter needs the whole tensor
WHOLE_TENSOR = tuple(getattr(torch.optim, n) for n in ("Muon", "Adafactor") if hasattr(torch.optim, n))
# classes that take matrices only (torch raises for other shapes)
MATRICES_ONLY = tuple(getattr(torch.optim, n) for n in ("Muon",) if hasattr(torch.optim, n))


_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19)


@dataclass
class Window:
    """Tensors exchanged in one reduce-scatter and one all-gather. Each rank's chunk
    holds its tensors' values in ``[0, values)`` and their gradients in
    ``[values, 2 * values)``."""

    values: int = 0
    slots: Dict[int, tuple] = field(default_factory=dict)  # index -> (owner, offset of its value)

    @property
    def chunk(self) -> int:
        return 2 * self.values


def plan_windows(numels: Dict[int, int], owners: Dict[int, int], world_size: int, cap: int) -> List[Window]:
    """Windows over the tensors ``numels`` (index -> elements): round k takes each
    rank's k-th largest tensor, and rounds join a window while its chunk stays
    within ``cap`` elements (a window has at least one round)."""
    mine: List[List[int]] = [[] for _ in range(world_size)]
    for i in sorted(numels, key=lambda i: (-numels[i], i)):
        mine[owners[i]].append(i)
    windows: List[Window] = []
    used = [0] * world_size  # value elements of each rank in the open window
    for k in range(max((len(m) for m in mine), default=0)):
        round_ = [(r, m[k]) for r, m in enumerate(mine) if k < len(m)]
        grown = [used[r] + sum(numels[i] for q, i in round_ if q == r) for r in range(world_size)]
        if not windows or 2 * max(grown) > cap:
            windows.append(Window())
            used = [0] * world_size
        w = windows[-1]
        for r, i in round_:
            w.slots[i] = (r, used[r])
            used[r] += numels[i]
        w.values = max(w.values, max(used))
    return windows


def check_shapes(cls, full_shapes: Dict[int, torch.Size], err) -> None:
    """Muon takes matrices only: anything else is refused naming it (torch's
    message does not say which parameter, nor where it belongs)."""
    if not issubclass(cls, MATRICES_ONLY):
        return
    for i, shape in sorted(full_shapes.items()):
        if len(shape) != 2:
            raise ValueError(
                err(
                    f"parameter {i} has shape {tuple(shape)} ({len(shape)}-D), but {cls.__name__} updates "
                    "2-D matrices only: put it in the other optimizer (e.g. a ShardedOptimizer with the "
                    "default AdamW, as with torch: embeddings, the output head, norms and biases)"
                )
            )


class WholeTensor:
    """An instance of ``cls`` over whole tensors on their owners; see
    [Note: whole-tensor optimizers]."""

    fused = False
    elementwise_keys: frozenset = frozenset()

    def __init__(
        self, cls, kwargs: dict, source, group_of: List[int], param_groups: List[dict], cap_elements: int, err
    ):
        self.cls, self.source, self.err = cls, source, err
        self.rank, self.world_size = source.rank, source.world_size
        shapes = dict(source.full_shapes)
        check_shapes(cls, shapes, err)
        self.shapes = shapes
        # a parameter of a param group over its own ranks (an expert's: [Note: param groups over
        # their own ranks] in comm/mesh.py) has its owner among those ranks, numbered there
        self.own_ranks = {
            i: dist.get_rank(pg)
            for i in sorted(shapes)
            if (pg := source.param_process_group(i)) is not source.process_group
        }
        # the parameters the layout keeps whole in their owner's shard, and the others
        self.owners = {i: o for i in sorted(shapes) if (o := source.whole_owner(i)) is not None}
        split = [i for i in sorted(shapes) if i not in self.owners]
        if any(i in self.own_ranks for i in split):
            raise _larger_than_a_bucket([i for i in split if i in self.own_ranks], cls, err)
        self.owners.update(
            zip(split, assign_owners([update_cost(shapes[i]) for i in split], self.world_size, self.balance()))
        )  # (on top of the whole ones' load)
        self.windows = plan_windows(
            {i: shapes[i].numel() for i in split}, self.owners, self.world_size, max(2, cap_elements)
        )
        # param index -> [(segment, start, stop, offset in the flattened parameter)] on this rank
        self.pieces: Dict[int, list] = {}
        for seg in source.segments:
            for i, a, b, t_off in seg.pieces:
                self.pieces.setdefault(i, []).append((seg, a, b, t_off))
        # owned parameters whole in this rank's shard: their one piece each, and their batches of
        # at most about cap_elements (each batch's scaled gradients are one transient copy)
        numels = {i: shapes[i].numel() for i in shapes}
        whole = [i for i in sorted(shapes) if i not in split]
        self.home = {i: self._piece(i) for i in whole if self.owners[i] == self.rank_of(i)}
        self.local = _batches(list(self.home), numels, max(1, cap_elements))
        # every rank's batches of parameters whose state travels together (state dicts)
        self.state_batches = [sorted(w.slots) for w in self.windows] + _batches(whole, numels, max(1, cap_elements))
        # the owner's tensor of each parameter it owns: the class keys its state by it; between
        # steps it holds no data (the values live in the shards)
        # (made with one element of storage: the class only checks the shape when it is built)
        self.leaves: Dict[int, torch.Tensor] = {
            i: torch.empty_strided(
                shapes[i],
                (0,) * len(shapes[i]),
                dtype=torch.float32,
                device=self.home[i][0].param.device if i in self.home else source.device,
            )
            for i in shapes
            if self.owners[i] == self.rank_of(i)
        }
        self.kwargs, self.group_of = kwargs, group_of
        self.step_kwargs: dict = {}  # what the current step() passes to the class's step
        by_group: List[list] = [[] for _ in param_groups]
        for i, leaf in self.leaves.items():
            by_group[group_of[i]].append(leaf)
        self.group_index = [gi for gi, ps in enumerate(by_group) if ps]
        self.inner = (
            cls([dict(_hyper(param_groups[gi]), params=by_group[gi]) for gi in self.group_index], **kwargs)
            if self.group_index
            else None
        )
        self._empty = torch.empty(0, dtype=torch.float32, device=source.device)
        self._probes: Dict[tuple, list] = {}  # (dimensions, param group) -> state (shape, itemsize)
        for leaf in self.leaves.values():
            leaf.data = leaf.new_empty(0)

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
        self.step_kwargs = dict(step_kwargs or {}, **({} if closure is None else {"closure": closure}))
        if self.inner is not None:  # an LR scheduler changes ours; the instance follows
            for inner_group, gi in zip(self.inner.param_groups, self.group_index):
                inner_group.update(_hyper(groups[gi]))
        # the gradients are used as they lie where the class only reads them and nothing
        # scales them (no clipping: they are averaged already): then nothing is copied, and the class
        # steps once over every owned parameter instead of once per batch
        as_they_lie = scale is None and self.cls in WHOLE_TENSOR
        for batch in [[i for b in self.local for i in b]] if as_they_lie else self.local:
            self._step_local([i for i in batch if used[i]], scale, as_they_lie)
        for k, w in enumerate(self.windows):
            if any(used[i] for i in w.slots):
                self._step_window(k, w, used, scale)

    def rank_of(self, i: int) -> int:
        """This rank's place among the ranks parameter ``i``'s owner is one of."""
        return self.own_ranks.get(i, self.rank)

    def _piece(self, i: int) -> tuple:
        """The one piece of owned parameter ``i`` the layout kept whole in this rank's shard
        (checked once, when built)."""
        pieces = self.pieces.get(i, [])
        if len(pieces) != 1 or pieces[0][2] - pieces[0][1] != self.shapes[i].numel():
            raise AssertionError(self.err(f"parameter {i} is not whole in its owner's shard: {pieces}"))
        return pieces[0]

    @torch.no_grad()
    def _step_local(self, stepping: List[int], scale: Optional[torch.Tensor], as_they_lie: bool = False):
        """Owned parameters that lie whole in this rank's shard: stepped in place (their
        gradients handed over as they lie where ``as_they_lie``, else scaled copies)."""
        if not stepping:
            return
        for i in stepping:
            seg, a, b, _ = self.home[i]
            leaf, shape = self.leaves[i], self.shapes[i]
            leaf.data = seg.param[a:b].view(shape)
            g = seg.grad[a:b].view(shape)
            lies = as_they_lie and g.dtype == torch.float32 and g.device == leaf.device
            leaf.grad = g if lies else scaled_grad(g, scale, leaf.device)
        self.inner.step(**self.step_kwargs)
        for i in stepping:
            leaf = self.leaves[i]
            leaf.grad = None
            leaf.data = self._empty if leaf.device == self._empty.device else leaf.new_empty(0)
        # round to the low-precision parameters: one copy per run of adjacent pieces
        for seg, a, b in _runs(self.home[i][:3] for i in stepping):
            if seg.out is not None:
                seg.out[a:b].copy_(seg.param[a:b])

    @torch.no_grad()
    def _step_window(self, k: int, w: Window, used: List[bool], scale: Optional[torch.Tensor]):
        n, dev, pg = self.world_size, self.source.device, self.source.process_group
        buf = torch.zeros(n * w.chunk, dtype=torch.float32, device=dev)
        for i, (owner, off) in w.slots.items():
            base = owner * w.chunk + off
            for seg, a, b, t_off in self.pieces.get(i, ()):
                buf[base + t_off : base + t_off + b - a].copy_(seg.param[a:b])
                if used[i]:
                    g0 = base + w.values + t_off
                    buf[g0 : g0 + b - a].copy_(seg.grad[a:b])
        mine = buf[self.rank * w.chunk : (self.rank + 1) * w.chunk]
        comm.reduce_scatter(
            buf,
            mine,
            group=pg,
            average=False,
            input_is_scratch=True,
            what=f"whole-tensor window {k}: gradients and values to owners",
        ).wait()
        stepping = [i for i, (owner, _) in w.slots.items() if owner == self.rank and used[i]]
        for i in stepping:
            off, numel, leaf = w.slots[i][1], self.shapes[i].numel(), self.leaves[i]
            leaf.data = mine[off : off + numel].view(self.shapes[i])
            g = mine[w.values + off : w.values + off + numel].view(self.shapes[i])
            leaf.grad = g.mul_(scale) if scale is not None else g
        if stepping:
            self.inner.step(**self.step_kwargs)
        for i in stepping:
            self.leaves[i].grad = None
            self.leaves[i].data = self._empty
        out = torch.empty(n * w.values, dtype=torch.float32, device=dev)
        own = out[self.rank * w.values : (self.rank + 1) * w.values]
        own.copy_(mine[: w.values])
        comm.all_gather(own, out, group=pg, what=f"whole-tensor window {k}: updated values from owners").wait()
        for i, (owner, off) in w.slots.items():
            if not used[i]:
                continue
            base = owner * w.values + off
            for seg, a, b, t_off in self.pieces.get(i, ()):
                src = out[base + t_off : base + t_off + b - a]
                seg.param[a:b].copy_(src)
                if seg.out is not None:
                    seg.out[a:b].copy_(src)

    # ------------------------------------------------------------ state dicts
    def owner_state(self, i: int) -> Optional[dict]:
        """The class's state of parameter ``i``, on its owner; None elsewhere or before it stepped."""
        leaf = self.leaves.get(i)
        return None if leaf is None or self.inner is None else self.inner.state.get(leaf)

    def owned(self) -> List[int]:
        """The parameters this rank owns (updates and keeps the state of)."""
        return sorted(self.leaves)

    def owned_states(self) -> Dict[int, dict]:
        """The class's live state of each owned parameter that has any."""
        return {i: st for i in self.owned() if (st := self.owner_state(i))}

    def set_owned_states(self, states: Dict[int, dict]) -> None:
        """Owned parameters take these states (a checkpoint's); the others start fresh."""
        if self.inner is None:
            return
        for i, leaf in self.leaves.items():
            if states.get(i):
                self.inner.state[leaf] = dict(states[i])
            else:
                self.inner.state.pop(leaf, None)

    def gather_full(self, opt, keep: bool) -> Optional[Dict[int, dict]]:
        """The full state in the class's own per-parameter format, on CPU (collective:
        each owner's entries travel batch by batch); None where ``keep`` is false."""
        full: Dict[int, dict] = {}
        for k, batch in enumerate(self.state_batches):
            mine = {}
            for i in batch:
                st = self.owner_state(i)
                if st is not None:
                    mine[i] = {
                        key: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for key, v in st.items()
                    }
            for theirs in comm.all_gather_object(
                mine, group=opt.process_group, what=f"state_dict gather: whole-tensor batch {k}"
            ):
                if keep:
                    full.update(theirs)
        return full if keep else None

    def load_full(self, opt, state: dict, saved_ids: list) -> None:
        """Every owner takes the state of its parameters from a full state dict."""
        owned: Dict[int, dict] = {}
        for i in self.leaves:
            st = state.get(saved_ids[i])
            if st is None:
                continue
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.numel() > self.shapes[i].numel():
                    raise ValueError(
                        self.err(
                            f"state of parameter {i}: {key} has shape {tuple(v.shape)}, larger "
                            f"than the parameter's {tuple(self.shapes[i])}; the state dict "
                            "is of another model"
                        )
                    )
            owned[i] = {
                key: (v.to(self.source.device).clone() if isinstance(v, torch.Tensor) else v) for key, v in st.items()
            }
        self.set_owned_states(owned)

    def state_bytes(self) -> int:
        """Bytes of the class's state on this rank: what it holds; on the meta device (the
        memory planner), what it will hold once every owned parameter has stepped."""
        if self.inner is None:
            return 0
        if self.source.device.type == "meta":
            return sum(self._planned_bytes(i) for i in self.owned())
        return sum(
            v.numel() * v.element_size()
            for st in self.inner.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )

    def _planned_bytes(self, i: int) -> int:
        """The state bytes the class keeps for parameter ``i``, from one step on a small
        probe tensor of the same dimensions (each a distinct prime, so every state
        dimension maps back to the parameter's own)."""
        shape = self.shapes[i]
        probe_dims = _PRIMES[: len(shape)]
        key = (len(shape), self.group_of[i])
        if key not in self._probes:
            p = torch.zeros(probe_dims)
            group = self.inner.param_groups[self.group_index.index(self.group_of[i])]
            o = self.cls([dict(_hyper(group), params=[p])], **self.kwargs)
            p.grad = torch.ones(probe_dims)
            o.step()
            self._probes[key] = [
                (tuple(v.shape), v.element_size()) for v in o.state[p].values() if isinstance(v, torch.Tensor)
            ]
        back = dict(zip(probe_dims, shape))
        return sum(math.prod(back.get(d, d) for d in dims) * size for dims, size in self._probes[key])

    def transient_bytes(self) -> int:
        """The most bytes a step holds at once beyond the state: one window's
        reduce-scatter and all-gather buffers, or one local batch's scaled gradients."""
        return max(
            [4 * self.world_size * (w.chunk + w.values) for w in self.windows]
            + [4 * sum(self.shapes[i].numel() for i in batch) for batch in self.local],
            default=0,
        )

    def balance(self) -> List[int]:
        """Each rank's summed update cost (``update_cost``) of the tensors it owns."""
        load = [0] * self.world_size
        for i, r in self.owners.items():
            if i not in self.own_ranks:  # (a param group over its own ranks balances there)
                load[r] += update_cost(self.shapes[i])
        return load


def _larger_than_a_bucket(ids: List[int], cls, err) -> ValueError:
    """Parameters ``ids`` of a param group over its own ranks, too large for the layout to
    keep each whole in one rank's shard."""
    return ValueError(
        err(
            f"parameters {ids} of a param group over its own ranks are larger than a bucket, so the layout "
            f"cannot keep each whole in one rank's shard, and {cls.__name__} over such a group steps whole "
            "tensors only there: raise bucket_mb above the largest of them"
        )
    )


def _batches(indices: List[int], numels: Dict[int, int], cap: int) -> List[List[int]]:
    """``indices`` in order, cut into runs of at most ``cap`` elements (a run has at least one)."""
    out: List[List[int]] = []
    total = cap
    for i in indices:
        if total + numels[i] > cap:
            out.append([])
            total = 0
        out[-1].append(i)
        total += numels[i]
    return out


def _runs(pieces) -> List[tuple]:
    """``(segment, start, stop)`` pieces merged where one ends where the next (of the
    same segment) starts."""
    out: List[list] = []
    for seg, a, b in sorted(pieces, key=lambda p: (id(p[0]), p[1])):
        if out and out[-1][0] is seg and out[-1][2] == a:
            out[-1][2] = b
        else:
            out.append([seg, a, b])
    return [tuple(r) for r in out]


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
