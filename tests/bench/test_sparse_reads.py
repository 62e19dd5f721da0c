"""The streamed-sparsity bound (mlx_flash/bench/sparse_reads.py): which bytes each layout reads for a
mask, pages and merges, the masks a thresholded engine's products see, and a replay's byte count."""

import itertools
import os

import numpy as np
import pytest

import mlx_flash
from mlx_flash.bench import sparse_reads as sr

P = sr.Product(layer=0, role="down", n_in=64, channel_bytes=1000, group=32, group_bytes=300)


def pages_read(p: sr.Product, mask, layout: str) -> set[int]:
    """Plain reference: every page holding a byte of an active unit, unit by unit."""
    pages, at = set(), 0
    for g in range(p.n_in // p.group):
        chans = mask[g * p.group : (g + 1) * p.group]
        if layout == "stored":
            units = [(p.group_bytes, any(chans))] + [(p.channel_bytes, bool(c)) for c in chans]
        else:
            units = [(p.channel_bytes + p.group_bytes // p.group, bool(c)) for c in chans]
        for size, on in units:
            if on:
                pages.update(range(at // sr.PAGE, (at + size - 1) // sr.PAGE + 1))
            at += size
    return pages


@pytest.mark.parametrize("layout", sr.LAYOUTS)
def test_reads_cover_exactly_the_pages_of_the_active_units_at_gap_zero(layout):
    rng = np.random.default_rng(0)
    for share in (0.0, 0.1, 0.5, 0.9, 1.0):
        mask = rng.random(P.n_in) < share
        reads = sr.merged_reads(sr.unit_runs(P, mask, layout), gap=0)
        got = set(itertools.chain.from_iterable(range(a // sr.PAGE, b // sr.PAGE) for a, b in reads))
        assert got == pages_read(P, mask, layout)
        assert all(b2 > a2 >= b1 for (_, b1), (a2, b2) in zip(reads, reads[1:]))  # disjoint, in order
        assert all(a % sr.PAGE == 0 and b % sr.PAGE == 0 for a, b in reads)


def test_a_group_with_no_active_channel_costs_nothing_and_one_active_channel_costs_its_scales():
    mask = np.zeros(P.n_in, bool)
    mask[40] = True  # group 1 only
    runs = sr.unit_runs(P, mask, "stored")
    block = P.group_bytes + P.group * P.channel_bytes
    scales = [block, block + P.group_bytes]
    code = [block + P.group_bytes + 8 * P.channel_bytes, block + P.group_bytes + 9 * P.channel_bytes]
    assert runs.tolist() == [scales, code]
    assert sr.unit_runs(P, np.ones(P.n_in, bool), "stored").tolist() == [[0, P.nbytes]]
    assert sr.unit_runs(P, np.zeros(P.n_in, bool), "requantized").shape == (0, 2)


def test_reads_no_further_apart_than_the_gap_merge_and_fewer_reads_never_read_less():
    runs = np.array([[0, 100], [8192, 9000], [9100, 9200], [200_000, 200_001]], np.int64)
    assert sr.merged_reads(runs, 0).tolist() == [[0, 4096], [8192, 12288], [196608, 200704]]
    assert sr.merged_reads(runs, 4096).tolist() == [[0, 12288], [196608, 200704]]
    assert sr.merged_reads(runs, 1 << 20).tolist() == [[0, 200704]]
    rng = np.random.default_rng(1)
    mask = rng.random(P.n_in) < 0.5
    sizes = [sum(b - a for a, b in sr.merged_reads(sr.unit_runs(P, mask, "stored"), g)) for g in (0, 4096, 1 << 20)]
    counts = [len(sr.merged_reads(sr.unit_runs(P, mask, "stored"), g)) for g in (0, 4096, 1 << 20)]
    assert sizes == sorted(sizes) and counts == sorted(counts, reverse=True)


def test_the_masks_are_what_each_products_threshold_passes(calibrated_q4):
    """Each mask's active channels are the ones the kernel itself counted for that product's rows."""
    ids = list(range(3, 23))
    with mlx_flash.load(
        calibrated_q4, backend="torch", ffn="resident", sparsity=0.5, sparsity_rows="all", progress=False
    ) as e:
        products, _ = sr.products_of(e)
        before = {id(w): w.counts().copy() for w in e.thresholded}
        masks = sr.capture_masks(e, ids)
        for p in products:
            lw, fw = e.weights["layers"][p.layer], e.ffn.layer(p.layer)
            w = {"qkv": lw["qkv"], "o": lw["o"], "gate_up": fw.gate_up, "down": fw.down}[p.role]
            for part in w if isinstance(w, tuple) else (w,):
                rows, active, _ = part.counts() - before[id(part)]
                assert (rows, active) == (len(ids), int(masks[(p.layer, p.role)].sum())), (p.layer, p.role)
    assert [(p.layer, p.role) for p in products][:4] == [(0, "qkv"), (0, "o"), (0, "gate_up"), (0, "down")]
    assert set(masks) == {(p.layer, p.role) for p in products}
    assert all(masks[(p.layer, p.role)].shape == (len(ids), p.n_in) for p in products)
    assert 0.3 < sr.zeroed_share(products, masks) < 0.7


def test_a_replay_asks_for_the_active_units_in_one_merged_read(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the replay drops the page cache, which needs root")
    path = tmp_path / "stand-in.bin"
    path.write_bytes(os.urandom(1 << 20))
    p = sr.Product(layer=0, role="down", n_in=64, channel_bytes=4096, group=32, group_bytes=4096)
    place = sr.Placement.lay_out([(str(path), [p])])
    mask = np.zeros((2, 64), bool)
    mask[:, :8] = True
    got = sr.replay(sr.token_batches([p], {(0, "down"): mask}, range(2), place, "stored", 0), threads=2, tokens=2)
    assert got["asked_per_token"] == 4096 + 8 * 4096
    assert got["reads_per_token"] == 1


def test_what_the_previous_tokens_channels_carry_over():
    p = sr.Product(layer=0, role="o", n_in=32, channel_bytes=10, group=32, group_bytes=0)
    m = np.zeros((3, 32), bool)
    m[0, :8] = m[1, 4:12] = m[2, 4:12] = True  # token 1 reuses 4 of 8, token 2 all 8
    got = sr.carried_over([p], {(0, "o"): m})
    assert got["hit_share"] == pytest.approx(12 / 16)
    assert got["held_mb"] == pytest.approx(8 * 10 / 1e6)


def test_the_command_refuses_a_malformed_budget_or_level_in_one_line(tmp_path, capsys, default_gguf):
    from mlx_flash.bench.commands import sparse_reads as command

    out = str(tmp_path / "r.json")
    assert (
        command.main(["--models", "default", "--budgets", "default=bogus:1", "--quality-levels", "", "--json", out])
        == 1
    )
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == "error: budget 'bogus:1' is not memory:SIZE or weights:SIZE"
    )
    assert command.main(["--levels", "default=2", "--json", out]) == 2
    assert command.main(["--budgets", "default", "--json", out]) == 2
