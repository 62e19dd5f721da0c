"""The benchmarks, one module per command of `python -m mlx_flash.bench NAME [args]` (the table of
names is mlx_flash/bench/__main__.py's COMMANDS). Each command module has
`main(argv: list[str] | None = None) -> int`, an argparse parser whose prog is
`python -m mlx_flash.bench NAME`, and a docstring whose usage lines name that command; the measuring
harnesses they share are the modules of mlx_flash/bench/ above this folder. A module here without a
main (memory_report.py) is one command's part, not a command."""

import sys
from collections.abc import Callable

from mlx_flash.bench.record import write
from mlx_flash.errors import FlashError


def chosen_parts(text: str, known) -> list[str] | None:
    """A command's --parts as a list; None, after one `error:` line on stderr, when it names a part
    that is not in `known` (the command then exits 2, as argparse does for a bad choice)."""
    parts = text.split(",")
    unknown = [x for x in parts if x not in known]
    if unknown:
        print(f"error: --parts: unknown part {unknown[0]!r} (choose from {', '.join(known)})", file=sys.stderr)
        return None
    return parts


def recorded(path: str, header: dict, record: dict, fill: Callable[[], None]) -> int:
    """Run `fill()`, which adds a command's parts to `record` (and may write it as it grows); then the
    record is written whole at `path` and named, exit 0. A FlashError is one `error:` line, exit 1."""
    try:
        fill()
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write(path, header, **record)
    print(f"wrote {path}")
    return 0
