"""Reader pool vs fio on random reads with the page cache bypassed, run alternately per cell.

    python -m mlx_flash.bench io [--file PATH] [--size-gib 2] [--seconds 3] [--rounds 3] [--json bench_results/io.json]

Per (block size, threads), repeated --rounds times: fio --direct=1 --rw=randread --ioengine=psync
--numjobs=N --bs=B, then the pool with N workers and the same block size. Both read at random offsets
aligned to the block size (fio's default `blockalign`; unaligned large reads are markedly slower on
this kind of drive, so the pool must see the same pattern). Prints the median of each and the ratio
of medians (a shared virtual disk varies by tens of percent between runs).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from mlx_flash.config import default_cache_dir
from mlx_flash.errors import first_paragraph
from mlx_flash.store import disk_profile as dp
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

SIZES = {"4K": 4096, "32K": 32768, "128K": 131072, "1M": 1 << 20}


def fio(path, bs, jobs, seconds):
    cmd = [
        "fio",
        "--name=r",
        f"--filename={path}",
        "--direct=1",
        "--rw=randread",
        "--ioengine=psync",
        f"--numjobs={jobs}",
        f"--bs={bs}",
        f"--runtime={seconds}",
        "--time_based",
        "--group_reporting",
        "--output-format=json",
        "--norandommap",
        "--randrepeat=0",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["jobs"][0]["read"]["bw_bytes"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench io", description=first_paragraph(__doc__))
    p.add_argument("--file", default=os.path.join(default_cache_dir(), "bench_io.bin"))
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3, help="alternating fio/pool runs per cell (median)")
    p.add_argument("--threads", default="1,4,16")
    p.add_argument("--sizes", default="4K,32K,128K,1M")
    p.add_argument("--json", default="bench_results/io.json")
    a = p.parse_args(argv)
    if shutil.which("fio") is None:
        print("error: fio is not installed (apt-get install fio)", file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(a.file)), exist_ok=True)
    dp.make_scratch_file(a.file, int(a.size_gib * (1 << 30)), progress=True)
    rows = []
    print(f"{'bs':>5} {'threads':>7} {'fio MB/s':>10} {'pool MB/s':>10} {'pool/fio':>9}")
    for name in a.sizes.split(","):
        for t in map(int, a.threads.split(",")):
            fs, ps = [], []
            for _ in range(a.rounds):
                fs.append(fio(a.file, name, t, a.seconds))
                ps.append(dp.pool_throughput(a.file, SIZES[name], t, a.seconds, align=SIZES[name]))
            f, ours = statistics.median(fs), statistics.median(ps)
            rows.append(
                {
                    "bs": name,
                    "threads": t,
                    "fio_Bps": f,
                    "pool_Bps": ours,
                    "ratio": ours / f,
                    "fio_runs": fs,
                    "pool_runs": ps,
                }
            )
            print(f"{name:>5} {t:>7} {f / 1e6:>10.1f} {ours / 1e6:>10.1f} {ours / f:>9.2f}", flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        write_json(a.json, rows, OutputError, indent=1)
    return 0
