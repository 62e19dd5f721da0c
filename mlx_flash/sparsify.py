"""`python -m mlx_flash.sparsify`: activation-sparsity thresholds; the command's code is
mlx_flash/cli/sparsify.py."""

import sys

from .cli.sparsify import main

if __name__ == "__main__":
    sys.exit(main())
