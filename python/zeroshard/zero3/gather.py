"""ZeRO-3 gathering: a unit's full parameters all-gathered from the shards
before use and freed after, with the modules' parameter slots swapped to
match (the one place that swaps tensors into modules), and prefetch.

[Note: post-forward shards] ``reshard_after_forward=k`` (an int, as FSDP2's:
a divisor of the shard group's size, usually a node's GPUs) frees a unit
after a forward with gradients but keeps a second shard of its gathered
parameters, in the gather dtype, over groups of ``k`` consecutive ranks of
the shard group: rank j of such a group keeps elements [j c, (j + 1) c) of
the flat unit, c = ceil(numel / k). The unit's backward (and activation
checkpointing's recomputation, and the backward's prefetch) all-gathers it
from those pieces over the ``k`` ranks only, so at scale the backward's
weight traffic stays inside a node; the piece is dropped once gathered.
Memory: numel / k elements of the gather dtype per unit from its forward to
its backward (``memory_report``'s ``gathered`` counts them). A gather that
is not the backward's (the next forward, a state dict) drops the piece and
gathers from the fp32 shards, so nothing stale is ever computed on; so do
the end of a backward and one that stopped half-way. ``k == 1`` is False
and ``k`` equal to the shard group's size is True, as FSDP2 takes them;
units of expert modules (their own ranks) reshard fully.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, List, Union

import torch
import torch.distributed as dist

from .. import comm
from ..core.tensor_parallel import compute_param
from ..comm.mesh import post_forward_group
from ..native import quant
from .records import Unit, UnitState


def reshard_setting(value, world: int, who: str) -> Union[bool, int]:
    """``reshard_after_forward`` as FSDP2 takes it: a bool, or an int dividing ``world``, the
    size of the shard group ([Note: post-forward shards]): 1 is False, ``world`` True."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1 or world % value:
        raise ValueError(
            f"{who}(reshard_after_forward={value!r}): pass a bool, or an int dividing the {world} ranks the "
            "units shard over (a node's ranks, say): each unit's backward then all-gathers over that many"
        )
    if value == 1:
        warnings.warn(
            f"{who}(reshard_after_forward=1): an int is the number of ranks a unit is resharded to after its "
            "forward; 1 keeps it gathered to its backward, as reshard_after_forward=False (which says so)",
            stacklevel=3,
        )
        return False
    return True if value == world else value


class Gatherer:
    """Gathers and reshards the units of one FullyShard; counts the gathered memory."""

    def __init__(
        self, units: List[Unit], *, device: torch.device, prefetch: int, comm_elements: dict, err: Callable[[str], str]
    ):
        # (each unit gathers over its own ranks: ``Unit.ranks``)
        self.units, self.device, self.prefetch = units, device, prefetch
        self.comm_elements, self.err = comm_elements, err
        self.gathered_bytes = 0  # full parameters of non-root units alive now
        self.unsharded = None  # the gathered() block unshard() entered, until reshard()
        self.in_flight = False  # holds return with their all-gathers in flight: holding_in_flight()
        # (gather_dtype, block size) of MixedPrecision's quantized gathers, or None
        self.quantized = None
        self._layouts: dict = {}  # a unit's wire layout by (index, its layout): _wire_layout
        self.gathered_peak = 0
        self.alive_peak = 0  # most non-root units gathered (or gathering) at once
        # what the collectives' labels say (the flight record, the hang diagnosis): the step
        # they belong to (as stages 1/2 count it: steps that updated the shards, plus one)
        # and the phase, set by UnitBackward when a backward starts and ends
        self.steps_done = 0
        self.phase = "forward"

    def label(self, what: str, phase: bool = True) -> str:
        """``what`` prefixed with the step (and the phase), e.g. "step 4 backward, unit 'blocks.2' all-gather"."""
        return f"step {self.steps_done + 1}{' ' + self.phase if phase else ''}, {what}"

    def gather(self, u: Unit, wait: bool = True):
        """Start gathering ``u`` if it is sharded; with ``wait``, finish and swap its full
        parameters into the modules."""
        if u.state == UnitState.SHARDED and u.params:
            if self.device.type == "meta":
                raise RuntimeError(
                    self.err(
                        "this FullyShard keeps its shards on meta (device='meta'); it can report memory but not run"
                    )
                )
            u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
            if u.post_forward is not None and self.phase == "backward":
                u.gather = self._from_post_forward(u)
            elif self.quantized is not None:
                self.drop_post_forward(u)
                u.gather = self._quantized(u)
            else:
                self.drop_post_forward(u)
                own = u.own(u.full, u.ranks.rank)
                # (offload_params: from pinned host memory, ordered before the all-gather on the stream)
                own.copy_(u.shard, non_blocking=True)
                u.gather = comm.all_gather(
                    own, u.full, group=u.ranks.group, bounds=u.bounds, what=self.label(f"unit '{u.name}' all-gather")
                )
            self.comm_elements["all_gather"] += u.numel
            u.state = UnitState.GATHERING
            if not u.is_root:
                self.gathered_bytes += u.full.numel() * u.full.element_size()
                self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)
                self.alive_peak = max(self.alive_peak, self.alive())
        if wait and u.state == UnitState.GATHERING:
            u.gather.wait()
            u.gather = None
            self._decode(u)
            u.state = UnitState.GATHERED
            _swap(u, gathered=True)

    def reshard(self, u: Unit, keep: int = 0):
        """Free ``u``'s full parameters; the modules hold the shards again. ``keep`` > 1: keep
        a piece over that many ranks for the backward ([Note: post-forward shards]). A unit a
        gathered() block holds stays gathered ([Note: gathered blocks] in zero3/gathered.py)."""
        if u.held:
            return
        if u.state == UnitState.SHARDED:
            self.drop_post_forward(u)
            return
        if u.state == UnitState.GATHERING:
            u.gather.wait()
            u.gather, u.wire = None, None
        elif keep > 1 and not u.ranks.own and u.copy is None:
            ranks = post_forward_group(u.ranks, keep)
            lo, hi = _piece(u.numel, keep, ranks.rank)
            u.post_forward = (ranks, u.full[lo:hi].clone())
            self.gathered_bytes += (hi - lo) * u.full.element_size()
        u.full.untyped_storage().resize_(0)
        _swap(u, gathered=False)
        u.state = UnitState.SHARDED
        if not u.is_root:
            self.gathered_bytes -= u.full.numel() * u.full.element_size()

    def _quantized(self, u: Unit) -> comm.CommHandle:
        """Start ``u``'s all-gather of block-quantized shards ([Note: quantized gathers] in
        csrc/quant.h): this rank's shard encoded into its wire record, every rank's gathered;
        the wait decodes them into the full buffer."""
        kind, block = self.quantized
        bounds, segs, starts = self._wire_layout(u, block)
        wire = torch.empty(starts[-1], dtype=torch.float32, device=self.device)  # (bytes, as float32 words)
        r = u.ranks.rank
        mine = wire[starts[r] : starts[r + 1]]
        shard = u.shard[: bounds[r + 1] - bounds[r]].to(self.device, non_blocking=True)
        quant.quantize_blocks_(shard, mine.view(torch.uint8), segs[r], block, kind)
        u.wire = (wire.view(torch.uint8), [n for counts in segs for n in counts])
        what = self.label(f"unit '{u.name}' all-gather in {kind}")
        return comm.all_gather(mine, wire, group=u.ranks.group, bounds=starts, what=what)

    def _wire_layout(self, u: Unit, block: int):
        """``u``'s chunk bounds, each rank's segments and where each rank's records start (in
        float32 words; records are whole words), computed once per layout of the unit."""
        key = (u.index, u.numel, u.shard_numel, u.bounds and tuple(u.bounds), tuple(q.offset for q in u.params))
        if key not in self._layouts:
            bounds = [u.span(r)[0] for r in range(u.ranks.world)] + [u.numel]
            segs = quant.segments(bounds, [c for q in u.params for c in (q.offset, q.offset + q.numel)])
            starts = [0]
            for counts in segs:
                starts.append(starts[-1] + quant.record_bytes(counts, block) // 4)
            self._layouts[key] = (bounds, segs, starts)
        return self._layouts[key]

    def _decode(self, u: Unit):
        """A quantized all-gather of ``u`` that completed: its records decoded into the full buffer."""
        if u.wire is not None:  # ([Note: quantized gathers] in csrc/quant.h)
            kind, block = self.quantized
            quant.dequantize_blocks_(u.wire[0], u.full, u.wire[1], block, kind)
            u.wire = None

    def drop_post_forward(self, u: Unit):
        """Forget ``u``'s post-forward piece, if any ([Note: post-forward shards])."""
        if u.post_forward is not None:
            self.gathered_bytes -= u.post_forward[1].numel() * u.post_forward[1].element_size()
            u.post_forward = None

    def _from_post_forward(self, u: Unit) -> comm.CommHandle:
        """Start ``u``'s all-gather from its post-forward pieces over their ranks; drop its own."""
        ranks, piece = u.post_forward
        lo, hi = _piece(u.numel, ranks.world, ranks.rank)
        u.full[lo:hi].copy_(piece)
        self.drop_post_forward(u)
        bounds = [_piece(u.numel, ranks.world, r)[0] for r in range(ranks.world)] + [u.numel]
        what = self.label(f"unit '{u.name}' all-gather from its post-forward shards ({ranks.world} ranks)")
        return comm.all_gather(u.full[lo:hi], u.full, group=ranks.group, bounds=bounds, what=what)

    def alive(self) -> int:
        return sum(1 for u in self.units[1:] if u.state != UnitState.SHARDED)

    def prefetch_after(self, order: List[int], pos: int):
        """Start gathering the units after position ``pos`` of ``order``."""
        for ui in order[pos + 1 : pos + 1 + self.prefetch]:
            u = self.units[ui]
            if u.state != UnitState.SHARDED:
                continue
            if self.alive() >= self.prefetch + 1:
                break
            self.gather(u, wait=False)

    def prefetch_these(self, indices: List[int]):
        """Start gathering the units ``indices`` names (FSDP2's explicit prefetch lists: each
        one listed, however many)."""
        for ui in indices:
            if self.units[ui].state == UnitState.SHARDED:
                self.gather(self.units[ui], wait=False)

    @torch.no_grad()
    def reshard_all(self):
        for u in self.units:
            self.reshard(u)

    def reset_peaks(self):
        self.gathered_peak, self.alive_peak = self.gathered_bytes, self.alive()

    # ------------------------------------------------------- gathered() blocks
    def hold(self, u: Unit, dtype: torch.dtype):
        """Gather ``u`` and keep it gathered until ``release`` ([Note: gathered blocks] in
        zero3/gathered.py): in the gather dtype, its full parameters; in another ``dtype``, a
        copy made from the shards whose parameters take no gradient."""
        if u.copy is not None and u.copy[0].dtype != dtype or u.copy is None and u.held and dtype != u.full.dtype:
            have = u.copy[0].dtype if u.copy is not None else u.full.dtype
            raise RuntimeError(
                self.err(
                    f"unit '{u.name}' is held gathered in {have} by an enclosing gathered() block and asked for "
                    f"in {dtype} by this one: nest gathered() blocks with one dtype"
                )
            )
        if dtype == u.full.dtype:
            self.gather(u, wait=not self.in_flight)
        elif u.copy is None:
            if u.state != UnitState.SHARDED:
                raise RuntimeError(
                    self.err(
                        f"gathered(dtype={dtype}) while unit '{u.name}' is gathered for a forward or backward in "
                        f"progress (in {u.full.dtype}): enter the block before the forward or after the backward, "
                        "or leave dtype unset"
                    )
                )
            flat = torch.empty(u.numel, dtype=dtype, device=self.device)
            self._fill(u, flat, f"unit '{u.name}' all-gather in {dtype} (gathered())")
            params = [
                compute_param(flat[q.offset : q.offset + q.numel].view(q.shape), q.placed, q.sharded.requires_grad)
                for q in u.params
            ]
            for q, p in zip(u.params, params):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _, q=q: self._no_grad_on_copy(q, dtype))
            u.copy, u.state = (flat, params), UnitState.GATHERED
            _swap(u, gathered=True)
            if not u.is_root:
                self.gathered_bytes += flat.numel() * flat.element_size()
                self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)
                self.alive_peak = max(self.alive_peak, self.alive())
        u.held += 1

    @contextlib.contextmanager
    def holding_in_flight(self):
        """Holds made inside (in the gather dtype) return with their all-gathers in flight
        (FSDP2's ``unshard(async_op=True)``); whatever uses such a unit first (a forward, a
        backward, ``finish_holds``) waits for its gather, as for a prefetch."""
        self.in_flight = True
        try:
            yield
        finally:
            self.in_flight = False

    def finish_holds(self):
        """Wait for the all-gathers of the held units still in flight."""
        for u in self.units:
            if u.held and u.state == UnitState.GATHERING:
                self.gather(u)

    def release(self, u: Unit, reshard: bool):
        """One block stops holding ``u``: after the last, its copy is dropped, or (``reshard``:
        the block gathered it) it is resharded; a unit a forward or backward in progress had
        gathered stays gathered for them."""
        u.held -= 1
        if u.held:
            return
        if u.copy is not None:
            flat = u.copy[0]
            if not u.is_root:
                self.gathered_bytes -= flat.numel() * flat.element_size()
            u.copy, u.state = None, UnitState.SHARDED
            _swap(u, gathered=False)
        elif reshard:
            self.reshard(u)

    def full_buffer(self, u: Unit) -> torch.Tensor:
        """The flat buffer ``u``'s modules compute on while it is gathered."""
        return u.copy[0] if u.copy is not None else u.full

    @torch.no_grad()
    def refresh_held(self):
        """The shards changed (a step, a load): the units gathered() blocks hold are gathered again."""
        self.finish_holds()
        for u in self.units:
            if u.held and self.quantized is not None and u.copy is None:  # (as the forward computes with it)
                self._quantized(u).wait()
                self._decode(u)
            elif u.held:
                self._fill(u, self.full_buffer(u), f"unit '{u.name}' all-gather (gathered(), the shards changed)")

    @torch.no_grad()
    def adopt(self, u: Unit, src: int, group):
        """The values of held unit ``u`` on global rank ``src`` become every rank's: broadcast
        over ``group`` (every rank of the model), each rank's chunk copied into its fp32 shard."""
        flat = self.full_buffer(u)
        dist.broadcast(flat, src=src, group=group)
        own = u.own(flat, u.ranks.rank)
        u.shard[: own.numel()].copy_(own)

    def _fill(self, u: Unit, flat: torch.Tensor, what: str):
        own = u.own(flat, u.ranks.rank)
        own.copy_(u.shard[: own.numel()])
        comm.all_gather(own, flat, group=u.ranks.group, bounds=u.bounds, what=self.label(what)).wait()
        self.comm_elements["all_gather"] += u.numel

    def _no_grad_on_copy(self, q, dtype: torch.dtype):
        raise RuntimeError(
            self.err(
                f"a gradient reached parameter '{q.names[0]}' as gathered in {dtype} by gathered(dtype=...): that "
                "copy takes no gradients (its shards stay as they are). Run the backward outside the block, or "
                "gather without dtype= (the gather dtype) to train inside it"
            )
        )


def _piece(numel: int, k: int, j: int):
    """Rank ``j``'s piece [lo, hi) of a flat unit of ``numel`` elements kept over ``k`` ranks."""
    c = -(-numel // k)
    return min(j * c, numel), min((j + 1) * c, numel)


def _swap(u: Unit, gathered: bool):
    """Point every module slot of ``u``'s parameters at the full (gathered) or sharded parameter.
    A full parameter requires grad as its sharded piece does now: one frozen after wrapping
    (``requires_grad_(False)`` on what ``model.parameters()`` yields) takes no gradient, as
    a parameter no forward used, and one unfrozen again trains. (One frozen when wrapped has
    no gradient path until its optimizer's zero_grad() lays its unit out again:
    relayout.retrain.)"""
    copies = u.copy[1] if u.copy is not None else [None] * len(u.params)
    for q, copy in zip(u.params, copies):
        if gathered and copy is None and q.requires_grad and q.full.requires_grad != q.sharded.requires_grad:
            q.full.requires_grad_(q.sharded.requires_grad)
        for mod, attr in q.slots:
            mod._parameters[attr] = (q.full if copy is None else copy) if gathered else q.sharded
