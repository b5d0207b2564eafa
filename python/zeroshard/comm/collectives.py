"""Collectives on flat buffers over a torch.distributed process group.

Thin wrappers over csrc/comm.cpp (see [Note: collective ordering] in
csrc/comm.h): each returns a handle; call ``.wait()`` before using the result.
Each is recorded in the flight record, labelled with ``what`` it serves (see
[Note: flight record] in comm/flight.py).

[Note: one rank] Over a group of one rank (a single process, or a shard or
replica group of one) a collective is only a copy: reduce-scatter's and
all-gather's output is the input, an all-reduce leaves its tensor as it is.
So none is issued to the transport nor recorded: the copy is made (none when
the output is the input, as in place) and a handle that is already done is
returned, as FSDP2 issues nothing at world size 1.
"""

from __future__ import annotations

import atexit
import collections
import gc
import pickle
import time
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from . import flight, watchdog
from ..native.ext import _C


@atexit.register
def _collect_before_teardown() -> None:
    """[Note: process groups at exit] Objects in reference cycles (optimizers, models)
    can hold the last references to process groups and to tensors a gloo worker
    thread still holds. Freed by the interpreter's teardown, a gloo thread then
    drops a tensor's Python object with no interpreter left to take it, and the
    process aborts ("terminate called without an active exception") after the
    script finished. Collecting them here, while the interpreter is whole, frees
    them normally. (Registered first of zeroshard's exit hooks, it runs last:
    after the overlapped parameter gathers have settled.)"""
    gc.collect()


def on_rank(who, msg: str) -> str:
    """``msg`` prefixed with ``[rank r/N]`` of ``who`` (anything with ``rank`` and ``world_size``):
    every error message of the library that depends on the rank says which one."""
    return f"[rank {who.rank}/{who.world_size}] {msg}"


_checkins: collections.Counter = collections.Counter()


def check_in(what: str, who, group: Optional[dist.ProcessGroup] = None, hint: str = "") -> None:
    """Wait until every rank of ``group`` has called ``check_in(what)`` as many
    times as this one, or raise ``CollectiveTimeout`` after the watchdog's
    timeout naming the ranks that did not; ``who`` (with ``rank`` and
    ``world_size``) prefixes the error and ``hint`` ends it (how to do the same
    from one rank).

    Guards a collective that code under ``if rank == 0:`` would otherwise enter
    alone. It goes through the default store, not the communicator, costs one
    store round trip, and is a flight record of kind ``check_in``.

    [Note: rank-0 code] Training scripts run code on the master rank alone:
    checkpoints, evaluation, logging. Each zeroshard call that is collective and
    that such code reaches checks in first, through the store, before any data
    moves: ``ShardedOptimizer.state_dict()`` / ``consolidate_state_dict()``,
    ``FullyShard.state_dict()``, a FullyShard forward without gradients
    (evaluation), ``save_checkpoint`` and ``load_checkpoint``. Entered by some
    ranks only, it raises on them within ``checkin_timeout()`` (60 s unless the
    user set a timeout) naming the call, the missing ranks and the fix, instead
    of exchanging data with whatever collective the other ranks are in; those
    ranks then fail as the first ones exit (their peer is gone) or at the
    watchdog's timeout."""
    group = group if group is not None else dist.group.WORLD
    key = (what, group_name(group))
    _checkins[key] += 1
    rec = flight.start("check_in", key[1], what, None)
    if watchdog.debug():  # a check-in is a collective of its own: kind and size agree first
        watchdog.agree(rec, group)
    prefix = f"zeroshard/check_in/{key[1]}/{what}/{_checkins[key]}/"
    seconds = watchdog.checkin_timeout()
    missing = watchdog.meet(prefix, dist.get_process_group_ranks(group), "1", seconds)
    if missing:
        dist.distributed_c10d._get_default_store().delete_key(prefix + str(dist.get_rank()))
        _checkins[key] -= 1  # the ranks stay in step for the next call
        raise watchdog.check_in_timed_out(
            on_rank(
                who,
                f"{what} is collective, but rank(s) {missing} did not call it within {seconds:g} s "
                f"(zeroshard.set_timeout() or ZEROSHARD_TIMEOUT sets it). Call it on every rank. {hint}",
            ),
            key[1],
            rec,
        )
    rec.end = time.time()


def group_name(group: Optional[dist.ProcessGroup] = None) -> str:
    """The registered name of ``group`` (default: the world group)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first (torchrun sets it up)"
        )
    if group is None:
        group = dist.group.WORLD
    return group.group_name


class _Done:
    """The transport handle of a collective over one rank: done when made (see [Note: one rank])."""

    waited = True

    @staticmethod
    def wait_for(seconds: float) -> bool:
        return True

    @staticmethod
    def completed() -> bool:
        return True


def _alone(group) -> bool:
    """Whether ``group`` has one rank ([Note: one rank])."""
    return dist.is_initialized() and dist.get_world_size(group) == 1


def _copied(src: torch.Tensor, dst: torch.Tensor) -> "CommHandle":
    """A one-rank collective's result: ``dst`` = ``src`` (nothing to do when they are one)."""
    if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype or dst.device != src.device:
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape))
    return CommHandle(_Done, None)


class CommHandle:
    """Guards the result of one collective (``reduce_scatter``, ``all_gather`` and
    ``all_reduce`` return one): ``wait()`` blocks (CPU) or orders the current stream
    (CUDA) until the result is ready, for at most the watchdog's timeout (see [Note:
    watchdog] in comm/watchdog.py), and marks the collective's flight record done."""

    __slots__ = ("handle", "record")

    def __init__(self, handle, record: flight.Record):
        self.handle, self.record = handle, record  # (the C++ core's handle, its flight record)

    def wait(self):
        """Wait for the result; raises CollectiveError naming the collective and what every
        rank last did if it fails or does not finish within the watchdog's timeout. Idempotent."""
        if not self.wait_for(0.0 if watchdog.raised() else watchdog.timeout()):
            raise watchdog.raised() or watchdog.timed_out(self.record)

    def wait_for(self, seconds: float) -> bool:
        """``wait()`` for at most ``seconds``; False (the handle abandoned) if the time ran out."""
        broken = watchdog.raised()  # then only a collective already done may pass
        try:
            done = self.handle.wait_for(0.0 if broken else seconds)
        except RuntimeError as e:
            raise (broken or watchdog.transport_failed(self.record, e)) from e
        if done and self.record is not None and self.record.end is None:
            self.record.end = time.time()
        return done

    @property
    def waited(self) -> bool:
        """Whether ``wait()`` has returned."""
        return self.handle.waited

    def completed(self) -> bool:
        """Whether the collective has finished; never blocks (``wait()`` is still needed)."""
        try:
            done = self.handle.completed()
        except RuntimeError as e:
            raise (watchdog.raised() or watchdog.transport_failed(self.record, e)) from e
        if done and self.record is not None and self.record.end is None:
            self.record.end = time.time()
        return done


def _issue(kind: str, group, what: str, t: torch.Tensor, launch) -> CommHandle:
    """Record the collective (checked across ranks first under ZEROSHARD_DEBUG),
    launch it; a transport failure raises CollectiveError naming it (bad input
    stays the C++ core's ValueError)."""
    name = group_name(group)
    rec = flight.start(kind, name, what, t)
    if watchdog.debug():
        watchdog.agree(rec, group)
    try:
        return CommHandle(launch(name), rec)
    except ValueError:
        raise
    except RuntimeError as e:
        raise (watchdog.raised() or watchdog.transport_failed(rec, e)) from e


def reduce_scatter(
    input: torch.Tensor,
    output: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    average: bool = True,
    input_is_scratch: bool = False,
    what: str = "",
    bounds: Optional[List[int]] = None,
) -> CommHandle:
    """``output`` = this rank's chunk of the sum (mean if ``average``) of ``input`` over ranks.

    ``input_is_scratch=True`` lets the collective overwrite ``input`` (a CPU
    group whose backend is not gloo then runs an in-place all-reduce). On gloo
    it runs as point-to-point messages: the peers' chunks are received into
    scratch memory until ``wait()`` (``reduce_scatter_scratch_bytes``; large
    chunks in pieces through a few slots), or, with ``input_is_scratch``, into
    the chunks of ``input`` this rank has already sent, with at most one chunk
    of scratch; see csrc/comm.h.

    ``bounds`` (world + 1 offsets): rank r's chunk is ``input[bounds[r]:bounds[r + 1]]``,
    of any length (see [Note: uneven collectives] in csrc/comm.h); None: equal chunks."""
    if _alone(group):
        return _copied(input[: output.numel()], output)
    if bounds is not None:
        return _issue(
            "reduce_scatter",
            group,
            what,
            input,
            lambda name: _C.reduce_scatter_v(name, input, output, list(bounds), bool(average)),
        )
    return _issue(
        "reduce_scatter",
        group,
        what,
        input,
        lambda name: _C.reduce_scatter(name, input, output, bool(average), bool(input_is_scratch)),
    )


def reduce_scatter_scratch_bytes(
    chunk_numel: int, itemsize: int, world_size: int, in_place: bool, input_is_scratch: bool = False
) -> int:
    """Bytes of scratch ``reduce_scatter`` holds while in flight on gloo, for a chunk of
    ``chunk_numel`` elements of ``itemsize`` bytes per rank (``in_place``: the output lies
    inside the input; ``input_is_scratch`` as passed to it). The planner counts it; NCCL
    takes none."""
    return _C.reduce_scatter_scratch_bytes(chunk_numel, itemsize, world_size, in_place, input_is_scratch)


def all_gather(
    input: torch.Tensor,
    output: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    what: str = "",
    bounds: Optional[List[int]] = None,
) -> CommHandle:
    """``output`` = concatenation over ranks of ``input``. In place when ``input``
    is this rank's chunk of ``output`` (on gloo it then runs as point-to-point
    messages, faster than gloo's all-gather; see csrc/comm.h). ``bounds``: chunks
    of different lengths, as for ``reduce_scatter``."""
    if _alone(group):
        return _copied(input, output[: input.numel()])
    if bounds is not None:
        return _issue(
            "all_gather",
            group,
            what,
            output,  # (the same size on every rank)
            lambda name: _C.all_gather_v(name, input, output, list(bounds)),
        )
    return _issue("all_gather", group, what, input, lambda name: _C.all_gather(name, input, output))


def all_reduce(
    tensor: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None, average: bool = False, what: str = ""
) -> CommHandle:
    """``tensor`` = sum (mean if ``average``) of ``tensor`` over ranks, in place."""
    if _alone(group):
        return CommHandle(_Done, None)
    return _issue("all_reduce", group, what, tensor, lambda name: _C.all_reduce(name, tensor, bool(average)))


def broadcast_bytes(t: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """``t`` = global rank ``src``'s over ``group``, whatever its dtype: its bytes travel, as
    uint8 (gloo and NCCL carry no complex, unsigned or float8 tensor), in place when ``t`` is
    contiguous; nothing over one rank ([Note: one rank])."""
    if _alone(group) or t.numel() == 0:
        return
    with torch.no_grad():
        data = t.detach()
        raw = data if data.is_contiguous() else data.contiguous()
        dist.broadcast(raw.reshape(-1).view(torch.uint8), src=src, group=group)
        if raw is not data:
            data.copy_(raw)


def all_gather_object(obj: Any, *, group: Optional[dist.ProcessGroup] = None, what: str = "") -> List[Any]:
    """Every rank's ``obj`` (picklable), in group-rank order; collective.

    ``torch.distributed.all_gather_object`` hands gloo tensors that Python
    owns, and gloo's worker thread may drop the last reference to one after
    the call returned: at interpreter exit (a script whose last collective it
    was: a checkpoint save, say) that needs the GIL and aborts the process.
    On gloo this runs over this module's all-gather instead, which never
    hands the backend such a tensor (see [Note: backend views] in
    csrc/comm.cpp); other backends use torch's."""
    if group is None:
        group = dist.group.WORLD
    if _alone(group):
        return [obj]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) != "gloo":
        out = [None] * world
        rec = flight.start("all_gather_object", group_name(group), what, None)
        if watchdog.debug():
            watchdog.agree(rec, group)
        dist.all_gather_object(out, obj, group=group)
        rec.end = time.time()
        return out
    data = pickle.dumps(obj)
    lens = torch.zeros(world, dtype=torch.float64)  # exact for lengths < 2**53
    lens[rank] = len(data)
    all_gather(lens[rank : rank + 1], lens, group=group, what=f"{what} (object sizes)").wait()
    words = max(1, -(-int(lens.max().item()) // 8))  # the bytes travel as float64 bit patterns
    buf = torch.zeros(world * words, dtype=torch.float64)
    mine = buf[rank * words : (rank + 1) * words]
    mine.view(torch.uint8)[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    all_gather(mine, buf, group=group, what=f"{what} (object bytes)").wait()
    raw = buf.view(torch.uint8).numpy().tobytes()
    return [pickle.loads(raw[r * words * 8 : r * words * 8 + int(lens[r])]) for r in range(world)]
