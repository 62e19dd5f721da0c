"""`python -m mlx_flash.serve`: an OpenAI-compatible server holding many chat contexts (LLMS).

Serves /v1/chat/completions, /v1/completions, /v1/models, /v1/contexts, /v1/stats and /health on
127.0.0.1:8080 by default. Contexts keep their KV between requests (in chunks, swapped to the
service directory under memory pressure; the directory is the server's state across restarts).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..budget import parse_budget
from ..config import EngineConfig
from .pipeline_flags import add_pipeline_arguments
from ..distributed.launch import load_for
from ..distributed.serving import conversations_for, model_store_path, server_for
from ..default_model import MODEL_HELP
from ..errors import ConfigError, FlashError, first_paragraph
from ..options import add_arguments, from_arguments
from ..sampling import check_int
from ..service.compression import Compression
from ..service.quota import KeyQuota
from ..service.server import ServerOptions

MAX_CONTEXTS = 1024  # contexts the server keeps (the least recently used idle one goes beyond)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.serve", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help=MODEL_HELP)
    add_arguments(p, EngineConfig)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept this key (Authorization: Bearer KEY); repeat for several; contexts are private "
        "to the key that made them, and several keys split the contexts, the KV budget and the queue "
        "equally (no key's use evicts or starves another's). Also read from MLX_FLASH_API_KEYS "
        "(comma-separated)",
    )
    p.add_argument(
        "--kv-budget",
        default=None,
        help="memory for all contexts' KV: bytes (500MB) or a share of the memory limit (25%%); "
        "default: the KV share the memory plan sets aside",
    )
    p.add_argument("--chunk-tokens", type=int, default=16, help="tokens per KV chunk (default: 16)")
    p.add_argument(
        "--kv-compression",
        default="off",
        help="off (exact, the default), static:8|4|2 (every chunk at that width once written to flash), "
        "or tolerance:R (8/4/2-bit chunks averaging R x 8 bits, the bits where attention mass "
        "times quantization error is largest; tolerance:0.5 costs +0.06%% perplexity here)",
    )
    p.add_argument(
        "--service-dir", default=None, help="where contexts are kept (default: <cache>/service/<model digest>)"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none (default: 256)")
    p.add_argument(
        "--queue-limit",
        type=int,
        default=16,
        help="requests that may wait for the engine; more get 503 with Retry-After (default: 16)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=32,
        help="requests decoded together (continuous batching: one pass of the weights per token for "
        "all of them); more wait their turn (default: 32)",
    )
    p.add_argument(
        "--long-context",
        action="store_true",
        help="where the memory plan keeps a long sequence's older KV on flash (KV tiers), each conversation "
        "holds the model's whole context: one conversation's KV at a time, one request at a time (an idle "
        "conversation's KV is dropped for another's and prefilled again when it is next used); default: "
        "contexts in the KV budget's swappable chunks, as long as that budget holds",
    )
    p.add_argument("--model-name", default=None, help="the model id /v1/models reports (default: the store's name)")
    add_pipeline_arguments(
        p, "serves the requests (a continuous batch across the ranks; each conversation's KV on every rank)"
    )
    args = p.parse_args(argv)
    if args.pipeline:  # the one-process service's KV options: across ranks each conversation is one sequence
        given = [
            flag
            for flag, value, default in (
                ("--kv-budget", args.kv_budget, None),
                ("--chunk-tokens", args.chunk_tokens, 16),
                ("--kv-compression", args.kv_compression, "off"),
                ("--service-dir", args.service_dir, None),
                ("--long-context", args.long_context, False),
            )
            if value != default
        ]
        if given:
            p.error(
                f"{', '.join(given)}: the one-process server's KV options; with --pipeline each conversation's "
                "KV is one sequence on every rank"
            )
    return args


def check_flags(args) -> None:
    """The server's own flags, refused by name before the model loads."""
    for flag, value in (
        ("--queue-limit", args.queue_limit),
        ("--chunk-tokens", args.chunk_tokens),
        ("--max-batch", args.max_batch),
    ):
        check_int(flag, value, low=1)
    check_int("--max-tokens", args.max_tokens, low=0)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0-65535 (got {args.port})")
    if args.kv_budget is not None:  # its form only: a share is of a limit known once the model is planned
        parse_budget(args.kv_budget, 1 << 62, "--kv-budget")


def main(argv=None) -> int:
    args = parse_args(argv)
    keys = tuple(args.api_key) + tuple(k for k in os.environ.get("MLX_FLASH_API_KEYS", "").split(",") if k)
    try:
        from aiohttp import web

        Compression.parse(args.kv_compression)  # a bad option is refused before the model loads
        check_flags(args)

        cfg = from_arguments(EngineConfig, args)
        engine, status = load_for(args, cfg)
        if engine is None:  # a pipeline's rank other than 0: it served its layers until rank 0 stopped
            return status
        # several keys split the contexts, the KV pool and the queue equally (service/quota.py)
        quota = KeyQuota.among(len(set(keys)), MAX_CONTEXTS, args.queue_limit)
        options = ServerOptions(
            model_name=args.model_name or _model_name(engine),
            api_keys=keys,
            queue_limit=args.queue_limit,
            max_tokens_default=args.max_tokens,
            max_batch=args.max_batch,
            key_queue_limit=quota.queued,
        )
        svc = conversations_for(
            engine,
            long=args.long_context,
            directory=args.service_dir,
            kv_budget=args.kv_budget,
            chunk_tokens=args.chunk_tokens,
            kv_compression=args.kv_compression,
            progress=True,
            max_contexts=MAX_CONTEXTS,
            key_quota=quota,
        )
        for line in svc.problems:
            print(f"warning: {line}", file=sys.stderr)
        server = server_for(svc, options)
        name = options.model_name
        print(
            f"serving {name} on http://{args.host}:{args.port}/v1 ({'API keys required' if keys else 'no API key'})",
            flush=True,
        )
        try:
            web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True)
        except OSError as e:  # the port is taken, the address is not ours
            raise FlashError(f"cannot serve on {args.host}:{args.port} ({e.strerror or e})") from None
        finally:
            svc.close()
            engine.close()
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _model_name(engine) -> str:
    """The id /v1/models reports: the store's name (on a pipeline's rank 0, the whole store's, which
    its stage store was cut from)."""
    return os.path.basename(model_store_path(engine).rstrip(os.sep))


if __name__ == "__main__":
    sys.exit(main())
