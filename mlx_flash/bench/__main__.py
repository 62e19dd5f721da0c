"""Every benchmark, one command each: `python -m mlx_flash.bench NAME [args]` runs NAME's main(args)
and exits with its status; `python -m mlx_flash.bench` (or --help) lists them. The summaries are
written here, not read from the modules, so the list prints without importing the engine."""

from __future__ import annotations

import importlib
import sys

from mlx_flash.errors import FlashError

# name -> (module under mlx_flash.bench.commands, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "arithmetic": ("arithmetic", "exact against q8 arithmetic: quality, decode, prompt, kernels; one JSON record"),
    "batch-passes": ("batch_passes", "what one batched decode or prefill pass costs, per row count"),
    "batch-peers": ("batch_peers", "generate_batch beside mlx-lm's batch_generate on the same weights"),
    "chat-memory": ("chat_memory", "what the default chat holds after one question, beside llama.cpp"),
    "concurrency": ("concurrency", "the server under concurrent streaming clients: tokens/s and TTFT"),
    "decode": ("decode", "decode and prefill tokens/s per backend (and llama.cpp), median of N runs"),
    "exact-modes": ("exact_modes", "every exact FFN mode's tokens, logits hash and reads, as JSON to compare"),
    "experts": ("experts", "EdgeMoE: the expert-cache policy table, and decode speed with cold reads"),
    "flash": ("flash", "LLM in a flash modes under one memory budget, per token, beside the cost model"),
    "io": ("io", "the reader pool against fio on random direct reads"),
    "kv-capacity": ("kv_capacity", "how many contexts one KV budget holds, per compression scheme"),
    "kv-compression": ("kv_compression", "perplexity and agreement of compressed KV chunks on long text"),
    "long-context": ("long_context", "a conversation longer than memory: KV tiers in a memory cgroup"),
    "matmul": ("matmul", "the CPU quantized matmul per shape, bits, tokens and threads (ms, GB/s)"),
    "memory": ("memory", "engines inside memory limits (cgroups), beside llama.cpp: speed, peak, reads"),
    "moe": ("moe", "MoE decode fed by real text (teacher forcing), beside llama.cpp"),
    "perplexity": ("perplexity", "perplexity of a model or store on a text"),
    "pipeline": ("pipeline", "a model split across ranks, each in its own memory limit, against one process"),
    "profile": ("profile", "where a torch decode step spends its time, and whether torch.compile pays"),
    "results": ("results", "run a tier's benchmarks into records and regenerate docs/results/ from them"),
    "read-unit": ("read_unit", "the sparse read unit's cost: perplexity against MB read, neuron and block"),
    "service": ("service", "the LLMS trace: context switching and TTFT under a KV budget, against baselines"),
    "shared-cores": ("shared_cores", "decode speed of N engine processes sharing the cores"),
    "sparse-reads": ("sparse_reads", "streamed activation sparsity bounded by the drive: its reads against dense's"),
    "sparsity": ("sparsity", "activation sparsity (TEAL): quality per level and decode against dense"),
    "sparse-kernels": ("sparse_kernels", "the sparse FFN kernels (CPU, Metal, CUDA): check, then time"),
    "switching": ("switching", "long contexts switched in a Zipf trace on a large model, KV over budget"),
    "throughput": ("throughput", "FlexGen-style throughput of a block of sequences over its budget"),
}

PROG = "python -m mlx_flash.bench"


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:{width}}  {summary}" for name, (_, summary) in sorted(COMMANDS.items()))
    return (
        f"usage: {PROG} NAME [args]\n\n"
        f"Runs one benchmark; `{PROG} NAME --help` gives its options.\n\n"
        f"benchmarks:\n{rows}\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(
            f"mlx_flash.bench: unknown benchmark {name!r} (choose from {', '.join(sorted(COMMANDS))})", file=sys.stderr
        )
        return 2
    module = importlib.import_module(f"mlx_flash.bench.commands.{COMMANDS[name][0]}")
    try:
        return module.main(rest)
    except FlashError as e:  # what a command did not turn into its own one-line error
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
