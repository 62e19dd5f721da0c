"""`python -m mlx_flash.profile_disk`: the disk profile; the command's code is mlx_flash/cli/profile_disk.py.
Importing this module by name rebinds the function mlx_flash.profile_disk in the importing process:
run it, do not import it."""

import sys

from .cli.profile_disk import main

if __name__ == "__main__":
    sys.exit(main())
