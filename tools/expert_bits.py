"""Expert-wise bit-widths (EdgeMoE §6): profile each expert's importance, pick INT2/4/8 per expert to
meet a perplexity tolerance P at the fewest bytes, write the mixed-precision store, and print the
table of storage and perplexity for float16, all-INT4, all-INT2 and the mix.

    python tools/expert_bits.py --model MOE [--tolerance 0.05] [--importance-tokens 512]
                                [--search-tokens 2048] [--ppl-tokens 4096] [--out DIR]

Importance and the search use the Austen text; the table's perplexities are on Wikipedia (held out).
Writes <store>-int4, <store>-int2 and <store>-mixP<P> next to the model's store (or --out for the mix).
"""

import argparse
import json
import os
import sys

import mlx_flash
from mlx_flash.calibrate import choose_widths, perplexity, read_corpus, write_expert_store
from mlx_flash.errors import FlashError, exit_status, first_paragraph


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--model", required=True, help="a MoE model with float experts (store, or HF dir such as moefy's)")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed perplexity increase (default 0.05)")
    p.add_argument("--importance-tokens", type=int, default=512)
    p.add_argument("--search-tokens", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--out", default=None, help="the mixed store (default: <store>-mixP<P>)")
    return exit_status(lambda: run(p.parse_args()))


def expert_bytes(store) -> int:
    lay = store.manifest.ffn
    return sum(lay.expert_size(i, e) for i in range(len(lay.layer_offsets)) for e in range(lay.n_experts))


def run(a) -> None:
    if not 0 < a.tolerance < 10:
        raise FlashError(f"--tolerance {a.tolerance} is not a fraction such as 0.05")
    austen, wiki = read_corpus("austen"), read_corpus("wikipedia")
    with mlx_flash.load(a.model, backend="torch", ffn="resident") as eng:
        store, lay = eng.store, eng.store.manifest.ffn
        if not lay.n_experts:
            raise FlashError(f"{a.model}: not a mixture-of-experts model")
        L, E = len(lay.layer_offsets), lay.n_experts
        ids = eng.tokenizer.encode(austen[: a.search_tokens * 8])[: a.search_tokens]
        result = choose_widths(eng, ids, a.tolerance, a.importance_tokens, progress=True)
        imp = result.pop("importance")
    base = store.path.rstrip("/")
    tag = f"{a.tolerance:g}".replace(".", "")
    outs = {
        "INT4": write_expert_store(store, base + "-int4", [[4] * E] * L),
        "INT2": write_expert_store(store, base + "-int2", [[2] * E] * L),
        f"mix (P={a.tolerance:.0%})": write_expert_store(store, a.out or f"{base}-mixP{tag}", result["bits"]),
    }
    rows_out = []
    for label, path in [("float16", store.path)] + list(outs.items()):
        with mlx_flash.load(path, backend="torch", ffn="resident", progress=False) as e:
            ppl = perplexity(e, wiki, 512, a.ppl_tokens, progress=True)["perplexity"]
            rows_out.append((label, expert_bytes(e.store), ppl, path))
    counts = {b: sum(r.count(b) for r in result["bits"]) for b in (2, 4, 8, 16)}
    print(
        f"\nexpert bit-widths for P = {a.tolerance:.0%}: low INT{result['low']}, high INT{result['high']}, "
        f"{result['k']} of {L * E} experts low; counts {counts}"
    )
    print("| experts | expert storage | vs float16 | Wikipedia perplexity | change |\n|---|---|---|---|---|")
    for label, nbytes, ppl, _ in rows_out:
        print(
            f"| {label} | {nbytes / 1e6:.1f} MB | {nbytes / rows_out[0][1]:.3f} | {ppl:.3f} | "
            f"{ppl / rows_out[0][2] - 1:+.2%} |"
        )
    with open(os.path.join(outs[f"mix (P={a.tolerance:.0%})"], "expert_bits.json"), "w") as fh:
        json.dump(
            {
                "tolerance": a.tolerance,
                "search": {k: v for k, v in result.items() if k != "bits"},
                "bits": result["bits"],
                "importance": imp.tolist(),
                "table": rows_out,
            },
            fh,
            indent=1,
            default=str,
        )


if __name__ == "__main__":
    sys.exit(main())
