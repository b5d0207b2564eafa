"""The gradient reduction pipeline (core/reduction.py, [Note: reduction pipeline]) without
processes: a fake fold policy and fake collectives (handles that complete when the test says)
record what the pipeline does, in order: the fixed launch order whatever order gradients
arrive in, the cap on reduce-scatters in flight, the replicas' all-reduce under hybrid
sharding, no_sync() (nothing launched, nothing folded) and abandon() (wait, fold nothing)."""

from types import SimpleNamespace

import pytest
import torch

from zeroshard.core import reduction
from zeroshard.core.reduction import FoldPolicy, Reduction, ReductionPipeline

SHARDS, REPLICAS = "shard group", "replica group"


class Handle:
    """A collective in flight: ``completed()`` once the test sets ``done``; ``wait()`` is logged."""

    def __init__(self, log, what):
        self.log, self.what, self.done = log, what, False

    def completed(self):
        return self.done

    def wait(self):
        self.log.append(("wait", self.what))


class Collectives:
    """Stands in for zeroshard.comm in the pipeline's module: each call logged, a Handle returned."""

    def __init__(self, log):
        self.log, self.handles, self.groups = log, [], []

    def _issue(self, kind, what, group):
        self.log.append((kind, what))
        self.handles.append(Handle(self.log, what))
        self.groups.append(group)
        return self.handles[-1]

    def reduce_scatter(self, src, out, *, group, average, input_is_scratch, bounds, what):
        assert average is False and input_is_scratch is True and out.numel() * 2 == src.numel()
        return self._issue("reduce_scatter", what, group)

    def all_reduce(self, tensor, *, group, what):
        return self._issue("all_reduce", what, group)


class Fold(FoldPolicy):
    """Chunks of half the record's buffer; each fold logged with the record's state then."""

    def __init__(self, log):
        self.log = log

    def reduce_input(self, r):
        return r.buffer, torch.zeros(r.buffer.numel() // 2), None

    def fold(self, r):
        assert r.out is not None and r.handle is None  # the collectives on it were waited for
        self.log.append(("fold", r.name))

    def label(self, r, what):
        return f"{what} {r.name}"


@pytest.fixture
def pipe(monkeypatch):
    """(make(max_inflight) -> a pipeline on the fakes, the log, the fake collectives)."""
    log = []
    fake = Collectives(log)
    monkeypatch.setattr(
        reduction, "comm", SimpleNamespace(reduce_scatter=fake.reduce_scatter, all_reduce=fake.all_reduce)
    )

    def make(max_inflight):
        return ReductionPipeline(Fold(log), max_inflight, {"reduce_scatter": 0, "replica_all_reduce": 0})

    return make, log, fake


def records(names, pending=1, replicate=None, numel=8):
    return [
        Reduction(name=n, owner=None, group=SHARDS, replicate=replicate, pending=pending, buffer=torch.zeros(numel))
        for n in names
    ]


def launched(log):
    return [what.split()[-1] for kind, what in log if kind == "reduce_scatter"]


def test_records_launch_in_the_fixed_order_whatever_order_gradients_arrive_in(pipe):
    make, log, fake = pipe
    p = make(max_inflight=4)
    a, b, c, d = rs = records("abcd")
    d.pending = 2
    p.start(rs)
    for r in (c, b):  # arrived, but ``a`` before them has not
        p.arrived(r)
        p.advance()
    assert launched(log) == [] and not any(r.launched for r in rs)
    p.arrived(a)
    p.advance()
    assert launched(log) == ["a", "b", "c"] and [r.launched for r in rs] == [True, True, True, False]
    p.arrived(d)  # one of d's two gradients: it waits
    p.advance()
    assert launched(log) == ["a", "b", "c"]
    p.finish()  # the end of backward: the rest launch, a missing gradient counting as zero
    assert launched(log) == ["a", "b", "c", "d"] and set(fake.groups) == {SHARDS}
    assert [e for e in log if e[0] == "fold"] == [("fold", n) for n in "abcd"]
    assert p.comm_elements == {"reduce_scatter": 32, "replica_all_reduce": 0}
    p.start(rs)  # the next backward starts afresh
    assert not any(r.launched for r in rs)


def test_at_most_max_inflight_reduce_scatters_are_held_and_completed_ones_retire_early(pipe):
    make, log, fake = pipe
    p = make(max_inflight=2)
    rs = records("abcde")
    p.start(rs)
    for r in rs[:4]:
        p.arrived(r)
        p.advance()
    # launching a third first retires (waits for and folds) the oldest
    assert log == [
        ("reduce_scatter", "reduce-scatter a"),
        ("reduce_scatter", "reduce-scatter b"),
        ("reduce_scatter", "reduce-scatter c"),
        ("wait", "reduce-scatter a"),
        ("fold", "a"),
        ("reduce_scatter", "reduce-scatter d"),
        ("wait", "reduce-scatter b"),
        ("fold", "b"),
    ]
    del log[:]
    fake.handles[3].done = True  # d completed, c (older) not: nothing retires out of order
    p.retire_completed()
    assert log == []
    fake.handles[2].done = True
    p.retire_completed()
    assert log == [("wait", "reduce-scatter c"), ("fold", "c"), ("wait", "reduce-scatter d"), ("fold", "d")]
    del log[:]
    p.finish()
    assert log == [("reduce_scatter", "reduce-scatter e"), ("wait", "reduce-scatter e"), ("fold", "e")]


def test_under_hybrid_sharding_each_chunk_is_all_reduced_across_the_replicas_before_its_fold(pipe):
    make, log, fake = pipe
    p = make(max_inflight=1)
    rs = records("abc", replicate=REPLICAS)
    p.start(rs)
    for r in rs:
        p.arrived(r)
        p.advance()
    # the replica all-reduce of one record stays in flight until the next record retires
    assert log == [
        ("reduce_scatter", "reduce-scatter a"),
        ("reduce_scatter", "reduce-scatter b"),
        ("wait", "reduce-scatter a"),
        ("all_reduce", "replica all-reduce a"),
        ("reduce_scatter", "reduce-scatter c"),
        ("wait", "reduce-scatter b"),
        ("all_reduce", "replica all-reduce b"),
        ("wait", "replica all-reduce a"),
        ("fold", "a"),
    ]
    del log[:]
    p.finish()
    assert log == [
        ("wait", "reduce-scatter c"),
        ("all_reduce", "replica all-reduce c"),
        ("wait", "replica all-reduce b"),
        ("fold", "b"),
        ("wait", "replica all-reduce c"),
        ("fold", "c"),
    ]
    assert fake.groups == [SHARDS, SHARDS, REPLICAS, SHARDS, REPLICAS, REPLICAS]
    assert p.comm_elements == {"reduce_scatter": 24, "replica_all_reduce": 12}
    assert all(r.out is None and r.handle is None for r in rs)


def test_no_sync_launches_and_folds_nothing_and_the_next_synced_backward_reduces_all(pipe):
    make, log, _ = pipe
    p = make(max_inflight=2)
    rs = records("ab")
    with p.no_sync():
        assert not p.sync
        with p.no_sync():
            pass
        assert not p.sync  # (nested: the outer one still holds)
        p.start(rs)
        for r in rs:
            p.arrived(r)
            p.advance()
        p.finish()
    assert p.sync and log == [] and not any(r.launched for r in rs)
    for r in rs:
        r.pending = 1
    p.start(rs)
    for r in rs:
        p.arrived(r)
        p.advance()
    p.finish()
    assert launched(log) == ["a", "b"] and [e for e in log if e[0] == "fold"] == [("fold", "a"), ("fold", "b")]


def test_abandon_waits_for_what_is_in_flight_folds_nothing_and_forgets_the_backward(pipe):
    make, log, _ = pipe
    p = make(max_inflight=1)
    rs = records("abc", replicate=REPLICAS)
    p.start(rs)
    for r in rs[:2]:  # a's replica all-reduce and b's reduce-scatter in flight
        p.arrived(r)
        p.advance()
    del log[:]
    p.abandon()
    assert log == [("wait", "reduce-scatter b"), ("wait", "replica all-reduce a")]
    assert all(r.out is None and r.handle is None for r in rs)
    del log[:]
    p.finish()  # nothing left of the abandoned backward
    assert log == []
    for r in rs:
        r.pending = 1
    p.start(rs)  # the next backward launches from the first record
    for r in rs:
        p.arrived(r)
        p.advance()
    p.finish()
    assert launched(log) == ["a", "b", "c"] and [e[1] for e in log if e[0] == "fold"] == ["a", "b", "c"]
