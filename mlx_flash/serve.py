"""`python -m mlx_flash.serve`: the OpenAI-compatible server; the command's code is mlx_flash/cli/serve.py."""

import sys

from .cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
