"""`python -m mlx_flash.stores`: the converted stores in the cache (list, remove, prune); the
command's code is mlx_flash/cli/models.py."""

import sys

from .cli.models import main

if __name__ == "__main__":
    sys.exit(main())
