"""Record a MoE model's routing paths and build its next-layer expert predictor (EdgeMoE §6).

    python tools/trace_experts.py [--model PATH] [--calib-tokens 16384] [--valid-tokens 4096] [--out FILE]

Routes the Austen text (calibration) and the Wikipedia text (validation) through the fully resident
model, fits P(expert at layer l | experts at l-1, l-2) on the first, reports on the second how many
of each token's experts the top-K prediction names, and saves the predictor into the store (where
`load(..., ffn="stream")` finds it and preloads) and the validation trace as <store>/routes-wikipedia.npy
(the access trace the cache-policy table replays: python -m mlx_flash.bench experts --policies).
"""

import argparse
import os
import sys

import numpy as np

import mlx_flash
from mlx_flash.calibrate import fit_routing_predictor, read_corpus, record_routes, routing_accuracy
from mlx_flash.errors import FlashError, exit_status, first_paragraph


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--model", required=True, help="a MoE model: store dir or HF dir (e.g. tools/moefy.py's output)")
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--valid-tokens", type=int, default=4096)
    p.add_argument("--out", default=None, help="predictor file (default: <store>/routing_predictor.npz)")
    return exit_status(lambda: run(p.parse_args()))


def run(a) -> None:
    from mlx_flash.moe.routing import PREDICTOR_FILE, model_id

    with mlx_flash.load(a.model, backend="torch", ffn="resident") as eng:
        lay = eng.store.manifest.ffn
        if not lay.n_experts:
            raise FlashError(f"{a.model}: not a mixture-of-experts model")
        calib = record_routes(
            eng, eng.tokenizer.encode(read_corpus("austen")[: a.calib_tokens * 8])[: a.calib_tokens], progress=True
        )
        valid = record_routes(
            eng, eng.tokenizer.encode(read_corpus("wikipedia")[: a.valid_tokens * 8])[: a.valid_tokens], progress=True
        )
        pred = fit_routing_predictor(calib, model_id(eng.store), lay.n_experts)
        out = a.out or os.path.join(eng.store.path, PREDICTOR_FILE)
        pred.save(out)
        np.save(os.path.join(eng.store.path, "routes-wikipedia.npy"), valid)
        K, E = valid.shape[2], lay.n_experts
        print(f"routing of {calib.shape[1]} calibration and {valid.shape[1]} validation tokens, {E} experts, top-{K}")
        for n in sorted({max(1, K // 2), K}):
            acc = routing_accuracy(pred, valid, n)
            print(
                f"predicting {n} experts per layer: {acc['accuracy']:.1%} of the routed experts named "
                f"(chance {n / E:.1%}); per layer " + " ".join(f"{x:.2f}" for x in acc["per_layer"][1:])
            )
        print(f"predictor saved to {out}")


if __name__ == "__main__":
    sys.exit(main())
