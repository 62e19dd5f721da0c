"""Convert a GGUF file, an HF model directory or an mlx-community quantized directory into a store.

    python -m mlx_flash.convert SOURCE OUT_DIR [--precision source|source-neuron|f16|q4|q8] [--down-bits 8] [--force]
    (installed as the console script mlx-flash-convert)

The store holds a manifest, resident tensors (safetensors), FFN row-column bundles and the tokenizer.
"""

import argparse
import sys

from ..errors import FlashError, first_paragraph
from ..store import open_store
from ..convert.converter import PRECISIONS, convert
from ..locate.hub import resolve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.convert", description=first_paragraph(__doc__))
    p.add_argument("source", help="GGUF file, HF model dir or mlx-community dir, or a hub name (org/name[:QUANT])")
    p.add_argument("out", help="store directory to create")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="source",
        help="FFN bundle precision (default: source = the source's bytes, lossless; source-neuron: down "
        "re-quantized along d_model so each neuron is its own read unit, lossy)",
    )
    p.add_argument(
        "--down-bits", type=int, default=8, help="source-neuron: bits of the re-quantized down projection (default 8)"
    )
    p.add_argument("--group-size", type=int, default=32, help="group size for --precision q4/q8 (default 32)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    a = p.parse_args(argv)
    try:
        out = convert(
            resolve(a.source),
            a.out,
            precision=a.precision,
            group_size=a.group_size,
            down_bits=a.down_bits,
            force=a.force,
        )
        m = open_store(out, verify_checksums=True, progress=True).manifest
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    total = sum(f["size"] for f in m.files.values())
    print(
        f"store {out}: {m.config['model_type']}, {m.config['num_hidden_layers']} layers, "
        f"FFN bundles {m.ffn.bundle_bytes} B x {m.ffn.n_rows}/layer of {m.ffn.block} neuron(s) "
        f"({m.ffn.precision}), "
        f"{total / 1e6:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
