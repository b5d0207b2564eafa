"""ZeRO-3's fold policy: a unit's gradients are moved into one flat buffer once
all have arrived, reduce-scattered (SUM), then divided by every rank and written
(or added) into the unit's fp32 gradient shard, on the device or in host memory
([Note: reduction pipeline] in core/reduction.py; [Note: fully shard policy]
in zero3/fully_shard.py)."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..core.reduction import FoldPolicy, Reduction
from ..core.segments import squared_norms
from ..core.tensor_parallel import local_tensor
from ..native.layout import fill_flat
from ..offload import HostCopies
from .param import ShardedTensor
from .piecewise import everyones
from .records import Param, Unit
from .wrap import host_or_device_empty


class DivideIntoShardFold(FoldPolicy):
    """The fold of one FullyShard's units; ``divisor``: every rank taking part (replicas
    too), or the factor ``set_gradient_divide_factor`` set; ``label``: names a collective
    of this FullyShard's current step."""

    def __init__(self, *, device: torch.device, reduce_dtype: torch.dtype, divisor: float, label: Callable[[str], str]):
        self.device, self.reduce_dtype, self.divisor = device, reduce_dtype, divisor
        self._label = label
        self.grad_bytes = 0  # flat gradient buffers alive now
        self.grad_bytes_peak = 0
        # to gradient shards in host memory ([Note: offloaded gradients] in offload/copies.py)
        self.host_copies = HostCopies(device)
        # folds the finished reductions before a buffer is taken (set by the pipeline's owner)
        self.retire_completed: Callable[[], None] = lambda: None

    def label(self, r: Reduction, what: str) -> str:
        return self._label(f"{r.name} {what}")

    @staticmethod
    def move_grad(u: Unit, q: Param):
        """Add ``q``'s gradient into the unit's flat buffer (accumulating) and free it."""
        flat = u.reduction.buffer
        flat[q.offset : q.offset + q.numel].add_(local_tensor(q.full.grad).reshape(-1))
        q.full.grad = None

    def flatten(self, u: Unit):
        """Move the gradients autograd left on the unit's full parameters into its
        flat gradient buffer, allocated now: not at the unit's first gradient,
        while the unit's activations are still alive (the peak of backward)."""
        r = u.reduction
        if r.buffer is not None:  # accumulating: add what arrived since
            for q in u.trainable:
                if q.full.grad is not None:
                    self.move_grad(u, q)
            return
        self.retire_completed()  # free finished reductions' buffers before taking another
        r.buffer = torch.empty(u.grad_numel, dtype=self.reduce_dtype, device=self.device)
        self.grad_bytes += r.buffer.numel() * r.buffer.element_size()
        self.grad_bytes_peak = max(self.grad_bytes_peak, self.grad_bytes)
        # one pass: gradients copied in; padding and gradients that never arrived are zero
        fill_flat(
            r.buffer,
            [(q.offset, local_tensor(q.full.grad).reshape(-1)) for q in u.trainable if q.full.grad is not None],
        )
        for q in u.trainable:
            q.full.grad = None

    def reduce_input(self, r: Reduction) -> Tuple[torch.Tensor, torch.Tensor, Optional[List[int]]]:
        u: Unit = r.owner
        self.flatten(u)  # a unit some gradient never reached: the rest count as zero
        # overwrite the shard unless the user kept gradients from an earlier backward
        forget_cleared(u)
        u.fresh = r.grad.tensor is None
        return r.buffer, u.own_grad(r.buffer, u.ranks.rank), u.reduce_bounds()

    def fold(self, r: Reduction):
        """Divide the reduced chunk by every rank and write (or add) it into the fp32 shard."""
        u: Unit = r.owner
        chunk, g = r.out, r.grad
        divisor = self.divisor if u.settings.divide_factor is None else u.settings.divide_factor
        if g.tensor is None:  # first reduction since zero_grad(set_to_none=True)
            # with the fp32 shard, or in host memory ([Note: offloaded gradients]); not
            # zeroed: u.fresh, so each path below overwrites the whole chunk's length
            where = torch.device("cpu") if u.grad_to_host else u.shard.device
            g.tensor = host_or_device_empty(chunk.numel(), where, self.device)
            u.fresh = True
        written = g.tensor  # the fresh values, on the reducing device
        if g.tensor.device != chunk.device:  # in host memory: divide here, then to host
            written = chunk.float().div_(divisor)  # (the chunk is scratch: freed below)
            if u.fresh:  # asynchronous into pinned memory; the backward's end waits before the step reads it
                self.host_copies.copy(g.tensor, written)
            else:
                g.tensor.add_(written.cpu())
        elif u.fresh and chunk.dtype == torch.float32:
            torch.div(chunk, divisor, out=g.tensor)  # one pass
        elif u.fresh:
            g.tensor.copy_(chunk).div_(divisor)  # divide in fp32
        else:
            g.tensor.add_(chunk.float().div_(divisor))
        # the statistics' squared norms of a shard bound for host memory, taken here on the
        # device rather than over host memory on the CPU after the backward
        g.sumsq = _sumsq_of_pieces(u, written) if u.grad_to_host and u.fresh else None
        expose_grads(u)
        self.drop_buffer(u)

    def release(self, r: Reduction) -> None:
        self.drop_buffer(r.owner)

    def drop_buffer(self, u: Unit):
        if u.reduction.buffer is not None:
            self.grad_bytes -= u.reduction.buffer.numel() * u.reduction.buffer.element_size()
            u.reduction.buffer = None


def _sumsq_of_pieces(u: Unit, shard: torch.Tensor) -> dict:
    """{piece's offset in the shard: its squared norm} over ``shard``, a unit's fresh
    averaged gradient shard (one foreach launch over the unit's pieces)."""
    pieces = [q for q in u.trainable if q.local.numel() > 0]
    if not pieces:
        return {}
    vals = squared_norms([shard[q.shard_offset : q.shard_offset + q.local.numel()] for q in pieces])
    return {q.shard_offset: vals[k] for k, q in enumerate(pieces)}


def expose_grads(u: Unit):
    """Each sharded parameter's ``.grad``: its view of the unit's gradient shard. None
    when the shard is in host memory and the parameter is not (``grad_to_host``:
    torch keeps ``.grad`` on the parameter's device; the optimizer reads the shard),
    and for a parameter no backward reached here since ``zero_grad(set_to_none=True)``,
    as torch leaves it (a ShardedOptimizer then puts in the gradient any rank gave)."""
    shard = u.reduction.grad.tensor
    same = shard.device == u.shard.device
    for q in u.trainable:
        q.exposed = ShardedTensor.of(_piece(shard, q), q.sharded) if same and q.got_grad else None
        q.sharded.grad = q.exposed


def _piece(shard: torch.Tensor, q: Param) -> torch.Tensor:
    """``q``'s range of its unit's gradient shard."""
    return shard[q.shard_offset : q.shard_offset + q.local.numel()]


@torch.no_grad()
def expose_agreed(units: List[Unit], group, what: str):
    """After a synced backward with no ShardedOptimizer: ``p.grad`` of every parameter some
    rank gave a gradient (its averaged piece, zero where no rank's gradient reached it), as
    DDP leaves one, so a torch optimizer steps the same parameters on every rank ([Note:
    torch optimizers over sharded parameters]); a parameter none gave one keeps None, and
    torch skips it. One all-gather of a flag per parameter over ``group`` (every rank)."""
    qs = [(u, q) for u in units for q in u.trainable]
    if not qs:
        return
    flags = torch.tensor([float(q.got_grad) for _, q in qs], device=qs[0][0].shard.device)
    for (u, q), f in zip(qs, everyones(flags, group, what).amax(0).tolist()):
        g = u.reduction.grad.tensor
        if f and q.exposed is None and g is not None and g.device == u.shard.device:
            q.got_grad = True
            q.exposed = ShardedTensor.of(_piece(g, q), q.sharded)
            q.sharded.grad = q.exposed


def forget_cleared(u: Unit):
    """Gradients the script cleared since the last backward (a torch optimizer's
    ``zero_grad()`` sets ``p.grad`` to None, [Note: torch optimizers over sharded
    parameters] in zero3/piecewise.py): this backward writes them afresh, as torch
    starts a None ``.grad`` over, instead of adding to what the shard kept."""
    g = u.reduction.grad
    if g.tensor is None:
        return
    cleared = [q for q in u.trainable if q.exposed is not None and q.sharded.grad is None]
    if not cleared:
        return
    g.sumsq = None
    if all(q.sharded.grad is None for q in u.trainable):
        g.tensor = None  # every one: the fold overwrites the shard (a replica-local ``partial`` is this window's)
    for q in cleared:
        if g.tensor is not None:
            _piece(g.tensor, q).zero_()
        q.exposed, q.got_grad = None, q.arrived
