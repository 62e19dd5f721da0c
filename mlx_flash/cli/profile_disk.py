"""Profile random-read throughput of a disk (chunk sizes 4 KiB-4 MiB x 1-64 threads, page cache
bypassed) and latency to first byte; save a JSON profile and a PNG plot (paper Fig. 2b).

    python -m mlx_flash.profile_disk [--dir PATH] [--size-gib 2] [--seconds 1.0] [--out DIR]
    (installed as the console script mlx-flash-profile-disk)

The profile is saved as disk_profile.json in the cache dir (or --out), where the engine finds it.
The function that measures is mlx_flash.profile_disk (store/disk_profile.py); this is its command.
"""

import argparse
import os
import sys

from ..config import default_cache_dir
from ..errors import FlashError, first_paragraph
from ..store import disk_profile as dp


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.profile_disk", description=first_paragraph(__doc__))
    p.add_argument("--dir", default=None, help="where the scratch file goes (default: the cache dir)")
    p.add_argument("--size-gib", type=float, default=2.0, help="scratch file size (default 2 GiB)")
    p.add_argument("--seconds", type=float, default=1.0, help="measuring time per cell (default 1 s)")
    p.add_argument("--threads", default=",".join(map(str, dp.THREADS)), help="comma list of thread counts")
    p.add_argument("--chunks-kib", default=",".join(str(c // 1024) for c in dp.CHUNKS), help="comma list, KiB")
    p.add_argument("--out", default=None, help="output dir for disk_profile.json/.png (default: the cache dir)")
    p.add_argument("--keep", action="store_true", help="keep the scratch file")
    a = p.parse_args(argv)
    out = a.out or default_cache_dir()
    os.makedirs(out, exist_ok=True)
    scratch_dir = a.dir or out
    if not os.path.isdir(scratch_dir):
        print(f"error: {scratch_dir}: no such directory", file=sys.stderr)
        return 1
    scratch = os.path.join(scratch_dir, "mlx_flash_profile.bin")
    try:
        dp.make_scratch_file(scratch, int(a.size_gib * (1 << 30)), progress=True)
        try:
            prof = dp.profile_disk(
                scratch,
                chunks=[int(c) * 1024 for c in a.chunks_kib.split(",")],
                threads=[int(t) for t in a.threads.split(",")],
                seconds=a.seconds,
                progress=True,
            )
        finally:
            if not a.keep:
                os.remove(scratch)
        js, png = os.path.join(out, dp.PROFILE_NAME), os.path.join(out, "disk_profile.png")
        dp.save_profile(prof, js)
        dp.plot_profile(prof, png)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"latency to first byte {prof['latency_s'] * 1e6:.0f} us; coalescing gap {dp.coalesce_gap(prof)} B")
    for t, row in prof["throughput"].items():
        print(f"{t:>3} threads: " + "  ".join(f"{int(c) // 1024}K {v / 1e9:.2f}" for c, v in row.items()) + " GB/s")
    print(f"wrote {js} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
