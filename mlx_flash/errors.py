"""Typed errors. Each message is one line naming the thing (file, tensor, option) and what is wrong.

The CLIs print `error: <message>` and exit non-zero for any FlashError; anything else is a bug and
keeps its traceback.
"""

import sys


class FlashError(Exception):
    """Base class for every user-facing error raised by mlx_flash."""


class ModelNotFoundError(FlashError):
    """A model path, store or the default model package does not exist."""


class UnsupportedModelError(FlashError):
    """The architecture (model_type) or a feature of it is not implemented."""


class ModelFileError(FlashError):
    """A source checkpoint (GGUF, safetensors, config.json) is unreadable, truncated or inconsistent."""


class StoreError(FlashError):
    """A converted store fails validation (manifest, sizes, offsets, checksums)."""


class KernelUnavailableError(FlashError):
    """A compiled kernel library is missing or cannot be loaded (the install did not build it)."""


class ConfigError(FlashError):
    """An option has a bad value (backend name, sampling parameter, budget...)."""


class ContextNotFoundError(FlashError):
    """A service call names a context id that this service (for this API key) does not hold."""


class ContextLengthError(ConfigError):
    """A prompt (with what a context already holds) longer than the model's context or the KV that
    holds it."""


class MemoryBudgetError(ConfigError):
    """A memory limit this model cannot run under, refused before anything is read; the message
    names the minimum (or what the limit lacks)."""


class DiskError(FlashError):
    """A file the engine writes or reads could not be: a full or read-only disk, an I/O error, a file
    where a folder should be. The machine's fault, not the request's: a server answers it 5xx (507
    where `full`: the disk or quota has no room left)."""

    def __init__(self, message: str, full: bool = False):
        super().__init__(message)
        self.full = full


class PipelineFault(FlashError):
    """A rank of a model split across ranks died or stalled: the pipeline cannot go on."""


def exit_status(body) -> int:
    """Run a command-line tool's body: 0 when it returns, 1 with one `error: ...` line on stderr
    (and no traceback) when it raises a FlashError."""
    try:
        body()
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def first_paragraph(doc: str) -> str:
    """A command's --help description: its module docstring up to the first blank line, on one line
    (the first line alone cuts most sentences in half)."""
    return " ".join(doc.strip().split("\n\n")[0].split())
