"""Turning a batch of wanted byte ranges into the reads the pool issues, with numpy so that a batch
of thousands of small ranges (a token's active FFN rows) costs microseconds to plan, not the
interpreter time of a loop per range.

A plan is built from parallel arrays over the wanted ranges: file index, file offset, length,
destination index and offset inside that destination. Ranges are sorted per file; a range whose gap
to the reads before it is at most `gap` bytes joins the current read (overlaps always join), and the
gap bytes are read and thrown away. No read spans more than `max_chunk` bytes, so the worker's
scratch buffer is bounded and big ranges spread over several workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 4096
_FILE_STRIDE = 1 << 44  # puts every file on one number line so one cumulative max serves them all


@dataclass(slots=True)
class Plan:
    # per wanted range, sorted by (file, offset); long ranges already split at max_chunk
    offset: np.ndarray
    length: np.ndarray
    dest: np.ndarray
    dest_offset: np.ndarray
    # per read ("chunk"): file index, byte span [start, end), and its ranges [first, first + count)
    c_file: np.ndarray
    c_start: np.ndarray
    c_end: np.ndarray
    c_first: np.ndarray
    c_count: np.ndarray

    @property
    def n_chunks(self) -> int:
        return int(self.c_start.size)


def _split_long(file, offset, length, dest, dest_offset, max_chunk):
    """Ranges longer than max_chunk become max_chunk-sized pieces (the last one shorter)."""
    pieces = np.maximum(1, -(-length // max_chunk))
    if (pieces == 1).all():
        return file, offset, length, dest, dest_offset
    idx = np.repeat(np.arange(length.size), pieces)
    k = np.arange(idx.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece number in its range
    skip = k * max_chunk
    return (
        file[idx],
        offset[idx] + skip,
        np.minimum(max_chunk, length[idx] - skip),
        dest[idx],
        dest_offset[idx] + skip,
    )


def plan_reads(file, offset, length, dest, dest_offset, gap: int, max_chunk: int) -> Plan:
    file, offset, length, dest, dest_offset = (
        np.asarray(a, dtype=np.int64) for a in (file, offset, length, dest, dest_offset)
    )
    keep = length > 0
    if not keep.all():
        file, offset, length, dest, dest_offset = (a[keep] for a in (file, offset, length, dest, dest_offset))
    file, offset, length, dest, dest_offset = _split_long(file, offset, length, dest, dest_offset, max_chunk)
    order = np.lexsort((offset, file))
    file, offset, length, dest, dest_offset = (a[order] for a in (file, offset, length, dest, dest_offset))
    n = offset.size
    if n == 0:
        e = np.zeros(0, np.int64)
        return Plan(offset, length, dest, dest_offset, e, e, e, e, e)
    pos = file * _FILE_STRIDE + offset
    end = pos + length
    reach = np.maximum.accumulate(end)  # furthest byte read by this range or any before it
    new = np.ones(n, dtype=bool)
    new[1:] = (pos[1:] - reach[:-1] > gap) | (file[1:] != file[:-1])
    first = np.flatnonzero(new)
    c_end = np.maximum.reduceat(end, first)
    too_long = np.flatnonzero(c_end - pos[first] > max_chunk)
    if too_long.size:  # a run of coalesced ranges grew past max_chunk: re-split just those greedily
        first = _resplit(first, too_long, pos, end, n, max_chunk)
        c_end = np.maximum.reduceat(end, first)
    count = np.diff(np.append(first, n))
    c_file = file[first]
    return Plan(
        offset,
        length,
        dest,
        dest_offset,
        c_file,
        pos[first] - c_file * _FILE_STRIDE,
        c_end - c_file * _FILE_STRIDE,
        first,
        count,
    )


def _resplit(first, too_long, pos, end, n, max_chunk):
    """Cut each over-long run greedily: a piece grows while its span stays within max_chunk. One
    numpy search per piece (a run of a few MiB has a handful), not a Python step per range."""
    bounds = np.append(first, n)
    extra = []
    for c in too_long.tolist():
        s, e = int(bounds[c]), int(bounds[c + 1])
        while True:
            reach = np.maximum.accumulate(end[s:e])  # furthest byte of the piece if it ran to each range
            k = int(np.searchsorted(reach, pos[s] + max_chunk, side="right"))  # ranges that fit
            s += max(k, 1)
            if s >= e:
                break
            extra.append(s)
    return np.sort(np.concatenate([first, np.asarray(extra, dtype=np.int64)]))
