"""`python -m mlx_flash.batch`: the throughput mode over a JSON-lines file of prompts; the command's code
is mlx_flash/cli/batch.py."""

import sys

from .cli.batch import main

if __name__ == "__main__":
    sys.exit(main())
