"""The sparse read unit's cost: perplexity against MB read per token for a neuron (the
"source-neuron" store: down re-quantized to 8 bits along d_model) and for a block of neurons (the
default "source" store: the source's bytes, one quantization group of neurons per bundle), each
keeping the same share of its units per token and layer by exact activation mass (an oracle
selector, calibrate.read_unit), so the two differ only in the unit.

    python -m mlx_flash.bench read-unit [--model GGUF] [--shares 0.25,0.5,0.75,1] [--tokens 4096]
                                        [--json OUT] [--plot OUT.png]

Perplexity on the Wikipedia text (tools/fetch_data.py), context 512, torch backend.
"""

import argparse

import mlx_flash
from mlx_flash.calibrate import OracleUnits, perplexity, read_corpus
from mlx_flash.errors import FlashError, exit_status, first_paragraph
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench read-unit", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="a GGUF or quantized HF source (default: the default model)")
    p.add_argument("--shares", default="0.25,0.5,0.75,1", help="shares of read units kept (default 0.25,0.5,0.75,1)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens scored (default 4096)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--plot", default=None, help="also plot perplexity against MB/token into this PNG")
    return exit_status(lambda: run(p.parse_args(argv)))


def run(a) -> None:
    try:
        shares = [float(s) for s in a.shares.split(",")]
    except ValueError:
        raise FlashError(f"--shares {a.shares!r} is not a comma-separated list of numbers") from None
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise FlashError(f"--shares {a.shares!r}: every share must be in (0, 1]")
    wiki = read_corpus("wikipedia")
    rows = []
    for precision in ("source", "source-neuron"):
        with mlx_flash.load(a.model, backend="torch", precision=precision) as eng:
            lay, dense = eng.store.manifest.ffn, eng.ffn
            for share in shares:
                eng.ffn = OracleUnits(dense, eng.ops, eng.module, eng.args, lay.block, share)
                ppl = perplexity(eng, wiki, 512, a.tokens, progress=True)["perplexity"]
                units = eng.ffn.units_kept(lay.n_rows)
                mb = units * lay.bundle_bytes * len(lay.layer_offsets) / 1e6
                rows.append(
                    {
                        "unit": "block" if lay.block > 1 else "neuron",
                        "precision": precision,
                        "neurons_per_unit": lay.block,
                        "share": share,
                        "units_per_layer": units,
                        "mb_per_token": mb,
                        "perplexity": ppl,
                    }
                )
            eng.ffn = dense
    print(f"\n{'unit':<8}{'share':>7}{'MB/token':>10}{'perplexity':>12}")
    for r in rows:
        print(f"{r['unit']:<8}{r['share']:>7.2f}{r['mb_per_token']:>10.1f}{r['perplexity']:>12.3f}")
    if a.json:
        write_json(a.json, rows, OutputError, indent=1)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for unit in ("block", "neuron"):
            pts = [(r["mb_per_token"], r["perplexity"]) for r in rows if r["unit"] == unit]
            ax.plot(*zip(*pts), marker="o", label=unit)
        ax.set_xlabel("MB read per token (every layer)")
        ax.set_ylabel("perplexity (Wikipedia)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
