"""Layout math from Python: property tests over random sizes, dtypes, caps and world sizes."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import zeroshard as zs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8]


def scatter_into_buffers(layout, tensors):
    """Build each flat buffer from the layout: tensor data at its offsets, zeros elsewhere."""
    bufs = [torch.zeros(b.numel, dtype=torch.float64) for b in layout.buffers]
    for t, place in zip(tensors, layout.tensors):
        bufs[place.buffer][place.offset : place.offset + place.numel] = t
    return bufs


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 5000), st.sampled_from(DTYPES), st.integers(0, 2)), min_size=1, max_size=10
    ),
    world=st.integers(1, 9),
    cap=st.integers(1, 40_000),
)
def test_shards_partition_buffers_exactly(specs, world, cap):
    numels, dtypes, keys = zip(*specs)
    # at most ~2000 buckets: the checks below loop over them (the suite has a 15-minute bound)
    assume(sum(n * d.itemsize for n, d in zip(numels, dtypes)) <= 2000 * max(cap, 16 * world))
    layout = zs.compute_layout(numels, dtypes, cap, world, keys=keys)
    # unique ids for every tensor element: id = running count + 1 (0 marks padding)
    ids, start = [], 1
    for n in numels:
        ids.append(torch.arange(start, start + n, dtype=torch.float64))
        start += n
    bufs = scatter_into_buffers(layout, ids)

    seen = torch.zeros(start, dtype=torch.int64)
    for bi, b in enumerate(layout.buckets):
        buf = layout.buffers[b.buffer]
        itemsize = dtypes[buf.tensors[0]].itemsize
        assert b.numel == world * b.shard_numel
        assert (b.shard_numel * itemsize) % 16 == 0 and (b.offset * itemsize) % 16 == 0
        assert b.numel * itemsize <= max(cap, world * 16)
        # the rank shards tile the bucket: concatenating them gives the bucket back
        shards = [
            bufs[b.buffer][b.offset + r * b.shard_numel : b.offset + (r + 1) * b.shard_numel] for r in range(world)
        ]
        bucket = bufs[b.buffer][b.offset : b.offset + b.numel]
        assert torch.equal(torch.cat(shards), bucket)
        seen.index_add_(0, bucket.long(), torch.ones(b.numel, dtype=torch.int64))
    # each element of each tensor lies in exactly one bucket; padding is all that is left
    assert torch.all(seen[1:] == 1), "an element is lost or appears twice"
    assert seen[0].item() == sum(layout.padding_numel(i) for i in range(len(layout.buffers)))
    # buckets tile each buffer in order
    for buf in layout.buffers:
        offs = [layout.buckets[b].offset for b in buf.buckets]
        ends = [layout.buckets[b].offset + layout.buckets[b].numel for b in buf.buckets]
        assert offs == ([0] + ends[:-1] if ends else []) and (ends[-1] if ends else 0) == buf.numel

    # shard_pieces reconstruct every tensor from the shards alone
    rebuilt = [torch.full((n,), -1.0, dtype=torch.float64) for n in numels]
    for r in range(world):
        for piece in layout.shard_pieces(r):
            b = layout.buckets[piece.bucket]
            src = bufs[b.buffer][b.offset + r * b.shard_numel + piece.shard_offset :][: piece.numel]
            dst = rebuilt[piece.tensor][piece.tensor_offset : piece.tensor_offset + piece.numel]
            assert torch.all(dst == -1), "two ranks own the same element"
            dst.copy_(src)
    for a, b in zip(rebuilt, ids):
        assert torch.equal(a, b)


def test_tensor_larger_than_bucket_is_split_and_cap_respected():
    layout = zs.compute_layout([1000, 3, 997], [torch.float32] * 3, bucket_cap_bytes=1024, world_size=3)
    assert all(b.numel * 4 <= 1024 for b in layout.buckets)
    assert len(layout.tensors[0].fragments) > 1
    assert sum(layout.fragments[f].numel for f in layout.tensors[2].fragments) == 997


def test_keys_and_dtypes_separate_buffers():
    layout = zs.compute_layout(
        [5, 5, 5, 5], [torch.float32, torch.bfloat16, torch.float32, torch.float32], 1 << 20, 2, keys=[0, 0, 0, 1]
    )
    assert len(layout.buffers) == 3
    assert layout.tensors[2].buffer == layout.tensors[0].buffer
    assert layout.tensors[3].buffer != layout.tensors[0].buffer


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(numels=[3, -1], dtypes=[torch.float32] * 2, bucket_cap_bytes=64, world_size=2), "tensor 1"),
        (dict(numels=[3], dtypes=[torch.float32], bucket_cap_bytes=64, world_size=0), "world_size"),
        (dict(numels=[3], dtypes=[torch.float32], bucket_cap_bytes=0, world_size=2), "bucket_cap_bytes"),
        (dict(numels=[3, 4], dtypes=[torch.float32], bucket_cap_bytes=64, world_size=2), "dtypes has 1"),
        (dict(numels=[3], dtypes=["float32"], bucket_cap_bytes=64, world_size=2), r"dtypes\[0\]"),
        (dict(numels=[3], dtypes=[torch.complex128], bucket_cap_bytes=64, world_size=2), "itemsize 16"),
    ],
)
def test_bad_layout_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zs.compute_layout(**kwargs)


def test_fill_flat_copies_sources_and_zeroes_the_rest():
    """Random non-overlapping pieces (bf16 sources into an fp32 buffer full of NaN):
    every covered element equals its source, every other element is zero."""
    from zeroshard.native.layout import fill_flat

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n = 97
    cuts = sorted(torch.randperm(n, generator=g)[:12].tolist())
    pieces = [(a, torch.randn(b - a, generator=g).bfloat16()) for a, b in zip(cuts[0::2], cuts[1::2])]
    flat = torch.full((n,), float("nan"))
    fill_flat(flat, pieces[::-1])  # any order
    want = torch.zeros(n)
    for a, src in pieces:
        want[a : a + src.numel()] = src.float()
    assert torch.equal(flat, want)


def test_fill_flat_is_one_foreach_zero_and_one_foreach_copy():
    """However many pieces and gaps: two operators at the dispatcher (a few kernel
    launches on CUDA), not a copy per piece and a zero per gap."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from zeroshard.native.layout import fill_flat

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    flat = torch.full((100,), float("nan"))
    pieces = [(a, torch.randn(7)) for a in range(1, 100, 10)]  # 10 pieces, 11 gaps
    with Count() as c:
        fill_flat(flat, pieces)
    writes = [op for op in c.ops if op not in ("aten.slice", "aten.view")]
    assert writes == ["aten._foreach_zero_", "aten._foreach_copy_"], c.ops
    assert flat.isfinite().all() and flat[0] == 0 and torch.equal(flat[1:8], pieces[0][1])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 61), st.lists(st.tuples(st.integers(0, 61), st.integers(0, 9)), max_size=8))
def test_gaps_are_exactly_what_no_range_covers(numel, ranges):
    """gaps() against a boolean mask: ranges in any order, empty ones, ranges that
    touch, end at or run past ``numel``; the gaps come out in order, non-empty
    and separated (two gaps never touch)."""
    from zeroshard.native.layout import gaps

    covered, taken = [], [False] * (numel + 80)
    for offset, length in ranges:  # keep them non-overlapping, as gaps() requires
        if not any(taken[offset : offset + length]):
            covered.append((offset, length))
            taken[offset : offset + length] = [True] * length
    out = gaps(numel, covered)
    mask = [False] * numel
    for start, end in out:
        assert 0 <= start < end <= numel
        mask[start:end] = [True] * (end - start)
    assert mask == [not t for t in taken[:numel]]
    assert all(a[1] < b[0] for a, b in zip(out, out[1:]))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(-1, 6)), min_size=1, max_size=9),
    st.integers(1, 6),
    st.sampled_from([1, 4, 8]),
)
def test_owner_chunks_hold_each_whole_tensor_in_its_owners_chunk(specs, world, align):
    """owner_chunks ([Note: uneven chunks] in zero3/relayout.py): tensors never overlap and
    lie inside the flat buffer, each whole one inside its owner's chunk, every tensor and
    chunk aligned, no padding beyond alignment, and no chunk longer than it must be: the
    longest of its whole tensors' and the even share, plus one tensor cut at its start."""
    from zeroshard.native.layout import owner_chunks

    numels = [n for n, _ in specs]
    owners = {i: r % world for i, (_, r) in enumerate(specs) if r >= 0}
    L = owner_chunks(numels, owners, world, align)
    b = L.bounds

    def up(x):
        return -(-x // align) * align

    assert len(b) == world + 1 and b[0] == 0 and all(x <= y for x, y in zip(b, b[1:]))
    spans = sorted((L.offsets[i], L.offsets[i] + n) for i, n in enumerate(numels) if n)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:])) and (not spans or spans[-1][1] <= b[-1])
    assert all(o % align == 0 for o in L.offsets) and all(x % align == 0 for x in b[:-1])
    assert b[-1] <= sum(up(n) for n in numels)
    for i, r in owners.items():
        assert numels[i] == 0 or b[r] <= L.offsets[i] and L.offsets[i] + numels[i] <= b[r + 1]
    whole = [sum(up(numels[i]) for i, o in owners.items() if o == r) for r in range(world)]
    share = up(-(-b[-1] // world))
    longest_cut = max([up(n) for i, n in enumerate(numels) if i not in owners] + [0])
    for r in range(world):
        assert b[r + 1] - b[r] <= max(whole[r], share) + longest_cut + align, (r, b, whole, share)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(-1, 40)), min_size=1, max_size=9),
    st.sampled_from([8, 64, 4096]),
    st.sampled_from([0, 64, 1 << 16]),
)
def test_owner_chunks_with_a_least_fill_touch_few_chunks(specs, world, min_fill):
    """With ``min_fill``, the tensors updated elementwise fill chunks to at least that many
    elements: besides the owners' chunks, at most (their elements / min_fill) + 2 chunks
    hold anything (however many ranks), whole tensors still lie in their owners' chunks,
    and no chunk passes max(its whole tensors, the even share, min_fill) by more than one
    cut tensor."""
    from zeroshard.native.layout import owner_chunks

    numels = [n for n, _ in specs]
    owners = {i: r % world for i, (_, r) in enumerate(specs) if r >= 0}
    L = owner_chunks(numels, owners, world, 4, min_fill)
    b = L.bounds

    def up(x):
        return -(-x // 4) * 4

    assert len(b) == world + 1 and b[0] == 0 and b[-1] <= sum(up(n) for n in numels)
    for i, r in owners.items():
        assert numels[i] == 0 or b[r] <= L.offsets[i] and L.offsets[i] + numels[i] <= b[r + 1]
    rest = sum(up(n) for i, n in enumerate(numels) if i not in owners)
    holders = {r for i, r in owners.items() if numels[i]}
    busy = [r for r in range(world) if b[r + 1] > b[r] and r not in holders]
    if min_fill:
        assert len(busy) <= rest // min_fill + 2, (busy, rest)
    share = up(-(-b[-1] // world))
    longest_cut = max([up(n) for i, n in enumerate(numels) if i not in owners] + [0])
    for r in range(world):
        whole = sum(up(numels[i]) for i, o in owners.items() if o == r)
        assert b[r + 1] - b[r] <= max(whole, share, up(min(min_fill, rest))) + longest_cut + 4, (r, b)


def test_owner_chunks_of_gpt_blocks_balance_the_cost():
    """Eight GPT blocks (matrices of 3, 1, 4 and 4 units of d²), owners by LPT over all of
    them: at 2, 3 and 4 ranks each rank's Newton-Schulz cost is the mean, and no block
    is padded."""
    from zeroshard.native.layout import assign_owners, owner_chunks, update_cost

    d = 64
    shapes = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    numels = [torch.Size(s).numel() for s in shapes]
    mats = [k for k, s in enumerate(shapes) if len(s) == 2]
    for world in (2, 3, 4):
        costs = [update_cost(shapes[k]) for _ in range(8) for k in mats]
        owners = assign_owners(costs, world)
        load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        assert max(load) == min(load), (world, load)
        for blk in range(8):
            mine = dict(zip(mats, owners[blk * len(mats) : (blk + 1) * len(mats)]))
            L = owner_chunks(numels, mine, world)
            assert L.bounds[-1] == sum(numels)
            assert all(
                L.bounds[r] <= L.offsets[k] and L.offsets[k] + numels[k] <= L.bounds[r + 1] for k, r in mine.items()
            )
