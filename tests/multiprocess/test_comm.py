"""zeroshard's collectives against torch.distributed's own, on gloo, world sizes 2 and 3."""

import pytest
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend

import zeroshard as zs
from support.launch import launch

SHARD_SIZES = [1, 37, 1000]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _inputs(numel, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    return torch.randn(numel, generator=g).to(dtype)


def _exact_sum_inputs(numel, dtype, salt=0):
    """Random multiples of 1/8 in [-8, 8]: their sums over 3 ranks are exact in
    every dtype here, so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    return (torch.randint(-64, 65, (numel,), generator=g) / 8).to(dtype)


def _rs_vs_torch(shard, dtype, average):
    """Bit-equal to torch's on inputs whose sums are exact; within rounding of
    the summation order on normal draws (gloo sums ranks in its own order)."""
    world = dist.get_world_size()
    ok = True
    for x, exact in ((_exact_sum_inputs(world * shard, dtype), True), (_inputs(world * shard, dtype), False)):
        ours, xc = torch.empty(shard, dtype=dtype), x.clone()
        h = zs.reduce_scatter(xc, ours, average=average)
        h.wait()
        assert h.completed() and h.waited
        ok &= torch.equal(xc, x)  # an input not marked scratch is left as it was
        theirs = torch.empty(shard, dtype=dtype)
        dist.reduce_scatter_tensor(theirs, x.clone(), op=dist.ReduceOp.SUM)
        if average:
            theirs /= world
        if exact:
            ok &= torch.equal(ours, theirs)
        else:
            eps = torch.finfo(dtype).eps
            ok &= torch.allclose(ours.double(), theirs.double(), rtol=4 * eps, atol=4 * eps * world)
    return ok


def _ag_vs_torch(shard, dtype):
    world = dist.get_world_size()
    x = _inputs(shard, dtype, salt=1)
    ours = torch.empty(world * shard, dtype=dtype)
    zs.all_gather(x, ours).wait()
    theirs = torch.empty(world * shard, dtype=dtype)
    dist.all_gather_into_tensor(theirs, x)
    return torch.equal(ours, theirs)


def _ar_vs_torch(numel, dtype, average):
    x = _inputs(numel, dtype, salt=2)
    ours = x.clone()
    h = zs.all_reduce(ours, average=average)
    for _ in range(10000):  # completed() never blocks, and turns true once the backend is done
        if h.completed():  # (gloo's native reduce-scatter only reports it in wait())
            break
        time.sleep(0.001)
    assert h.completed()
    h.wait()
    theirs = x.clone()
    dist.all_reduce(theirs)
    if average:
        theirs /= dist.get_world_size()
    return torch.equal(ours, theirs)


def _all_cases():
    out = []
    for shard in SHARD_SIZES:
        for dtype in DTYPES:
            for average in (False, True):
                out.append(("rs", shard, str(dtype), average, _rs_vs_torch(shard, dtype, average)))
                out.append(("ar", shard * 3 + 1, str(dtype), average, _ar_vs_torch(shard * 3 + 1, dtype, average)))
            out.append(("ag", shard, str(dtype), None, _ag_vs_torch(shard, dtype)))
    return out


def test_collectives_equal_torch_distributed(dist_pool):
    for rank_cases in dist_pool.run(_all_cases):
        bad = [c[:4] for c in rank_cases if not c[4]]
        assert not bad, f"differs from torch.distributed: {bad}"


def _objects():
    """comm.all_gather_object against torch's, with objects of different sizes per rank
    (one a multiple of 8 bytes or not, one with a NaN and raw bytes)."""
    from zeroshard import comm

    rank = dist.get_rank()
    objs = [
        {"rank": rank, "pad": "x" * (rank * 13 + 5), "nan": float("nan"), "raw": bytes(range(rank + 3))},
        [rank] * (rank + 1),
        None,
    ]
    out = []
    for obj in objs:
        theirs = [None] * dist.get_world_size()
        dist.all_gather_object(theirs, obj)
        out.append(repr(comm.all_gather_object(obj)) == repr(theirs))
    return out


def test_all_gather_object_equals_torch(dist_pool):
    for res in dist_pool.run(_objects):
        assert res == [True, True, True]


def _bucketed_uneven_reduce():
    """Prime-sized tensors laid out in padded buckets (a cap that splits tensors),
    reduce-scattered bucket by bucket with all handles outstanding at once, waited in
    reverse order; each rank's shard pieces must equal the same slices of torch's
    all-reduce of the unbucketed tensors."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [101, 7, 331, 2, 53]
    grads = [_inputs(n, torch.float32, salt=10 + i) for i, n in enumerate(sizes)]
    layout = zs.compute_layout(sizes, [torch.float32] * len(sizes), bucket_cap_bytes=512, world_size=world)
    flat = torch.zeros(layout.buffers[0].numel)
    for g, place in zip(grads, layout.tensors):
        flat[place.offset : place.offset + place.numel] = g
    shards, handles = [], []
    for b in layout.buckets:
        out = torch.empty(b.shard_numel)
        handles.append(zs.reduce_scatter(flat[b.offset : b.offset + b.numel], out, average=True))
        shards.append(out)
    for h in reversed(handles):
        h.wait()
    full = [g.clone() for g in grads]
    for t in full:
        dist.all_reduce(t)
        t /= world
    ok = True
    for p in layout.shard_pieces(rank):
        mine = shards[p.bucket][p.shard_offset : p.shard_offset + p.numel]
        want = full[p.tensor][p.tensor_offset : p.tensor_offset + p.numel]
        ok &= bool(torch.allclose(mine, want, rtol=1e-6, atol=1e-6))
    return ok, len(layout.buckets)


def test_bucketed_reduce_scatter_with_uneven_sizes(dist_pool):
    results = dist_pool.run(_bucketed_uneven_reduce)
    assert all(ok for ok, _ in results)
    assert results[0][1] > 1, "the cap should have produced several buckets"


def _errors():
    world = dist.get_world_size()
    msgs = []
    cases = [
        lambda: zs.reduce_scatter(torch.zeros(world * 4 + 1), torch.zeros(4)),
        lambda: zs.reduce_scatter(torch.zeros(world * 4), torch.zeros(4, dtype=torch.float64)),
        lambda: zs.all_gather(torch.zeros(4), torch.zeros(world * 4 - 1)),
        lambda: zs.all_gather(torch.zeros(8)[::2], torch.zeros(world * 4)),
        lambda: zs.all_reduce(torch.zeros(4, dtype=torch.int32)),
        lambda: zs._C.all_reduce("no-such-group", torch.zeros(4), False),
    ]
    for case in cases:
        try:
            case()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    # the group is still healthy after every refused call
    t = torch.ones(3)
    zs.all_reduce(t).wait()
    return msgs, t.tolist()


def test_bad_collective_input_is_refused_before_communicating(dist_pool):
    for rank, (msgs, total) in enumerate(dist_pool.run(_errors)):
        world = dist_pool.world_size
        assert total == [float(world)] * 3
        assert None not in msgs, msgs
        assert f"[rank {rank}/{world}] reduce_scatter: input has {world * 4 + 1} elements" in msgs[0]
        assert "dtype" in msgs[1]
        assert "output has" in msgs[2] and "all_gather" in msgs[2]
        assert "not contiguous" in msgs[3]
        assert "dtype Int" in msgs[4]
        assert "no-such-group" in msgs[5]


def _scratch_and_in_place():
    """reduce_scatter(input_is_scratch=True), into a separate output or in place
    into the input's own chunk, and in-place all_gather (the point-to-point
    algorithms on gloo) give torch.distributed's results."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ok = []
    for shard in (1, 37, 1000):
        x = _exact_sum_inputs(world * shard, torch.float32, salt=3)
        theirs = torch.empty(shard)
        dist.reduce_scatter_tensor(theirs, x.clone())
        for alias in (False, True):
            scratch = x.clone()
            out = scratch[rank * shard : (rank + 1) * shard] if alias else torch.empty(shard)
            zs.reduce_scatter(scratch, out, average=False, input_is_scratch=True).wait()
            ok.append(torch.equal(out, theirs))
        full = _inputs(world * shard, torch.float32, salt=4)
        mine = full[rank * shard : (rank + 1) * shard].clone()
        expect = torch.empty(world * shard)
        dist.all_gather_into_tensor(expect, mine)
        buf = full.clone()  # other chunks hold garbage before the gather
        zs.all_gather(buf[rank * shard : (rank + 1) * shard], buf).wait()
        ok.append(torch.equal(buf, expect))
    return ok


def test_scratch_reduce_scatter_and_in_place_all_gather(dist_pool):
    for ok in dist_pool.run(_scratch_and_in_place):
        assert all(ok), ok


def _into_sent_chunks():
    """reduce_scatter(input_is_scratch=True) on gloo lands the peers' chunks in the
    input's chunks this rank has already sent ([Note: landing in sent chunks] in
    csrc/comm.h): equal to torch's in place and into a separate output, averaged and
    not, three of one size in flight at once beside one whose input is kept, waited
    in an order that differs by rank; the scratch is one chunk in place, none into a
    separate output."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ok = []
    for shard in (1, 37, 4099):
        xs = [_exact_sum_inputs(world * shard, torch.float32, salt=20 + k) for k in range(4)]
        theirs = []
        for x in xs:
            theirs.append(torch.empty(shard))
            dist.reduce_scatter_tensor(theirs[-1], x.clone())
        srcs = [x.clone() for x in xs]
        outs = [s[rank * shard : (rank + 1) * shard] if k % 2 == 0 else torch.empty(shard) for k, s in enumerate(srcs)]
        hs = [zs.reduce_scatter(srcs[k], outs[k], average=k == 2, input_is_scratch=k != 1) for k in range(4)]
        for k in range(4) if rank % 2 else range(3, -1, -1):
            hs[k].wait()
        ok += [torch.equal(outs[k], theirs[k] / world if k == 2 else theirs[k]) for k in range(4)]
        ok.append(torch.equal(srcs[1], xs[1]))  # not scratch: left as it was
    n = 1000
    ok.append(zs.comm.reduce_scatter_scratch_bytes(n, 4, world, True, input_is_scratch=True) == 4 * n)
    ok.append(zs.comm.reduce_scatter_scratch_bytes(n, 4, world, False, input_is_scratch=True) == 0)
    ok.append(zs.comm.reduce_scatter_scratch_bytes(n, 4, world, True) == (world - 1) * 4 * n)
    return ok


def test_reduce_scatter_into_sent_chunks(dist_pool):
    for ok in dist_pool.run(_into_sent_chunks):
        assert all(ok), [k for k, v in enumerate(ok) if not v]


def test_reduce_scatter_into_sent_chunks_at_four_ranks():
    for ok in launch("pool", 4).run(_into_sent_chunks):
        assert all(ok), [k for k, v in enumerate(ok) if not v]


def _in_pieces():
    """Reduce-scatters whose chunk is large enough run in pieces through a few scratch
    slots ([Note: reduce-scatter in pieces] in csrc/comm.h): in place and into a separate
    output, averaged, in bf16, with chunks that are not a multiple of the piece; two of
    one size in flight at once, waited in opposite orders on different ranks; their
    scratch is a fraction of the unpieced one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ok = []
    for shard, dtype in ((196625, torch.float32), (1048583, torch.float32), (393241, torch.bfloat16)):
        x = _exact_sum_inputs(world * shard, dtype, salt=5)
        theirs = torch.empty(shard, dtype=dtype)
        dist.reduce_scatter_tensor(theirs, x.clone())
        for alias in (False, True):
            for average in (False, True):
                src = x.clone()
                out = src[rank * shard : (rank + 1) * shard] if alias else torch.empty(shard, dtype=dtype)
                h = zs.reduce_scatter(src, out, average=average, input_is_scratch=True)
                whole = max(0, world - (1 if alias else 2)) * shard * dtype.itemsize
                if zs.comm.reduce_scatter_scratch_bytes(shard, dtype.itemsize, world, alias) < whole:
                    for _ in range(20000):  # in pieces: the thread's end shows in completed()
                        if h.completed():
                            break
                        time.sleep(0.001)
                    ok.append(h.completed())
                h.wait()
                ok.append(torch.equal(out, theirs / world if average else theirs))
        pieced = zs.comm.reduce_scatter_scratch_bytes(shard, dtype.itemsize, world, True)
        whole = (world - 1) * shard * dtype.itemsize  # in place, unpieced: a chunk per peer
        ok.append(0 < pieced <= whole * (0.7 if shard < 10**6 else 0.13))
    shard = 196625
    xs = [_exact_sum_inputs(world * shard, torch.float32, salt=6 + k) for k in range(2)]
    outs = [torch.empty(shard) for _ in xs]
    hs = [zs.reduce_scatter(x.clone(), o, average=False) for x, o in zip(xs, outs)]
    for h in hs if rank % 2 else hs[::-1]:
        h.wait()
    for x, o in zip(xs, outs):
        theirs = torch.empty(shard)
        dist.reduce_scatter_tensor(theirs, x.clone())
        ok.append(torch.equal(o, theirs))
    return ok


def _in_pieces_of(piece_bytes):
    old = zs._C.set_reduce_scatter_piece_bytes(piece_bytes)  # cut test-sized buffers
    try:
        return _in_pieces()
    finally:
        zs._C.set_reduce_scatter_piece_bytes(old)


def test_reduce_scatter_in_pieces(dist_pool):
    # by default only chunks of more than two 4 MiB pieces are cut
    assert zs.comm.reduce_scatter_scratch_bytes(2**21, 4, 8, True) == 7 * 2**23
    assert zs.comm.reduce_scatter_scratch_bytes(2**23, 4, 8, True) == 7 * 2 * 2**22
    for ok in dist_pool.run(_in_pieces_of, 256 << 10):
        assert all(ok), [k for k, v in enumerate(ok) if not v]


def _flight(stage):
    import torch.nn as nn
    import torch.nn.functional as F
    import zeroshard as zs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    if stage == 3:
        model = zs.FullyShard(model, wrap={nn.Linear})
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    else:
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_mb=200 / 2**20)
    world = dist.group.WORLD.group_name
    # the pool's earlier tests issued collectives too: keep this run's
    after = max([r["seq"] for r in zs.flight_record() if r["group"] == world], default=0)
    for _ in range(2):  # the first backward also agrees on the bucket order
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(4, 7)), torch.randint(0, 3, (4,))).backward()
        opt.step()
    return [r for r in zs.flight_record() if r["group"] == world and r["seq"] > after]


@pytest.mark.parametrize("stage", [2, 3])
def test_flight_record_of_a_step(dist_pool, stage):
    records = dist_pool.run(_flight, stage)
    mine = records[0]
    last = [r for r in mine if r["what"] == "gradient statistics"][-1]
    assert last["kind"] == "all_reduce" and last["numel"] == 2 * 4  # two floats per parameter
    for r in mine:
        assert r["end"] is not None and r["end"] >= r["start"], r
    seqs = [r["seq"] for r in mine]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one group, no gap
    if stage == 2:
        step2 = [r for r in mine if r["what"].startswith("step 2, bucket")]
        kinds = [r["kind"] for r in step2]
        n = kinds.count("reduce_scatter")
        assert n >= 2 and kinds == ["reduce_scatter"] * n + ["all_gather"] * n, kinds
    else:  # forward gathers, backward gathers again in reverse, reduces, then the statistics
        step = [(r["kind"], r["what"]) for r in mine[-7:]]
        assert step == [
            ("all_gather", "step 2 forward, unit '0' all-gather"),
            ("all_gather", "step 2 forward, unit '2' all-gather"),
            ("all_gather", "step 2 backward, unit '2' all-gather"),
            ("all_gather", "step 2 backward, unit '0' all-gather"),
            ("reduce_scatter", "step 2, unit '2' reduce-scatter"),
            ("reduce_scatter", "step 2, unit '0' reduce-scatter"),
            ("all_reduce", "gradient statistics"),
        ], step
    # every rank issued the same collectives, in the same order, with the same sizes (sequence
    # numbers counted from this run's first: an earlier test's rank-0-only check-in advanced rank 0's)
    strip = [[(r["seq"] - rs[0]["seq"], r["kind"], r["what"], r["numel"]) for r in rs] for rs in records]
    assert all(s == strip[0] for s in strip)


class _Forwarding(Backend):
    """A backend that is not gloo (so zeroshard takes its path for other backends, one
    broadcast or reduce per non-empty chunk) but moves the data through a gloo group."""

    def __init__(self, rank, size, inner):
        super().__init__(rank, size)
        self.inner = inner

    def getBackendName(self):
        return "forwarding"

    def broadcast(self, tensors, opts):
        return self.inner.broadcast(tensors, opts)

    def reduce(self, tensors, opts):
        return self.inner.reduce(tensors, opts)


_FORWARDING = {}


def _forwarding_group():
    """A process group over every rank whose backend is _Forwarding (made once per process)."""
    if "group" not in _FORWARDING:
        inner = dist.new_group(backend="gloo")
        if "forwarding" not in dist.Backend.backend_list:
            dist.Backend.register_backend(
                "forwarding",
                lambda store, rank, size, timeout: _Forwarding(rank, size, _FORWARDING["inner"]),
                devices=["cpu"],
            )
        _FORWARDING["inner"] = inner
        _FORWARDING["group"] = dist.new_group(backend="forwarding")
    return _FORWARDING["group"]


def _uneven(forwarding=False):
    """reduce_scatter / all_gather over chunks of different lengths ([Note: uneven collectives]
    in csrc/comm.h), empty ones among them, in place and not, against torch.distributed's
    all_reduce of the whole; bad bounds are refused naming them. ``forwarding``: over a
    backend that is not gloo (the path NCCL takes), its data moved by gloo."""
    group = _forwarding_group() if forwarding else None
    world, rank = dist.get_world_size(), dist.get_rank()
    ok = []
    g = torch.Generator().manual_seed(7)  # the same bounds on every rank
    for trial in range(6):
        lengths = [int(x) for x in torch.randint(0, 40, (world,), generator=g)]
        lengths[trial % world] = 0 if trial < 2 else lengths[trial % world]  # empty chunks
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        lo, hi = bounds[rank], bounds[rank + 1]
        x = _exact_sum_inputs(bounds[-1], torch.float32, salt=10 + trial)
        total = x.clone()
        dist.all_reduce(total)
        for in_place in (False, True):
            buf = x.clone()
            out = buf[lo:hi] if in_place else torch.empty(hi - lo)
            zs.reduce_scatter(buf, out, average=(trial % 2 == 1), bounds=bounds, group=group).wait()
            ok.append(torch.equal(out, total[lo:hi] / (world if trial % 2 == 1 else 1)))
            full = torch.full((bounds[-1],), float("nan"))
            mine = total[lo:hi].clone()
            if in_place:
                full[lo:hi] = mine
                mine = full[lo:hi]
            zs.all_gather(mine, full, bounds=bounds, group=group).wait()
            ok.append(torch.equal(full, total))
    msgs = []
    for bad in ([0] * world, [0] * (world + 1) + [1], [0, 5] + [3] * (world - 1)):
        try:
            zs.all_gather(torch.zeros(0), torch.zeros(bad[-1]), bounds=bad, group=group)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return ok, msgs


@pytest.mark.parametrize("forwarding", [False, True], ids=["gloo", "other-backends"])
def test_uneven_reduce_scatter_and_all_gather(dist_pool, forwarding):
    for ok, msgs in dist_pool.run(_uneven, forwarding):
        assert all(ok), ok
        assert None not in msgs and all("bounds" in m or "elements" in m for m in msgs), msgs
