"""Perplexity of a model or store on a text file.

python -m mlx_flash.bench perplexity [--model PATH] [--backend mlx|torch] [--text FILE | --corpus wikipedia]
                                     [--ffn resident|stream|sparse] [--predictor-recall R]
                                     [--score-window 512] [--tokens 4096] [--kv-bits 4] [--attention-keep 0.1]
                                     [--memory-budget 420MB --kv-flash-bits 4] [--json OUT]

With a memory budget whose KV share holds fewer tokens than a window, each window runs with KV tiers
(its older tokens on flash, at --kv-flash-bits bits when given): the line says so.
"""

import argparse
import os
import sys

from mlx_flash.api import load_config
from mlx_flash.config import EngineConfig
from mlx_flash.calibrate import corpus_path, perplexity
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.options import add_arguments, from_arguments
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench perplexity", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="store dir, GGUF or HF dir (default: the default model)")
    add_arguments(p, EngineConfig)  # the engine's options, as the chat has them
    p.set_defaults(**{"EngineConfig.weights_budget": "200%"})  # quality only: the whole model fits, with its buffers
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, help="a UTF-8 text file")
    src.add_argument(
        "--corpus",
        default="wikipedia",
        choices=("wikipedia", "austen"),
        help="a fetched corpus (tools/fetch_data.py); default: wikipedia",
    )
    p.add_argument(
        "--score-window",
        dest="window",
        type=int,
        default=512,
        help="tokens per window, each scored from an empty cache (default 512; --context is the engine's KV plan)",
    )
    p.add_argument("--tokens", type=int, default=4096, help="score the first N tokens (default 4096)")
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(0, 4),
        default=0,
        help="hold the KV cache at 4 bits, as the throughput mode's kv_bits policy does (default 0: exact)",
    )
    p.add_argument(
        "--attention-keep",
        type=float,
        default=1.0,
        help="top-k sparse attention: each query attends to this share of its keys, as the throughput "
        "mode's attention_keep policy does (default 1.0: exact)",
    )
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    a = p.parse_args(argv)
    try:
        path = a.text or corpus_path(a.corpus)
        if not os.path.isfile(path):
            raise FlashError(f"{path}: no such text file")
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        cfg = from_arguments(EngineConfig, a)
        engine = load_config(a.model, cfg)
        if not 0.0 < a.attention_keep <= 1.0:
            raise FlashError(f"--attention-keep must be in (0, 1] (got {a.attention_keep})")
        r = perplexity(
            engine, text, a.window, a.tokens, progress=True, kv_bits=a.kv_bits, attention_keep=a.attention_keep
        )
    except (FlashError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if cfg.ffn.value == "sparse":
        f = cfg.flash
        r.update(
            sparse_mode=f.mode.value, predictor=f.predictor.value, predictor_recall=f.recall, down_only=f.down_only
        )
    tiers = engine.kv_tiers if engine.kv_tiers is not None and a.window > engine.kv_tiers.resident else None
    r.update(
        kv_tiers=None if tiers is None else {"resident": tiers.resident, "context": tiers.context},
        kv_flash_bits=cfg.kv_flash_bits if tiers is not None else 0,
        backend=cfg.backend.value,
        torch_dtype=cfg.torch_dtype.value,
        ffn=cfg.ffn.value,
        text=os.path.basename(path),
        store=engine.store.path,
        precision=engine.store.manifest.ffn.precision,
    )
    print(
        f"perplexity {r['perplexity']:.4f} over {r['scored']} tokens (context {a.window}, {cfg.backend.value}"
        f"{', KV at 4 bits' if a.kv_bits else ''}"
        f"{f', KV tiers: {tiers.resident} tokens resident' if tiers is not None else ''}"
        f"{f', the rest on flash at {cfg.kv_flash_bits} bits' if tiers is not None and cfg.kv_flash_bits else ''}"
        f"{f', top {a.attention_keep:g} of keys' if a.attention_keep < 1 else ''})"
    )
    if a.json:
        write_json(a.json, r, OutputError, indent=1)
    return 0
