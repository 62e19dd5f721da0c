"""`python -m mlx_flash.chat`: the chat (a REPL, or one answer with --prompt); the command's code is
mlx_flash/cli/chat.py."""

import sys

from .cli.chat import main

if __name__ == "__main__":
    sys.exit(main())
