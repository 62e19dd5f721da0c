"""The arithmetic benchmark's pieces (mlx_flash/bench/: record, decode_pairs, quality, arithmetic_kernels,
step_profile) and its tool's refusals. Speeds are not asserted: they are the benchmark's output, not a test's."""

import json
import os
import re
import subprocess
import sys

import numpy as np

import mlx_flash
from mlx_flash.bench import arithmetic_kernels, decode_pairs, quality, record
from mlx_flash.bench.step_profile import step_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_record_names_its_tree_cpu_versions_and_command(tmp_path):
    head = record.provenance(["-m", "mlx_flash.bench", "arithmetic", "--parts", "decode"])
    assert head["command"] == "python -m mlx_flash.bench arithmetic --parts decode"
    if os.path.isdir(os.path.join(ROOT, ".git")):
        assert re.fullmatch(r"[0-9a-f]{40}", head["commit"])
    assert set(head["cpu_flags"]) <= set(record.DISPATCH_FLAGS)
    assert head["versions"]["numpy"] == np.__version__
    assert head["kernel_path"] in {"PORTABLE", "AVX2", "AVX512", "AVXVNNI", "AVX512_VNNI"}
    path = tmp_path / "out" / "r.json"
    record.write(str(path), head, decode={"x": 1})
    assert json.loads(path.read_text())["decode"] == {"x": 1}


def test_cpu_flags_read_the_first_cpu_and_nothing_without_the_file(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor: 0\nflags\t\t: fpu avx2 avx512f\nprocessor: 1\nflags: fpu\n")
    assert record.cpu_flags(str(info)) == {"fpu", "avx2", "avx512f"}
    assert record.cpu_flags(str(tmp_path / "missing")) == set()


def test_interleaved_pairs_alternate_the_order_and_take_median_and_lowest_ratio():
    calls, rates = [], iter([100, 50, 90, 60, 110, 55, 80, 40, 120, 60, 100, 50])

    def ours():
        calls.append("ours")
        return 0.0, next(rates)

    def peer():
        calls.append("peer")
        return 0.0, next(rates)

    res = decode_pairs.interleaved(ours, peer, pairs=5)
    # warm-up ours, peer; then ours first in pairs 0, 2, 4 and second in pairs 1, 3
    assert calls == ["ours", "peer", "ours", "peer", "peer", "ours", "ours", "peer", "peer", "ours", "ours", "peer"]
    # after the warm-up's 100 and 50, each call takes the next rate: odd pairs call the peer first
    assert [r["ours"] for r in res["pairs"]] == [90, 55, 80, 60, 100]
    assert [r["peer"] for r in res["pairs"]] == [60, 110, 40, 120, 50]
    assert res["lowest_ratio"] == 0.5 and res["median_ratio"] == 1.5


def test_agreement_counts_equal_continuations_per_reference():
    runs = {"exact": [[1, 2], [3, 4], [5]], "q8": [[1, 2], [3, 9], [5]], "transformers": [[1, 2], [3, 4], [6]]}
    got = quality.agreement(runs, ["transformers", "exact"])
    assert got["q8"] == {"transformers": 1, "exact": 2}
    assert got["exact"] == {"transformers": 2}
    assert got["transformers"] == {"exact": 2}


def test_the_kernel_table_times_both_arithmetics_and_every_level(monkeypatch):
    monkeypatch.setitem(arithmetic_kernels.SHAPES, "tiny", (64, 96))
    rows = arithmetic_kernels.arithmetic_table(["tiny"], [1, 16], [1], repeat=2, levels=True)
    timed = [r for r in rows if "level" not in r]
    assert [(r["rows"], r["threads"]) for r in timed] == [(1, 1), (16, 1)]
    for r in timed:
        assert r["exact_ms"] > 0 and r["q8_ms"] > 0 and r["stored_MB"] == 64 * (96 // 2 + 96 // 32 * 4) / 1e6
    from mlx_flash.kernels.qmatmul import runnable_isas

    assert [r["level"] for r in rows if "level" in r] == [isa.name for isa in runnable_isas()]
    assert all(r["exact_ms"] > 0 and r["q8_ms"] > 0 for r in rows if "level" in r)


def test_the_tool_refuses_an_unknown_part_in_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "mlx_flash.bench", "arithmetic", "--parts", "decode,speed"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    parts = "quality, decode, prompt, rows, profile, throughput, kernels, tmac"
    assert out.stderr.strip() == f"error: --parts: unknown part 'speed' (choose from {parts})"


def test_a_step_profile_names_the_kernels_and_leaves_python_the_rest(tiny_store):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        one, four = step_profile(e, 1, held=8, steps=2, min_ms=0), step_profile(e, 4, held=8, steps=2, min_ms=0)
    for r, rows in ((one, 1), (four, 4)):
        assert r["rows"] == rows and r["step_ms"] > 0
        assert {"mlx_flash::attention", "mlx_flash::rms_norm"} <= set(r["ops_ms"])
        assert list(r["ops_ms"].values()) == sorted(r["ops_ms"].values(), reverse=True)
