"""Train the sparsity predictors of a store (LLM in a flash §3.1) and save them into it.

    python tools/train_predictor.py [--model PATH] [--precision auto] [--sparsity 0.5] [--rank 64]
                                    [--recall 0.9] [--calib-tokens 16384] [--epochs 10] [--activity-only]

Activations come from the real model (torch backend, exact) over the Austen text; per-layer recall and
precision are reported on the Wikipedia text (tools/fetch_data.py fetches both).
"""

import argparse
import json
import sys

import mlx_flash
from mlx_flash.calibrate import measure_activity, read_corpus, summarize, train_predictors
from mlx_flash.errors import exit_status, first_paragraph
from mlx_flash.sparse.predictor import Predictors


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="store dir, GGUF or HF dir (default: the default model)")
    p.add_argument(
        "--precision",
        default="auto",
        help="FFN precision of the store to train for, when --model is a GGUF/HF source (default auto: "
        "the store load() picks for a sparse FFN with a predictor, source-neuron)",
    )
    p.add_argument("--sparsity", type=float, default=0.5, help="target fraction of inactive neurons (default 0.5)")
    p.add_argument("--rank", type=int, default=64, help="starting predictor rank (default 64)")
    p.add_argument("--max-rank", type=int, default=256)
    p.add_argument("--recall", type=float, default=0.9, help="recall the cut is set for (default 0.9)")
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--valid-tokens", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument(
        "--activity-only",
        action="store_true",
        help="keep the store's trained predictors; only (re)measure the window activity the planner uses",
    )
    return exit_status(lambda: run(p.parse_args()))


def run(a) -> None:
    texts = {name: read_corpus(name) for name in ("austen", "wikipedia")}
    precision = mlx_flash.EngineConfig(ffn="sparse", precision=a.precision).store_precision()
    with mlx_flash.load(a.model, backend="torch", precision=precision, progress=True) as eng:
        calib = eng.tokenizer.encode(texts["austen"][: a.calib_tokens * 8])
        valid = eng.tokenizer.encode(texts["wikipedia"][: a.valid_tokens * 8])
        if a.activity_only:
            lay = eng.store.manifest.ffn
            preds = Predictors.load(eng.store.path, len(lay.layer_offsets), lay.d_model, lay.n_neurons)
            preds.activity = measure_activity(eng, preds, valid, a.valid_tokens, progress=True)
            preds.save(eng.store.path)
            print(json.dumps({"store": eng.store.path, "window_activity": preds.activity}, indent=1))
            return
        preds = train_predictors(
            eng,
            calib,
            valid,
            a.sparsity,
            a.rank,
            a.max_rank,
            a.recall,
            a.calib_tokens,
            a.valid_tokens,
            a.epochs,
            progress=True,
        )
        preds.trained_on = f"austen[:{a.calib_tokens} tokens]"
        preds.save(eng.store.path)
        print(json.dumps({"store": eng.store.path, **summarize(preds.metrics)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
