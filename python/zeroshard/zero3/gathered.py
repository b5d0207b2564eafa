"""FullyShard's ``gathered()`` block: units kept gathered while it runs.

[Note: gathered blocks] ``with model.gathered(dtype=None, units=None):``
keeps the units (all, or those holding the parameters of the modules and
parameters ``units`` names) gathered until the block ends, whatever runs
inside: forwards (a decoding loop gathers nothing per token), reads of the
full parameters through their modules (``model.module.lm_head.weight``),
edits. It is collective: every rank enters it (it checks in first, [Note:
rank-0 code] in comm/collectives.py).

* dtype. None: the gather dtype (``param_dtype``); the block holds the very
  buffers forwards and backwards use, so gradients flow as outside it (a
  backward inside reduces as usual; a unit is not gathered again for each
  forward). Another dtype: a copy all-gathered from the fp32 shards (which
  it never touches), whose parameters take no gradient: a backward that
  reaches one raises, naming it.
* Memory. Before anything is gathered the block adds up the bytes of the
  units it must gather (their full size in ``dtype``) and compares them
  with what the device has free (CUDA: the driver's free memory plus what
  torch's allocator holds unused; CPU: the kernel's MemAvailable); more is
  refused, naming the bytes and ``units=``.
* While held, a unit is resharded by nothing (not by the forward that ends,
  the backward, or ``invalidate``); when the shards change (an optimizer
  step, a checkpoint or state dict loaded) the held units are gathered again
  from them, so the block sees the new values.
* Exit, also on an exception: the units the block gathered are resharded (a
  copy is dropped); one already gathered when it began (by a forward or
  backward in progress, or an enclosing block) stays as that left it.
  Nested blocks over the same unit must ask for one dtype.
* ``unshard()`` / ``reshard()`` (FSDP2's explicit calls): ``unshard()``
  enters a block over every unit and ``reshard()`` leaves it, so between
  them the model is gathered as inside ``with model.gathered():`` (a
  forward, a backward or ``generate`` gathers nothing; a step's new values
  are gathered again from the shards). A second ``unshard()`` before
  ``reshard()`` changes nothing, as a ``reshard()`` without one. It returns
  FSDP2's handle; its gathers are complete when it returns, or, with
  ``async_op=True``, in flight until its ``wait()`` or until whatever uses a
  unit first (a forward, a backward, a step's new values) waits for that
  unit's, as for a prefetch; the caller's work overlaps them meanwhile.
* ``modifier_rank=r`` (DeepSpeed's ``GatheredParameters``): on a normal
  exit, the values of the held units on global rank r are broadcast to every
  rank of the model and each rank copies its chunk into its fp32 shard: an
  edit made on rank r inside the block (``weight.data.normal_()``) becomes
  the master weights everywhere. The block then gathers in float32, the
  shards' dtype, so the edit is kept at full precision (another ``dtype`` is
  refused); units of expert modules (their own ranks) are refused.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, List, Optional

import torch
import torch.nn as nn

from .. import comm
from .gather import Gatherer
from .records import Unit, UnitState


def free_bytes(device: torch.device) -> Optional[int]:
    """Bytes that can still be allocated on ``device``; None where that is not known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def pick_units(units: List[Unit], chosen, err) -> List[Unit]:
    """The units holding the parameters of ``chosen`` (modules and parameters of the model;
    None: every unit), in the model's order."""
    if chosen is None:
        return [u for u in units if u.params]
    if isinstance(chosen, (nn.Module, torch.Tensor)):
        chosen = [chosen]
    where = {}
    for u in units:
        for q in u.params:
            for t in (q.sharded, q.full, *(u.copy[1] if u.copy is not None else ())):
                where[id(t)] = u.index
    picked = set()
    for x in chosen:
        if not isinstance(x, (nn.Module, torch.Tensor)):
            raise TypeError(
                err(f"gathered(units=...) takes modules and parameters of the model, got {type(x).__name__}")
            )
        params = list(x.parameters()) if isinstance(x, nn.Module) else [x]
        found = [where[id(p)] for p in params if id(p) in where]
        if not found:
            what = type(x).__name__ if isinstance(x, nn.Module) else f"parameter of shape {tuple(x.shape)}"
            raise ValueError(
                err(
                    f"gathered(units=...): the {what} holds no parameter of this FullyShard model; "
                    "pass its modules (model.module.blocks[0]) or their parameters"
                )
            )
        picked.update(found)
    return [u for u in units if u.index in picked]


def check_fits(units: List[Unit], dtype: torch.dtype, gatherer: Gatherer, err) -> None:
    """Refuse, before gathering, units whose full parameters the device has no room for."""
    need = sum(
        u.numel * dtype.itemsize
        for u in units
        if (u.state == UnitState.SHARDED if dtype == u.full.dtype else u.copy is None)
    )
    free = free_bytes(gatherer.device) if need else None
    if free is not None and need > free:
        raise RuntimeError(
            err(
                f"gathered(): the {len(units)} unit(s) asked for need {need} bytes ({need / 2**30:.2f} GiB) of "
                f"{gatherer.device} memory gathered in {dtype}, but {free} bytes ({free / 2**30:.2f} GiB) are free. "
                "Gather part of the model at a time with units=[...] (modules or parameters, e.g. "
                "units=[model.module.blocks[0]]), or a smaller dtype="
            )
        )


def _check_dtype(dtype, gather_dtype: torch.dtype, modifier_rank, experts: bool, err) -> torch.dtype:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(err(f"gathered(dtype=...) takes a floating torch.dtype or None, got {dtype!r}"))
    dtype = dtype or gather_dtype
    if modifier_rank is not None and dtype != torch.float32:
        raise ValueError(
            err(
                f"gathered(modifier_rank={modifier_rank}) writes the gathered values into the fp32 shards: gather "
                f"in torch.float32 (dtype=torch.float32), not {dtype}, or the whole units would be rounded to it"
            )
        )
    if modifier_rank is not None and experts:
        raise NotImplementedError(
            err(
                "gathered(modifier_rank=...) over units of expert modules (sharded over their own ranks): each "
                "expert-parallel rank holds other experts; edit them with load_state_dict instead"
            )
        )
    return dtype


@contextlib.contextmanager
def gathered_block(
    units: List[Unit],
    gatherer: Gatherer,
    *,
    dtype: Optional[torch.dtype],
    gather_dtype,
    chosen,
    every,
    modifier_rank: Optional[int],
    who,
    err,
) -> Iterable[None]:
    """FullyShard.gathered (see the Note): ``gather_dtype``: its param_dtype; ``every``: the
    model's ranks; ``who``: the FullyShard (its rank, for the check-in)."""
    picked = pick_units(units, chosen, err)
    dtype = _check_dtype(dtype, gather_dtype, modifier_rank, any(u.ranks.own for u in picked), err)
    ranks = torch.distributed.get_process_group_ranks(every)
    if modifier_rank is not None and modifier_rank not in ranks:
        raise ValueError(err(f"gathered(modifier_rank={modifier_rank}): not one of the model's ranks {ranks}"))
    comm.check_in(
        "FullyShard.gathered()",
        who,
        every,
        "gathered() all-gathers the units: enter it on every rank, and edit on one rank inside it",
    )
    check_fits(picked, dtype, gatherer, err)
    held: List[tuple] = []
    try:
        with torch.no_grad():
            for u in picked:
                was = u.state == UnitState.SHARDED
                gatherer.hold(u, dtype)
                held.append((u, was))
        yield
        if modifier_rank is not None:
            for u, _ in held:
                gatherer.adopt(u, modifier_rank, every)
    finally:
        with torch.no_grad():
            for u, was in reversed(held):
                gatherer.release(u, reshard=was)


class UnshardHandle:
    """What ``unshard()`` returns, as FSDP2's: ``wait()`` until the units are gathered (at
    once where its gathers completed before unshard returned)."""

    def __init__(self, finish: Optional[Callable[[], None]] = None):
        self._finish = finish

    def wait(self) -> None:
        if self._finish is not None:
            with torch.no_grad():
                self._finish()
            self._finish = None


def unshard(gatherer: Gatherer, open_block, async_op: bool) -> UnshardHandle:
    """Enter ``open_block()`` (a gathered() block over every unit) until ``reshard``,
    unless one is already entered; ``async_op``: its all-gathers left in flight, finished
    by the handle's ``wait()`` or by whatever uses a unit first. See the Note."""
    if gatherer.unsharded is None:
        block = open_block()
        with gatherer.holding_in_flight() if async_op else contextlib.nullcontext():
            block.__enter__()
        gatherer.unsharded = block
    return UnshardHandle(gatherer.finish_holds)


def reshard(gatherer: Gatherer) -> None:
    """Leave the block ``unshard`` entered, if any: its units back to their shards."""
    block, gatherer.unsharded = gatherer.unsharded, None
    if block is not None:
        block.__exit__(None, None, None)
