"""Which arithmetic a backend's products run (EngineConfig.arithmetic), decided once at load:

  exact  float32 activations times the stored codes, float32 multiply-adds: the source checkpoint's
         values, what every mode has computed so far
  q8     each row of activations quantized to 8-bit codes with a float scale per 8 inputs, the stored
         codes multiplied by them as integers, the scales applied in float: llama.cpp's kind of
         arithmetic (kernels/cpu/q8.h); the same bits on every CPU path, for any thread count and
         whichever rows come together
  auto   exact. q8 is faster on AVX-512 CPUs (decode and prefill of the default model, a 7B shape;
         AVX2's integer path is not faster than its float one at the default model's shapes), but on
         the models we ship its greedy answers are llama.cpp's kind, not the checkpoint's: the default
         model's continuations of 5 held-out prompts equal transformers' in 2 of 5 (llama.cpp's: 2 of
         5), Gemma 3 270M's in 3 of 5, and the default chat's first answer changes
         (docs/results/arithmetic.md). So q8 is asked for.

Matrices the q8 kernels do not read (neuron-major down columns, 3- and 6-bit codes) run exact either
way (kernels/qmatmul.py q8_reads)"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..kernels.qmatmul import Arith, Isa, cpu_isa

ARITHMETICS = ("auto", "q8", "exact")
WORDS = {
    Arith.EXACT: "exact (float32 multiply-adds over the stored codes)",
    Arith.Q8: "q8 (activations as 8-bit codes, a scale per 8 inputs, integer dot products)",
}
LEVEL_NAMES = {
    Isa.PORTABLE: "the portable loops",
    Isa.AVX2: "AVX2",
    Isa.AVX512: "AVX-512 BW",
    Isa.AVXVNNI: "AVX-VNNI",
    Isa.AVX512_VNNI: "AVX-512 VNNI",
}


@dataclass(frozen=True)
class ArithmeticChoice:
    arith: Arith
    why: str

    def line(self) -> str:
        """One line for the load's output and /stats: what the products compute, and why."""
        return f"{WORDS[self.arith]} ({self.why})"


def choose_arithmetic(asked: str, cpu_kernels: bool, where: str) -> ArithmeticChoice:
    """The arithmetic for `asked` ("auto", "q8" or "exact"); cpu_kernels: the backend's quantized
    products are the CPU kernels; `where`: the backend in words, for the messages."""
    if asked not in ARITHMETICS:
        raise ConfigError(f"arithmetic {asked!r} is unknown (choose one of: {', '.join(ARITHMETICS)})")
    if asked == "exact":
        return ArithmeticChoice(Arith.EXACT, "asked for")
    if not cpu_kernels:
        if asked == "q8":
            raise ConfigError(
                f"arithmetic q8 runs in the CPU kernels; {where} multiplies in floating point (use auto or exact)"
            )
        return ArithmeticChoice(Arith.EXACT, f"auto: {where} multiplies in floating point")
    if asked == "q8":
        return ArithmeticChoice(Arith.Q8, f"asked for; {LEVEL_NAMES[cpu_isa()]} on this CPU")
    if cpu_isa() not in (Isa.AVX512, Isa.AVX512_VNNI):  # measured: q8 gains on AVX-512 only
        return ArithmeticChoice(Arith.EXACT, f"auto: q8 on {LEVEL_NAMES[cpu_isa()]} gains little or loses here")
    return ArithmeticChoice(
        Arith.EXACT, "auto: q8 is faster on this CPU but answers differently; --arithmetic q8 asks for it"
    )
