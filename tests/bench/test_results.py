"""mlx_flash/bench/results.py and result_tables.py: every results page is what its records render (so
each figure on the headline and the other pages is in a record the page names), the records say
where and how they were made, and a table renders without the peer."""

import json
import os
import re
import shutil

import pytest

from mlx_flash.bench import result_tables, results
from mlx_flash.config import default_cache_dir
from mlx_flash.errors import FlashError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")
RECORDS = os.path.join(RESULTS, "records")


def test_every_page_is_what_its_records_render(tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    changed = results.render(str(copy))
    assert changed == [], (
        f"{changed}: a figure differs from its record (run python -m mlx_flash.bench results --render)"
    )


def test_each_record_is_fed_by_a_run_and_feeds_a_table():
    runs = {r.record for r in results.RUNS}
    fed = {name for t in results.TABLES for name in t.records}
    assert fed <= runs and runs <= fed
    on_disk = (
        {f[: -len(".json")] for f in os.listdir(RECORDS) if f.endswith(".json")} if os.path.isdir(RECORDS) else set()
    )
    assert on_disk <= runs, f"records no run writes: {on_disk - runs}"


def test_the_committed_records_say_where_and_how_they_ran():
    names = [f for f in os.listdir(RECORDS) if f.endswith(".json")] if os.path.isdir(RECORDS) else []
    if not names:
        pytest.skip("no records committed")
    for name in names:
        with open(os.path.join(RECORDS, name)) as fh:
            rec = json.load(fh)
        run = next(r for r in results.RUNS if r.record == name[: -len(".json")])
        assert re.fullmatch(r"[0-9a-f]{40}", rec["commit"]), name
        assert rec["command"] == run.command(), name
        for field in (
            "dirty",
            "date",
            "cpu",
            "cpu_flags",
            "cores",
            "kernel_path",
            "versions",
            "load_before",
            "load_after",
        ):
            assert field in rec, (name, field)
        text = json.dumps(rec)
        for local in (default_cache_dir(), os.path.expanduser("~") + "/"):
            assert local not in text, f"{name}: a path of the machine that ran it"


def decode_record(peer: float | None) -> dict:
    pairs = [{"ours": 50.0 + i, "peer": peer and peer + i, "ratio": peer and (50.0 + i) / (peer + i)} for i in range(3)]
    ratios = [p["ratio"] for p in pairs]
    res = {
        "pairs": pairs,
        "ours_median": 51.0,
        "peer_median": peer and peer + 1,
        "median_ratio": peer and sorted(ratios)[1],
        "lowest_ratio": peer and min(ratios),
    }
    return {"decode": {"default": {"torch-exact": res}}}


def test_a_table_states_the_spread_and_the_peer_or_that_it_is_not_built():
    built = result_tables.decode(decode_record(100.0))
    assert "| default (SmolLM2-135M Q4_1) | torch | exact | 51.0 (50.0-52.0) | 101.0 (100.0-102.0) | **0.50x**" in built
    alone = result_tables.decode(decode_record(None))
    assert alone.count(result_tables.NOT_BUILT) == 2 and "51.0 (50.0-52.0)" in alone


def test_a_missing_record_names_the_command_that_writes_it(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "kernels.md").write_text("# K\n\n<!-- begin generated: kernels -->\n<!-- end generated: kernels -->\n")
    results.render(str(tmp_path))
    text = (tmp_path / "kernels.md").read_text()
    assert "_No record yet: `python -m mlx_flash.bench arithmetic --parts kernels --json" in text


def test_a_page_and_the_table_list_must_agree(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "kernels.md").write_text("# K\n\n<!-- begin generated: typo -->\n<!-- end generated: typo -->\n")
    with pytest.raises(FlashError, match=r"kernels.md: sections \['kernels'\] missing, \['typo'\] not a known table"):
        results.render(str(tmp_path))


def test_only_names_records_of_the_tier():
    with pytest.raises(FlashError, match="--only: nope not in the quick tier"):
        results.run_tier(RESULTS, results.QUICK, ["nope"])
