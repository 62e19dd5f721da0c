"""The engine's configuration: the common options, and one typed group per mode (mlx_flash.options).
Every field is a user-visible option with a safe default, documented once, here or in options.py;
`load()`'s keywords and the chat's flags come from these fields."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

from .choices import PRECISIONS, PredictorKind, SparsityRows
from .errors import ConfigError
from .options import ExpertOptions, FlashOptions, IOOptions, _check_enums, check_threads, option

MAX_SPARSITY = 0.95  # above this the models measured answer noise (docs/results/sparsity.md)


class FFNMode(Enum):
    AUTO = "auto"  # resident when the model fits the memory budget, else exact streaming (chosen at load)
    RESIDENT = "resident"  # FFN weights in memory
    STREAM = "stream"  # read from the bundle file every layer (MoE: experts read when routed, cached)
    SPARSE = "sparse"  # LLM in a flash under memory_budget (MoE: as stream)


class Backend(Enum):
    AUTO = "auto"  # chosen at load (backends/choice.py): MLX on Apple silicon, else torch when installed, else MLX
    MLX = "mlx"  # Metal on a Mac, CPU elsewhere
    TORCH = "torch"  # CPU / CUDA


class Arithmetic(Enum):
    AUTO = "auto"  # exact: q8 changes answers (backends/arithmetic.py)
    Q8 = "q8"  # activations as 8-bit codes, a scale per 8, integer dot products (backends/arithmetic.py)
    EXACT = "exact"  # float32 multiply-adds over the stored codes: the source checkpoint's values


class TorchDtype(Enum):
    FLOAT32 = "float32"  # exact
    BFLOAT16 = "bfloat16"  # torch's fast int4 kernel; approximate


def default_cache_dir() -> str:
    return os.environ.get("MLX_FLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mlx_flash")


@dataclass
class EngineConfig:
    backend: Backend = option(
        Backend.AUTO,
        "compute backend: auto (the default: MLX on Apple silicon; elsewhere torch "
        "when it is installed, CUDA when present, else MLX on the CPU), mlx (Metal on a Mac, "
        "CPU elsewhere) or torch (CPU / CUDA)",
    )
    ffn: FFNMode = option(
        FFNMode.AUTO,
        "FFN weights: auto (the default: resident when the model fits the memory "
        "budget, else exact streaming: a hybrid sparse FFN whose resident share is what fits, "
        "the rest read every token; MoE: streamed experts), resident (in memory), stream (read "
        "from the bundle file every layer; MoE: experts read when routed into a cache) or sparse "
        "(LLM in a flash: only the rows each token needs)",
    )
    memory_budget: str | float = option(
        "auto",
        "the cap on this process's peak RSS, everything included (runtime, "
        "weights, caches, KV cache, buffers): auto (all the memory available to the "
        "process, its cgroup limit or else the machine's available memory, less 5% "
        "(at least 64 MB)), a share of that available memory (60%) or bytes (2GB, "
        "1.5GiB). A budget that cannot hold the model's minimum is refused, naming it",
    )
    weights_budget: str | float | None = option(
        None,
        "what weights, predictors, read buffers and FFN row / "
        "expert caches may hold, as a share of the fully resident model's "
        "bytes (50%) or bytes; default: all that --memory-budget leaves "
        "after the runtime, KV cache and buffers (more than that is refused)",
        kind=str,
    )
    context: int = option(
        0,
        "tokens the KV cache is planned for (0: the model's context, or as many as 10% of "
        "the memory budget holds, at least 128); longer conversations are refused, naming it",
    )
    kv_on_flash: bool = option(
        True,
        "when the memory budget's KV share holds fewer tokens than the context, keep a window of recent "
        "tokens resident and the older ones on flash, read back layer by layer (exact: the same tokens); "
        "off: the context is what memory holds. CPU backends only",
        flag="--kv-on-flash",
    )
    kv_flash_bits: int = option(
        0,
        "the tokens KV tiers keep on flash at 8, 4 or 2 bits (an approximation: fewer bytes read per "
        "token of a long context; keys per channel over blocks of 64 tokens, values per token in groups "
        "of 32 channels); 0 (the default): exact float32",
    )
    precision: str = option(
        "auto",
        "FFN precision when converting a GGUF/HF source: source (the source's bytes, "
        "lossless; a quantized down projection makes a bundle a block of neurons), "
        "source-neuron (down re-quantized to 8 bits so each neuron is its own read unit), f16, "
        "q4, q8, or auto (the default: source-neuron for a sparse FFN whose predictor selects "
        "neurons approximately, where blocks would read far more for the same quality; source "
        "otherwise)",
    )
    threads: int | None = option(
        None,
        "CPU threads (1-256) of the quantized-matmul kernel (both backends on a "
        "CPU; torch's own ops then run on one) or of torch on CUDA (default: the CPUs this "
        "process may use)",
        kind=int,
    )
    device: str | None = option(None, "backend device: cpu or gpu (mlx), cpu or cuda (torch)", kind=str)
    arithmetic: Arithmetic = option(
        Arithmetic.AUTO,
        "what the quantized products compute: exact (float32 activations times the stored weights, "
        "float32 sums: the checkpoint's values), q8 (each row of activations quantized to 8-bit codes, a "
        "scale per 8, multiplied as integers, as llama.cpp does: faster on an AVX-512 CPU; its quality "
        "cost, measured in docs/results/arithmetic.md, is about llama.cpp's: greedy answers differ from "
        "exact's) or auto (the default: exact)",
    )
    torch_dtype: TorchDtype = option(
        TorchDtype.FLOAT32, "torch linears: float32 (exact) or bfloat16 (torch's fast int4 kernel; approximate)"
    )
    sparsity: float = option(
        0.0,
        "share of every product's inputs treated as zero in decode steps (TEAL activation sparsity): "
        "inputs at or below a threshold per layer and input, measured once by python -m mlx_flash.sparsify "
        "on calibration text, are skipped, their weights neither read nor multiplied. Faster decode at a "
        "quality cost measured in docs/results/sparsity.md; 0 (the default): dense",
        kind=float,
    )
    sparsity_rows: SparsityRows = option(
        SparsityRows.DECODE,
        "rows the sparsity thresholds apply to: decode (the default: one-row steps; prompts and batches "
        "run dense) or all (every row, as the quality figures score a text)",
    )
    prefill_chunk: int = option(512, "prompt tokens per forward pass during prefill")
    verify_checksums: bool = option(
        False,
        "hash every store file again when opening it (otherwise each file is "
        "hashed once and stamped, and hashed again only when it changed)",
        flag="--verify",
    )
    cache_dir: str = option(
        "",
        "where converted stores, the disk profile and a long context's older KV (KV tiers, in its kv folder) "
        "live (default: $MLX_FLASH_CACHE or ~/.cache/mlx_flash)",
    )
    flash: FlashOptions = option(None, "LLM-in-a-flash options", kind=FlashOptions, factory=FlashOptions)
    experts: ExpertOptions = option(None, "expert-cache options", kind=ExpertOptions, factory=ExpertOptions)
    io: IOOptions = option(None, "read options", kind=IOOptions, factory=IOOptions)

    def __post_init__(self):
        _check_enums(self)
        self.flash = _group(self.flash, FlashOptions, "flash")
        self.experts = _group(self.experts, ExpertOptions, "experts")
        self.io = _group(self.io, IOOptions, "io")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1 (got {self.prefill_chunk})")
        if self.context < 0:
            raise ConfigError(f"context must be >= 0 (got {self.context})")
        if self.kv_flash_bits not in (0, 8, 4, 2):
            raise ConfigError(f"kv_flash_bits must be 0 (exact), 8, 4 or 2 (got {self.kv_flash_bits})")
        check_threads("threads", self.threads)
        if not 0.0 <= self.sparsity <= MAX_SPARSITY:
            raise ConfigError(f"sparsity must be in [0, {MAX_SPARSITY}] (got {self.sparsity:g})")
        if self.precision != "auto" and self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is unknown (choose one of: auto, {', '.join(PRECISIONS)})")
        # A directory given is checked for writing too; the default one only for its shape: a load that
        # writes nothing there (a store directory, resident) must not fail on a read-only home.
        self.cache_dir = self.cache_dir or default_cache_dir()
        check_cache_dir(self.cache_dir, writable=self.cache_dir != default_cache_dir())

    def store_precision(self) -> str:
        """The precision a GGUF/HF source is converted at for this configuration ("auto" resolved)."""
        if self.precision != "auto":
            return self.precision
        approximate = (
            self.ffn is FFNMode.SPARSE
            and self.flash.mode.needs_predictor
            and self.flash.predictor not in (PredictorKind.DENSE, PredictorKind.STATISTICAL)
        )
        return "source-neuron" if approximate else "source"


def check_cache_dir(path: str, writable: bool) -> None:
    """Refuse `path` unless it is, or can be made, a directory (that this user may write in, with
    `writable`): stores, stamps and the disk profile are written there long after load() starts,
    where an OSError would name no option."""
    if "\0" in path:
        raise ConfigError(f"cache_dir {path!r} holds a NUL character")
    if os.path.lexists(path) and not os.path.isdir(path):  # a broken link included
        raise ConfigError(f"cache_dir {path!r} is not a directory (a file or a broken link)")
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):  # the nearest existing ancestor is where mkdir would start
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"cache_dir {path!r} cannot be made: {existing!r} is not a directory")
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cache_dir {path!r} is not writable ({existing!r} denies this user)")


def _group(value, cls, name: str):
    """An option group as given, or its defaults for None."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ConfigError(f"{name} must be a mlx_flash.{cls.__name__} (got {type(value).__name__})")
    return value
