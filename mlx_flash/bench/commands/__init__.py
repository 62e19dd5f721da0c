"""The benchmarks, one module per command of `python -m mlx_flash.bench NAME [args]` (the table of
names is mlx_flash/bench/__main__.py's COMMANDS). Each command module has
`main(argv: list[str] | None = None) -> int`, an argparse parser whose prog is
`python -m mlx_flash.bench NAME`, and a docstring whose usage lines name that command; the measuring
harnesses they share are the modules of mlx_flash/bench/ above this folder. A module here without a
main (memory_report.py) is one command's part, not a command."""
