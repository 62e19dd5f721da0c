"""Read planning: which ranges share a read, and that no read outgrows max_chunk."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_flash.store.read_plan import plan_reads


def plan(offsets, lengths, gap, max_chunk=1 << 20, files=None):
    n = len(offsets)
    files = [0] * n if files is None else files
    return plan_reads(files, offsets, lengths, [0] * n, [0] * n, gap, max_chunk)


def test_gap_at_or_below_threshold_coalesces():
    p = plan([0, 150, 400], [100, 100, 100], gap=50)
    assert p.c_start.tolist() == [0, 400] and p.c_end.tolist() == [250, 500] and p.c_count.tolist() == [2, 1]


def test_overlaps_always_coalesce_and_files_never_do():
    p = plan([0, 50, 0], [100, 100, 100], gap=0, files=[0, 0, 1])
    assert p.c_file.tolist() == [0, 1] and p.c_end.tolist() == [150, 100]


def test_long_range_is_split_at_max_chunk():
    p = plan([4096], [10000], gap=0, max_chunk=4096)
    assert p.c_start.tolist() == [4096, 8192, 12288] and p.c_end.tolist() == [8192, 12288, 14096]
    assert p.dest_offset.tolist() == [0, 4096, 8192]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 50000), st.integers(0, 9000), st.integers(0, 1)), min_size=1, max_size=30),
    gap=st.integers(0, 5000),
    max_chunk=st.sampled_from([4096, 16384]),
)
def test_every_range_is_reassembled_and_reads_stay_bounded(rows, gap, max_chunk):
    offs, lens, files = (np.array(c) for c in zip(*rows))
    n = len(rows)
    p = plan_reads(files, offs, lens, np.arange(n), np.zeros(n), gap, max_chunk)  # dest i = range i
    assert (p.c_end - p.c_start <= max_chunk).all()
    assert p.c_count.sum() == p.offset.size
    piece_file = np.repeat(p.c_file, p.c_count)
    for c in range(p.n_chunks):  # every piece lies inside its read
        r = slice(p.c_first[c], p.c_first[c] + p.c_count[c])
        assert (p.offset[r] >= p.c_start[c]).all() and (p.offset[r] + p.length[r] <= p.c_end[c]).all()
    for i in range(n):  # the pieces of range i tile it exactly, in the right file
        mine = np.flatnonzero(p.dest == i)
        if lens[i] == 0:
            assert mine.size == 0
            continue
        order = mine[np.argsort(p.dest_offset[mine])]
        assert (piece_file[order] == files[i]).all()
        assert (p.offset[order] == offs[i] + p.dest_offset[order]).all()
        ends = p.dest_offset[order] + p.length[order]
        assert p.dest_offset[order][0] == 0 and (p.dest_offset[order][1:] == ends[:-1]).all() and ends[-1] == lens[i]
