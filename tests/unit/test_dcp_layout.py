"""checkpoint/dcp.py's rectangles: a flat element range of a row-major tensor as the rectangular
chunks DCP describes, each a contiguous run of the range, covering it exactly, in order."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.checkpoint.dcp import rectangles


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=0, max_size=4), data=st.data())
def test_rectangles_cover_the_range_exactly(shape, data):
    total = math.prod(shape)
    start = data.draw(st.integers(0, total))
    numel = data.draw(st.integers(0, total - start))
    rects = rectangles(tuple(shape), start, numel)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    covered, pos = [], 0
    for off, size, at in rects:
        assert len(off) == len(size) == len(shape) and at == pos
        assert all(0 <= o and o + z <= s for o, z, s in zip(off, size, shape))
        first = sum(o * s for o, s in zip(off, strides))
        last = sum((o + z - 1) * s for o, z, s in zip(off, size, strides))
        n = math.prod(size)
        assert last + 1 - first == n  # contiguous in the flat order: a view of the piece
        covered.extend(range(first, first + n))
        pos += n
    assert covered == list(range(start, start + numel))
    assert len(rects) <= max(1, 2 * len(shape) - 1)


def test_examples():
    assert rectangles((4, 5), 3, 14) == [((0, 3), (1, 2), 0), ((1, 0), (2, 5), 2), ((3, 0), (1, 2), 12)]
    assert rectangles((4, 5), 5, 10) == [((1, 0), (2, 5), 0)]
    assert rectangles((), 0, 1) == [((), (), 0)] and rectangles((9,), 2, 3) == [((2,), (3,), 0)]
