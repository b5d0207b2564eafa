"""ZeRO-3 gathering: a unit's full parameters all-gathered from the shards
before use and freed after, with the modules' parameter slots swapped to
match (the one place that swaps tensors into modules), and prefetch."""
from __future__ import annotations

from typing import Callable, List

import torch

from .. import comm
from .records import Unit, UnitState


class Gatherer:
    """Gathers and reshards the units of one FullyShard; counts the gathered memory."""

    def __init__(self, units: List[Unit], *, device: torch.device, prefetch: int, comm_elements: dict,
                 err: Callable[[str], str]):
        # (each unit gathers over its own ranks: ``Unit.ranks``)
        self.units, self.device, self.prefetch = units, device, prefetch
        self.comm_elements, self.err = comm_elements, err
        self.gathered_bytes = 0      # full parameters of non-root units alive now
        self.gathered_peak = 0
        self.alive_peak = 0          # most non-root units gathered (or gathering) at once
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
                raise RuntimeError(self.err("this FullyShard keeps its shards on meta (device='meta'); "
                                            "it can report memory but not run"))
            u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
            own = u.own(u.full, u.ranks.rank)
            # (offload_params: from pinned host memory, ordered before the all-gather on the stream)
            own.copy_(u.shard, non_blocking=True)
            u.gather = comm.all_gather(own, u.full, group=u.ranks.group, bounds=u.bounds,
                                       what=self.label(f"unit '{u.name}' all-gather"))
            self.comm_elements["all_gather"] += u.numel
            u.state = UnitState.GATHERING
            if not u.is_root:
                self.gathered_bytes += u.full.numel() * u.full.element_size()
                self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)
                self.alive_peak = max(self.alive_peak, self.alive())
        if wait and u.state == UnitState.GATHERING:
            u.gather.wait()
            u.gather = None
            u.state = UnitState.GATHERED
            _swap(u, gathered=True)

    def reshard(self, u: Unit):
        """Free ``u``'s full parameters; the modules hold the shards again."""
        if u.state == UnitState.SHARDED:
            return
        if u.state == UnitState.GATHERING:
            u.gather.wait()
            u.gather = None
        u.full.untyped_storage().resize_(0)
        _swap(u, gathered=False)
        u.state = UnitState.SHARDED
        if not u.is_root:
            self.gathered_bytes -= u.full.numel() * u.full.element_size()

    def alive(self) -> int:
        return sum(1 for u in self.units[1:] if u.state != UnitState.SHARDED)

    def prefetch_after(self, order: List[int], pos: int):
        """Start gathering the units after position ``pos`` of ``order``."""
        for ui in order[pos + 1:pos + 1 + self.prefetch]:
            u = self.units[ui]
            if u.state != UnitState.SHARDED:
                continue
            if self.alive() >= self.prefetch + 1:
                break
            self.gather(u, wait=False)

    @torch.no_grad()
    def reshard_all(self):
        for u in self.units:
            self.reshard(u)

    def reset_peaks(self):
        self.gathered_peak, self.alive_peak = self.gathered_bytes, self.alive()


def _swap(u: Unit, gathered: bool):
    """Point every module slot of ``u``'s parameters at the full (gathered) or sharded parameter.
    A full parameter requires grad as its sharded piece does now: one frozen after wrapping
    (``requires_grad_(False)`` on what ``model.parameters()`` yields) takes no gradient, as
    a parameter no forward used, and one unfrozen again trains. (One frozen when wrapped has
    no gradient path until its optimizer's zero_grad() lays its unit out again:
    relayout.thaw.)"""
    for q in u.params:
        if gathered and q.requires_grad and q.full.requires_grad != q.sharded.requires_grad:
            q.full.requires_grad_(q.sharded.requires_grad)
        for mod, attr in q.slots:
            mod._parameters[attr] = q.full if gathered else q.sharded
