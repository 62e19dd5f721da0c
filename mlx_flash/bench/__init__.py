"""Measuring harnesses the benchmark tools share (tools/bench_*.py): above the engine, imported by
tools only, never by the runtime packages they measure."""
