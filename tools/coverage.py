"""The coverage tables of docs/coverage.md, measured, not written by hand: quantization types (how
each is kept, its stored size against the file's, whether its dequantization equals the gguf
package's, the CPU kernel's error against the plain-ops reference on every instruction-set path this
CPU runs, and its decode speed) and model families (the tests that check each against transformers, per
backend, and their outcome on this run). Real files' decode speed against llama.cpp is a benchmark's:
docs/results/backends.md (python -m mlx_flash.bench results).

    python tools/coverage.py [--families] [--write docs/coverage.md] [--json OUT]

Without --write the tables go to stdout; with it they replace what lies between the
`<!-- coverage:begin -->` and `<!-- coverage:end -->` markers of the file it names (docs/coverage.md).
--families runs the family tests (pytest, about 3 minutes).
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import numpy as np

from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.quant_spec import BLOCKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
# type -> how the store keeps it, stored bytes per 32 weights, file bytes per 32 weights
AFFINE = {"Q8_0": (8, 36, 34), "Q4_0": (4, 20, 18), "Q4_1": (4, 20, 20)}
FLOATS = {"F32": 128, "F16": 64, "BF16": 64}
# test file, or file::test-name prefix -> (what it checks, the family a test id names: a regex on the
# id or a fixed family)
FAMILY_TESTS = {
    "tests/models/test_tiny_families.py": (
        "tiny random model vs transformers, resident and streamed FFN",
        r"(llama|mistral|qwen2|qwen3|opt)-",
    ),
    "tests/models/test_gemma3.py": ("tiny random model vs transformers (sliding and full layers)", "gemma3_text"),
    "tests/moe/test_moe_models.py": ("tiny random MoE vs transformers", r"(mixtral|qwen2_moe|qwen3_moe|olmoe)"),
    "tests/models/test_rope_scaling.py": (
        "RoPE llama3 / yarn vs transformers past the original context",
        r"(llama3|yarn)",
    ),
    "tests/convert/test_gguf_kquants.py::test_logits_equal_transformers": (
        "tiny Gemma 3 Q4_K_M-style GGUF vs transformers on the same file",
        "gemma3 GGUF",
    ),
    "tests/convert/test_gguf_kquants.py::test_sparse_modes_on_block_types": (
        "tiny Gemma 3 Q4_K_M-style GGUF: every exact sparse FFN mode = resident",
        "gemma3 GGUF, sparse FFN",
    ),
    "tests/sparse/test_sparse_geglu.py::test_all_active": (
        "tiny random model, q8: sparse kernel (GeGLU) = resident",
        "gemma3_text, sparse FFN",
    ),
    "tests/moe/test_block_experts.py::test_streamed": (
        "tiny Qwen3-MoE Q4_K_M GGUF: k-quant experts streamed = resident, within float16 of dequantized",
        "qwen3_moe GGUF",
    ),
    "tests/convert/test_gguf_rope_freqs.py": ("Llama 3.x GGUF rope_freqs vs transformers", "llama3 GGUF"),
    "tests/models/test_smollm2_vs_transformers.py": (
        "real SmolLM2-135M Q4_1: 32 greedy tokens = transformers",
        "llama (real file)",
    ),
    "tests/models/test_gemma3_real_file.py": (
        "real Gemma 3 270M Q4_K_M: 32 greedy tokens = transformers",
        "gemma3 (real file)",
    ),
}


# what a test id names, where it is not a family: the RoPE scalings
LABELS = {"llama3": "llama, RoPE llama3", "yarn": "llama / qwen2, RoPE yarn"}


def _median_seconds(fn, runs: int = 15, inner: int = 10, warm: float = 0.5) -> float:
    """The median time of one call over `runs` runs, after `warm` seconds of calls (the first
    tenths of a second after a new matrix measured up to 3x slower on this machine)."""
    t = time.perf_counter()
    while time.perf_counter() - t < warm:
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return sorted(times)[len(times) // 2]


def quant_rows(threads: int) -> list[dict]:
    """One row per quantization type, every number measured here."""
    import gguf

    from mlx_flash.convert.gguf_blocks import BLOCK_TYPES, decode_blocks
    from mlx_flash.convert.gguf_quantize import quantize_k
    from mlx_flash.kernels.blockmatmul import BlockMatrix
    from mlx_flash.kernels.gguf_blocks_ref import block_matmul_ref, dequantize
    from mlx_flash.kernels.qmatmul import Isa, StoredMatrix, cpu_isa, use_isa
    from mlx_flash.kernels.qmatmul_ref import dequantize as affine_dequantize

    rng = np.random.default_rng(0)
    rows, cols = 256, 2048
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    x2048 = rng.standard_normal((1, 2048)).astype(np.float32)
    paths = [isa for isa in Isa if isa <= cpu_isa()]
    before, out = cpu_isa(), []

    def worst(m, ref):  # the largest error over every instruction-set path this CPU runs
        errs = []
        for isa in paths:
            use_isa(isa)
            errs.append(_rel(m(x, threads), ref))
        use_isa(before)
        return max(errs)

    try:
        for name, bits_stored_file in AFFINE.items():
            qtype = gguf.GGMLQuantizationType[name]
            raw = gguf.quants.quantize(w, qtype)
            want = gguf.quants.dequantize(raw, qtype)
            bt = next(b for b in BLOCK_TYPES.values() if b.name == name)
            t = decode_blocks(bt, raw, cols)
            got = affine_dequantize(t["weight"], t["scales"], t["biases"], bt.bits, 32)
            m = StoredMatrix(t["weight"], t["scales"], t["biases"], bt.bits, 32)
            ref = x.astype(np.float64) @ want.astype(np.float64).T
            err = worst(m, ref)
            big = _big_affine(rng, bt, gguf)
            out.append(
                {
                    "type": name,
                    "kept": f"affine {bt.bits}-bit triple (exact re-expression)",
                    "size": bits_stored_file[1] / bits_stored_file[2],
                    "kernel": "CPU qmatmul",
                    "equal": _equality(got.astype(np.float32), want),
                    "error": err,
                    "gws": 2048 * 2048 / _median_seconds(lambda: big(x2048, threads)) / 1e9,
                }
            )
        for name, blk in BLOCKS.items():
            qtype = gguf.GGMLQuantizationType[name]
            raw = gguf.quants.quantize(w, qtype) if name in ("Q5_0", "Q5_1") else quantize_k(w, name)
            want = gguf.quants.dequantize(raw, qtype)
            m = BlockMatrix(raw, name)
            ref = block_matmul_ref(x, raw, name)
            err = worst(m, ref)
            big = BlockMatrix(np.tile(raw, (8, 1)), name)
            out.append(
                {
                    "type": name,
                    "kept": "GGUF blocks, as stored",
                    "size": 1.0,
                    "kernel": "CPU block kernel",
                    "equal": _equality(dequantize(raw, name), want),
                    "error": err,
                    "gws": 2048 * 2048 / _median_seconds(lambda: big(x2048, threads)) / 1e9,
                }
            )
    finally:
        use_isa(before)
    for name, file_bytes in FLOATS.items():
        out.append(
            {
                "type": name,
                "kept": "float rows, as stored",
                "size": 1.0,
                "kernel": "backend matmul",
                "equal": "bit for bit",
                "error": 0.0,
                "gws": None,
            }
        )
    return out


def _big_affine(rng, bt, gguf):
    """A 2048 x 2048 matrix of this affine type for the speed column."""
    from mlx_flash.convert.gguf_blocks import decode_blocks
    from mlx_flash.kernels.qmatmul import StoredMatrix

    raw = gguf.quants.quantize(
        (rng.standard_normal((2048, 2048)) * 0.05).astype(np.float32), gguf.GGMLQuantizationType[bt.name]
    )
    t = decode_blocks(bt, raw, 2048)
    return StoredMatrix(t["weight"], t["scales"], t["biases"], bt.bits, 32)


def _equality(got: np.ndarray, want: np.ndarray) -> str:
    if np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        return "bit for bit"
    if np.array_equal(got, want):  # -0.0 == 0.0: an affine triple's q*d - 8d is +0 where gguf's d*(q-8) is -0
        return "equal values (a zero's sign differs)"
    return "NO"


def _rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def family_rows() -> list[dict]:
    """Runs the family tests once (pytest, a JUnit report) and reports each family x backend."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        files = sorted({f.split("::")[0] for f in FAMILY_TESTS if os.path.exists(os.path.join(ROOT, f.split("::")[0]))})
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not os.path.exists(report):
            raise FlashError("the family tests wrote no report (pytest did not run)")
        cases = ET.parse(report).getroot().iter("testcase")
        rows: dict[tuple, dict] = {}
        for c in cases:
            path = c.get("classname", "").replace(".", "/") + ".py"
            name = c.get("name", "")
            key = next(
                (
                    k
                    for k in FAMILY_TESTS
                    if k == path or (k.startswith(path + "::") and name.startswith(k.split("::")[1]))
                ),
                None,
            )
            if key is None:
                continue
            how, fam = FAMILY_TESTS[key]
            found = re.search(fam, name) if fam.startswith("(") else None
            family = found.group(1) if found else (None if fam.startswith("(") else fam)
            family = LABELS.get(family, family)
            if family is None:
                continue
            backend = "mlx" if "mlx" in name else "torch" if "torch" in name else "both"
            outcome = (
                "failed"
                if c.find("failure") is not None or c.find("error") is not None
                else "skipped"
                if c.find("skipped") is not None
                else "passed"
            )
            row = rows.setdefault((family, how), {"family": family, "how": how, "mlx": [], "torch": []})
            for b in ("mlx", "torch") if backend == "both" else (backend,):
                row[b].append(outcome)
    return list(rows.values())


def markdown(quants, families, threads: int) -> str:
    from mlx_flash.kernels.qmatmul import cpu_isa

    lines = [
        f"*Generated by `python tools/coverage.py` on {datetime.date.today()}: {platform.machine()}, "
        f"{os.cpu_count()} cores, kernel path {cpu_isa().name}, {threads} threads.*",
        "",
        "| type | kept as | stored / file bytes | CPU kernel | dequantization = gguf's | kernel vs reference "
        "(max rel. error, every path) | decode Gw/s (2048x2048) |",
        "|---|---|---|---|---|---|---|",
    ]
    for q in quants:
        gws = f"{q['gws']:.1f}" if q["gws"] else "-"
        lines.append(
            f"| {q['type']} | {q['kept']} | {q['size']:.3f} | {q['kernel']} | {q['equal']} | {q['error']:.1e} | {gws} |"
        )
    if families:
        lines += ["", "| family | checked how | mlx | torch |", "|---|---|---|---|"]
        for f in sorted(families, key=lambda r: r["family"]):
            cell = {b: _outcome(f[b]) for b in ("mlx", "torch")}
            lines.append(f"| {f['family']} | {f['how']} | {cell['mlx']} | {cell['torch']} |")
    return "\n".join(lines)


def _outcome(results: list[str]) -> str:
    if not results:
        return "-"
    if "failed" in results:
        return f"FAILED ({results.count('failed')} of {len(results)})"
    if all(r == "skipped" for r in results):
        return "skipped"
    n = results.count("passed")
    return f"exact ({n} test{'s' if n != 1 else ''} passed)"


def write_between_markers(path: str, text: str) -> None:
    with open(path, encoding="utf-8") as fh:
        doc = fh.read()
    if BEGIN not in doc or END not in doc:
        raise FlashError(f"{path}: has no {BEGIN} ... {END} markers to write the tables between")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--families", action="store_true", help="run the family tests for the families table")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--write",
        metavar="FILE",
        help="replace the tables between the coverage markers in this file (docs/coverage.md)",
    )
    p.add_argument("--json", metavar="OUT", help="also write every number as JSON")
    a = p.parse_args()
    try:
        quants = quant_rows(a.threads)
        families = family_rows() if a.families else []
        text = markdown(quants, families, a.threads)
        if a.write:
            write_between_markers(a.write, text)
            print(f"wrote the coverage tables into {a.write}")
        else:
            print(text)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"quants": quants, "families": families}, fh, indent=1)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
