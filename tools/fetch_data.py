"""Fetch the offline text corpora (Austen novels, Wikipedia articles) into the cache dir.

    python tools/fetch_data.py [--cache-dir DIR] [--force]

Austen comes from Debian's r-cran-janeaustenr (apt-get download, never installed), Wikipedia from the
gensim wheel's test data (pip download --no-deps). Needs the `rdata` package (dev extra).
"""

import argparse
import os
import sys

from mlx_flash.calibrate import fetch_all
from mlx_flash.errors import first_paragraph


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--cache-dir", default=None, help="cache root (default: $MLX_FLASH_CACHE or ~/.cache/mlx_flash)")
    p.add_argument("--force", action="store_true", help="fetch again even if the files exist")
    a = p.parse_args()
    paths, errors = fetch_all(a.cache_dir, a.force)
    for name, path in paths.items():
        print(f"{name}: {path} ({os.path.getsize(path) / 1e6:.1f} MB)")
    for name, err in errors.items():
        print(f"error: {name}: {err}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
