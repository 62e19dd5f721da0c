"""The converted stores in the cache: list them, remove one, prune the old and the broken.

    python -m mlx_flash.stores list              each store: its source, size on disk, the converter
                                                     version that wrote it, its last use; and the cache
    python -m mlx_flash.stores remove NAME       delete one (its name, or the file it was converted from)
    python -m mlx_flash.stores prune [--dry-run] delete the stores an older converter wrote, the broken
                                                     ones and the folders of conversions that died
                                                     half-way
    [--cache-dir DIR]                                (default: $MLX_FLASH_CACHE, else ~/.cache/mlx_flash)
    (installed as the console script mlx-flash-models)

A broken store (its manifest.json gone, unreadable or not a store's) is listed as broken with its
size and why, and counted. A store that a running engine or conversion holds is refused with one
line and exit status 1; a store the next load needs again is converted again then (from its source).
"""

import argparse
import sys
import time

from ..config import default_cache_dir
from ..convert import CONVERTER_VERSION
from ..errors import FlashError, first_paragraph
from ..locate.cached_stores import CachedStore, find, list_stores, prune, remove, stores_dir
from ..units import fmt


PRUNE = (
    "Delete the stores an older converter wrote, the broken ones (manifest.json gone, unreadable or not a "
    "store's) and the folders of conversions that died half-way; a store a running engine or conversion "
    "holds is kept, and said."
)


def _row(s: CachedStore) -> list[str]:
    if s.broken:
        return [s.name, f"(broken: {s.broken})", fmt(s.size), "-", _when(s)]
    if s.partial_pid:
        version = "-"
    elif s.converter_version is None:
        version = f"<{CONVERTER_VERSION} (old)"
    else:
        version = f"{s.converter_version}" + (" (old)" if s.outdated else "")
    return [s.name, s.source, fmt(s.size), version, _when(s)]


def _when(s: CachedStore) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_used)) if s.last_used else "-"


def print_list(cache_dir: str) -> None:
    stores = list_stores(cache_dir)
    print(f"cache: {stores_dir(cache_dir)}")
    if not stores:
        print("no stores (a model is converted into the cache on first use)")
        return
    rows = [["NAME", "SOURCE", "SIZE", "CONVERTER", "LAST USED"]] + [_row(s) for s in stores]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    old = [s for s in stores if s.outdated or s.broken or s.dead_partial]
    line = f"{len(stores)} stores, {fmt(sum(s.size for s in stores))}"
    if old:
        line += f"; prune removes {len(old)} ({fmt(sum(s.size for s in old))}): older converter, broken or unfinished"
    print(line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.stores", description=first_paragraph(__doc__))
    p.add_argument("--cache-dir", default=None, help="the cache (default: $MLX_FLASH_CACHE, else ~/.cache/mlx_flash)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="each store: source, size, converter version, last use (a broken one: why)")
    rm = sub.add_parser("remove", help="delete one store")
    rm.add_argument("name", help="the store's name (as list shows it) or the file it was converted from")
    what = "delete stores of older converters, broken stores and unfinished conversions"
    pr = sub.add_parser("prune", help=what, description=PRUNE)
    pr.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    a = p.parse_args(argv)
    cache = a.cache_dir or default_cache_dir()
    try:
        if a.command == "list":
            print_list(cache)
        elif a.command == "remove":
            s = find(cache, a.name)
            remove(s)
            print(f"removed {s.name} ({fmt(s.size)})")
        elif a.dry_run:
            old, kept = prune(cache, dry_run=True)
            for s in old:
                print(f"would remove {s.name} ({fmt(s.size)})")
            for why in kept:
                print(f"would keep {why}")
            print(f"{len(old)} to remove, {fmt(sum(s.size for s in old))}")
        else:
            removed, kept = prune(cache)
            for s in removed:
                print(f"removed {s.name} ({fmt(s.size)})")
            for why in kept:
                print(f"kept {why}")
            print(f"{len(removed)} removed, {fmt(sum(s.size for s in removed))} freed")
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
