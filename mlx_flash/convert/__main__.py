"""`python -m mlx_flash.convert`: a checkpoint into a store; the command's code is mlx_flash/cli/convert.py."""

import sys

from ..cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
