"""Check a store: validate its manifest, recompute every listed file's sha256, and say what it holds.

    python -m mlx_flash.verify STORE [--no-progress]
    (installed as the console script mlx-flash-verify)

Exit status 0 when the store is sound; otherwise 1 and one line `error: ...` naming the file and
what is wrong with it (never a traceback).
"""

import argparse
import json
import os
import sys

from ..errors import FlashError, first_paragraph
from ..store import open_store
from ..store.manifest import MANIFEST_NAME


def describe(store) -> list[str]:
    """What a validated store holds, one line per fact."""
    m = store.manifest
    cfg, ffn = m.config, m.ffn
    lines = [
        f"store {store.path}: {cfg.get('model_type')}, {len(ffn.layer_offsets)} layers, d_model {ffn.d_model}, "
        f"vocab {cfg.get('vocab_size')}"
    ]
    what = (
        f"FFN: {ffn.n_neurons} neurons per layer, bundles of {ffn.block} neuron(s) in {ffn.bundle_bytes} B "
        f"({ffn.precision})"
    )
    if ffn.n_experts:
        what += f"; {ffn.n_experts} experts of {ffn.expert_neurons} neurons, top-{cfg.get('num_experts_per_tok')}"
    lines.append(what)
    lines.append(f"resident tensors: {len(m.tensors)}, {sum(t.nbytes for t in m.tensors.values()) / 1e6:.1f} MB")
    for name, info in m.files.items():
        lines.append(f"  {name}: {info['size'] / 1e6:.1f} MB, sha256 {info['sha256'][:16]}... matches")
    others = sorted(n for n in os.listdir(store.path) if n not in m.files and n != MANIFEST_NAME)
    if others:
        lines.append("other files (not in the manifest's checksums): " + ", ".join(others))
    if m.source:
        lines.append("source: " + json.dumps(m.source, sort_keys=True))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.verify", description=first_paragraph(__doc__))
    p.add_argument("store", help="a store directory (python -m mlx_flash.convert writes one)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while hashing")
    a = p.parse_args(argv)
    try:
        store = open_store(a.store, verify_checksums=True, progress=not a.no_progress)
        lines = describe(store)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or a.store}: {e.strerror or e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        # Validation reads the manifest's structure as it checks it: one it cannot read is a bad store.
        print(
            f"error: {os.path.join(a.store, MANIFEST_NAME)}: the manifest is malformed ({type(e).__name__}: {e})",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print("\n".join(lines))
    print("ok: every file matches its manifest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
