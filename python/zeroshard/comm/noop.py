"""One process playing rank r of an N-rank job: a process group whose collectives
return at once (``noop_world``), for measuring what zeroshard's own host work
costs at any world size on one machine (``python -m benchmarks scale``, tests/unit/test_scale.py).

[Note: no-op process group]
torch ships a fake process group for this (backend "fake"), but its
all-gather and reduce-scatter are not free at large N: its all-gather copies
the input into each of the N chunks of the output, even for a one-element
input, so a step measured with it grows with N
even where zeroshard's work does not. This backend does nothing with the
tensors the training data travels in: a floating-point collective returns
at once and leaves its output as it was, as a real backend's host-side
launch would (the bytes move on the device, not on the host). Integer and
bool tensors (what torch's object collectives carry: sizes and pickles)
come back as if every rank had sent this rank's tensor, so
``all_gather_object`` and the like return N copies of this rank's object
and the setup code that exchanges objects runs as on a real job. Every call
is counted (``calls``): a test asserts that a training step issues the
same collectives, each with the same number of tensors, at any N.

Values computed from a float collective's output are meaningless; the
timings, the call counts and the bytes each rank holds are what is measured.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Counter, Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend

NAME = "zeroshard_noop"

calls: Counter = collections.Counter()  # (collective, number of tensors it was given) -> times called


class _Done(dist.Work):
    """A collective that completed when it was issued. It keeps no tensor (so none outlives
    the call in Python's hands: see [Note: backend views] in csrc/comm.cpp)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return []

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result([])
        return fut


def _counted(name: str, tensors: int):
    calls[(name, tensors)] += 1


def _carries_objects(dtype: torch.dtype) -> bool:
    """Integer and bool tensors (object exchanges), which are replicated; see the Note."""
    return not (dtype.is_floating_point or dtype.is_complex)


def _replicate(out: torch.Tensor, inp: torch.Tensor):
    """``out`` as if every rank had sent ``inp`` (``_carries_objects`` tensors only)."""
    if _carries_objects(out.dtype) and inp.numel():
        out.view(-1, inp.numel()).copy_(inp.reshape(1, -1))


class NoopBackend(Backend):
    """The backend of ``noop_world``: see [Note: no-op process group]."""

    def getBackendName(self):
        return NAME

    def _allgather_base(self, out, inp, opts=None):
        _counted("all_gather", 1)
        _replicate(out, inp)
        return _Done()

    all_gather_single = _allgather_base

    def allgather(self, outs, ins, opts=None):
        _counted("all_gather", sum(len(o) for o in outs))
        for chunks, inp in zip(outs, ins):
            for t in chunks if _carries_objects(inp.dtype) else ():
                t.copy_(inp)
        return _Done()

    def _reduce_scatter_base(self, out, inp, opts=None):
        _counted("reduce_scatter", 1)
        return _Done()

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, outs, ins, opts=None):
        _counted("reduce_scatter", sum(len(i) for i in ins))
        return _Done()

    def reduce(self, tensors, opts=None):
        _counted("reduce", len(tensors))
        return _Done()

    def alltoall_base(self, out, inp, out_splits, in_splits, opts=None):
        _counted("all_to_all", 1)
        return _Done()

    all_to_all_single = alltoall_base

    def allreduce(self, tensors, opts=None):
        _counted("all_reduce", len(tensors))
        return _Done()

    def broadcast(self, tensors, opts=None):
        _counted("broadcast", len(tensors))
        return _Done()

    def barrier(self, opts=None):
        _counted("barrier", 0)
        return _Done()


def _create(store, rank, world_size, timeout):
    return NoopBackend(rank, world_size)


@contextlib.contextmanager
def noop_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """The default process group, for the ``with`` block, is rank ``rank`` of
    ``world_size`` over the no-op backend ([Note: no-op process group]); CPU tensors."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (a store that stores nothing)

    if dist.is_initialized():
        raise RuntimeError(
            "noop_world sets up the default process group: call it where torch.distributed is not initialized"
        )
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    dist.init_process_group(NAME, rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
