"""`python -m mlx_flash.verify`: the store check; the command's code is mlx_flash/cli/verify.py."""

import sys

from .cli.verify import main

if __name__ == "__main__":
    sys.exit(main())
