"""What a thresholded model streamed from flash would read, and how long this machine's drive takes to
read it: the bound on streamed activation sparsity, measured before the engine streams it.

A streamed product's input is known only when the layer reaches it, so its active channels can be
read only then: each streamed product of a token is one batch of reads, waited for before the next
(the layer's own compute would come on top). The masks are the model's own: its thresholded engine
runs over Wikipedia text with every row thresholded (each token as its decode step computes it), and
each product's input records which channels pass its threshold.

Two channel-major layouts on flash are counted, both the bytes the kernel reads:
- `stored`: the layout in memory today (kernels/channel_major.py) written to flash as it is: a group's
  scales and biases (all outputs) then its channels' codes. A group's scales are read when any of its
  channels is active.
- `requantized`: each input channel carries its own scales along the outputs, so a zeroed channel costs
  nothing (the same bytes in all; its quality would differ from the stored precision's and is not
  measured here).

Active runs are rounded out to the drive's pages (direct reads), then runs no more than `gap` bytes
apart are merged into one read (reading what lies between): fewer, larger reads against more bytes. Dense reads
every streamed product whole, in the same chain of batches, and once more as one batch a token (every
byte in flight at once, as a dense engine's read-ahead can do, since dense needs no input to know what
to read). Seconds come from the reader pool replaying the reads, page cache dropped; bytes from
/proc/self/io."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..backends.thresholded import Thresholded
from ..calibrate.thresholds import InputWatcher, watching
from ..errors import FlashError
from .cgroup import replay_reads

PAGE = 4096
ROLES_IN_ORDER = ("qkv", "o", "gate_up", "down")  # the order a layer reaches its products' inputs
LAYOUTS = ("stored", "requantized")


@dataclass(frozen=True)
class Product:
    """One thresholded product's channel-major layout: n_in input channels of channel_bytes each, in
    groups of `group` sharing group_bytes of scales and biases."""

    layer: int
    role: str
    n_in: int
    channel_bytes: int
    group: int
    group_bytes: int

    @property
    def nbytes(self) -> int:
        return (self.n_in // self.group) * (self.group * self.channel_bytes + self.group_bytes)


class MaskRecordingOps(InputWatcher):
    """Keeps, per thresholded product, which input channels of each row pass its threshold."""

    def __init__(self, ops, where: dict[int, tuple[int, str]]):
        super().__init__(ops, where)
        self.masks: dict[tuple[int, str], list[np.ndarray]] = {}

    def seen(self, x, w, found):
        a = np.abs(self._ops.to_numpy(x).astype(np.float32))
        self.masks.setdefault(found, []).append((a > w.threshold).reshape(-1, a.shape[-1]))
        return x


def products_of(engine) -> tuple[list[Product], dict[int, tuple[int, str]]]:
    """The engine's thresholded products over the channel-major kernel, in the order a token reaches
    them, and the id of the weight whose input stands for each (gate and up share one input: gate's)."""
    where, weights = {}, {}
    for i in range(engine.args.num_hidden_layers):
        lw, fw = engine.weights["layers"][i], engine.ffn.layer(i)
        for role, w in (("qkv", lw["qkv"]), ("o", lw["o"]), ("gate_up", fw.gate_up), ("down", fw.down)):
            weights[(i, role)] = w if isinstance(w, tuple) else (w,)
    out = []
    for (layer, role), parts in sorted(weights.items(), key=lambda kv: (kv[0][0], ROLES_IN_ORDER.index(kv[0][1]))):
        if not all(isinstance(p, Thresholded) and p.kernel is not None for p in parts):
            raise FlashError(
                f"layer {layer} {role}: not on the channel-major kernel (a GGUF block kind, or a GPU), so "
                "sparsity reads every byte of it and there are no sparse reads to replay"
            )
        first = parts[0]
        where[id(first)] = (layer, role)
        out.append(
            Product(
                layer,
                role,
                first.n_in,
                sum(p.channel_bytes for p in parts),
                first.group,
                sum(p.group_bytes for p in parts),
            )
        )
    return out, where


def capture_masks(engine, ids: list[int]) -> dict[tuple[int, str], np.ndarray]:
    """(layer, role) -> bool [len(ids), n_in]: which input channels pass each product's threshold when
    `engine` (loaded with sparsity and sparsity_rows="all") scores `ids` as one window."""
    _, where = products_of(engine)
    rec = MaskRecordingOps(engine.ops, where)
    with watching(engine, rec):
        caches = engine.new_caches()
        engine.forward(list(ids), caches)
        engine.release(caches)
    return {k: np.concatenate(v) for k, v in rec.masks.items()}


def unit_runs(p: Product, mask: np.ndarray, layout: str) -> np.ndarray:
    """int64 [n, 2] byte ranges [start, end) of one row's active units within the product's layout,
    runs of adjacent active units already joined. `stored`: per group, its scales (active when any of
    its channels is) then its channels; `requantized`: channels alone, each with its own scales."""
    mask = np.asarray(mask, dtype=bool)
    if layout == "stored":
        groups = mask.reshape(-1, p.group)
        active = np.concatenate([groups.any(axis=1, keepdims=True), groups], axis=1).ravel()
        sizes = np.tile(np.array([p.group_bytes] + [p.channel_bytes] * p.group, dtype=np.int64), groups.shape[0])
    elif layout == "requantized":
        active = mask
        sizes = np.full(p.n_in, p.channel_bytes + p.group_bytes // p.group, dtype=np.int64)
    else:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    ends = np.cumsum(sizes)
    starts = ends - sizes
    edges = np.diff(np.concatenate([[0], active.astype(np.int8), [0]]))
    first, last = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
    return np.stack([starts[first], ends[last]], axis=1) if first.size else np.zeros((0, 2), np.int64)


def merged_reads(runs: np.ndarray, gap: int, page: int = PAGE) -> np.ndarray:
    """The reads that cover `runs` ([n, 2] sorted, disjoint): each rounded out to whole pages, then any
    two no more than `gap` bytes apart (or sharing a page) read as one."""
    if runs.size == 0:
        return np.zeros((0, 2), np.int64)
    lo = runs[:, 0] // page * page
    hi = -(-runs[:, 1] // page) * page
    breaks = np.concatenate([[True], lo[1:] - hi[:-1] > gap])
    which = np.cumsum(breaks) - 1
    out = np.zeros((int(which[-1]) + 1, 2), np.int64)
    out[:, 0] = lo[breaks]
    np.maximum.at(out[:, 1], which, hi)
    return out


@dataclass
class Placement:
    """Where each product's layout lies on flash for the replay: stand-in files of the model's own
    store (their bytes are never used, only their positions on the drive), products one after another
    in their file, wrapping to its start where it runs out."""

    offsets: dict[tuple[int, str], tuple[str, int]]

    @classmethod
    def lay_out(cls, files: list[tuple[str, list[Product]]]) -> "Placement":
        offsets = {}
        for path, products in files:
            size, at = os.path.getsize(path) // PAGE * PAGE, 0
            for p in products:
                span = -(-p.nbytes // PAGE) * PAGE
                if span > size:
                    raise FlashError(f"{path}: {size} bytes cannot stand in for a product of {p.nbytes}")
                if at + span > size:
                    at = 0
                offsets[(p.layer, p.role)] = (path, at)
                at += span
        return cls(offsets)

    def ranges(self, p: Product, reads: np.ndarray) -> list[tuple[str, int, int]]:
        path, base = self.offsets[(p.layer, p.role)]
        return [(path, base + int(a), int(b - a)) for a, b in reads]


def token_batches(
    products: list[Product], masks: dict, rows: range, place: Placement, layout: str | None, gap: int
) -> list[list[tuple[str, int, int]]]:
    """One batch per streamed product per token of `rows`, in the order a token reaches them: its
    active reads (layout None: the whole product, dense)."""
    out = []
    for t in rows:
        for p in products:
            if layout is None:
                reads = np.array([[0, -(-p.nbytes // PAGE) * PAGE]], np.int64)
            else:
                reads = merged_reads(unit_runs(p, masks[(p.layer, p.role)][t], layout), gap)
            out.append(place.ranges(p, reads))
    return out


def read_bytes() -> int:
    """Bytes this process has had read from its drives (direct reads included)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))


def replay(batches: list[list[tuple[str, int, int]]], threads: int, tokens: int) -> dict:
    """Seconds and bytes a token for the reader pool to read `batches` (direct I/O, cache dropped)."""
    before = read_bytes()
    seconds = replay_reads(batches, threads)
    got = read_bytes() - before
    asked = sum(n for b in batches for _, _, n in b)
    reads = sum(len(b) for b in batches)
    return {
        "s_per_token": seconds / tokens,
        "bytes_per_token": got / tokens,
        "asked_per_token": asked / tokens,
        "reads_per_token": reads / tokens,
    }


def zeroed_share(products: list[Product], masks: dict) -> float:
    """Share of the streamed products' input channels the thresholds zeroed, weighted by channels."""
    on = sum(int(masks[(p.layer, p.role)].sum()) for p in products)
    total = sum(masks[(p.layer, p.role)].size for p in products)
    return 1.0 - on / max(total, 1)


def dense_token_batches(products: list[Product], tokens: int, place: Placement) -> list[list[tuple[str, int, int]]]:
    """One batch a token holding every streamed product whole: dense with all its reads in flight."""
    whole = [place.ranges(p, np.array([[0, -(-p.nbytes // PAGE) * PAGE]], np.int64))[0] for p in products]
    return [list(whole) for _ in range(tokens)]


def carried_over(products: list[Product], masks: dict) -> dict:
    """What a cache of the previous token's active channels would hold and save: the share of a
    token's active code bytes that were active one token before (its best hit rate), and the MB that
    previous set takes (what the cache must hold), averaged over the tokens after the first."""
    hit = total = held = 0.0
    for p in products:
        m = masks[(p.layer, p.role)]
        if m.shape[0] < 2:
            continue
        both = np.logical_and(m[1:], m[:-1]).sum()
        hit += float(both) * p.channel_bytes
        total += float(m[1:].sum()) * p.channel_bytes
        held += float(m[:-1].sum()) * p.channel_bytes / (m.shape[0] - 1)
    return {"hit_share": hit / total if total else 0.0, "held_mb": held / 1e6}
