"""Box arithmetic of tsckpt/_base/types.py: a region as slices, from any origin."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tsckpt._base.types import box_slices, span_slices

dims = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 5)), min_size=0, max_size=3)


@given(dims)
def test_box_slices_select_the_box_from_any_origin(d):
    origin = [z for z, _, _ in d]
    offsets = [z + a for z, a, _ in d]
    lengths = [n for _, _, n in d]
    full = np.arange(np.prod([z + a + n + 1 for z, a, n in d], dtype=int)).reshape([z + a + n + 1 for z, a, n in d])
    want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    assert np.array_equal(full[box_slices(offsets, lengths)], want)
    shifted = full[tuple(slice(z, None) for z in origin)]  # element 0 of ``shifted`` sits at ``origin``
    assert np.array_equal(shifted[box_slices(offsets, lengths, origin)], want)
    hi = [o + n for o, n in zip(offsets, lengths)]
    assert span_slices(offsets, hi, origin) == box_slices(offsets, lengths, origin)


def test_examples():
    assert box_slices((2, 3), (4, 5)) == (slice(2, 6), slice(3, 8))
    assert box_slices((2, 3), (4, 5), (1, 3)) == (slice(1, 5), slice(0, 5))
    assert span_slices((2, 3), (6, 8), (2, 0)) == (slice(0, 4), slice(3, 8))
    assert box_slices((), ()) == ()
