"""`python -m mlx_flash.batch IN.jsonl OUT.jsonl`: many prompts through one model for total
throughput (FlexGen's mode), even when the model is larger than the memory budget.

Each line of IN is {"id": ..., "prompt": "..."} (a raw completion) or {"id": ..., "messages":
[{"role", "content"}, ...]} (through the chat template), optionally with "max_tokens". Each line of
OUT is {"id", "text", "tokens", "finish_reason"}, written as its sequence finishes. A run that
stops part way is resumed by running the same command: ids already in OUT are skipped. The policy
(batch shape, weights kept in memory, KV width) is chosen by the cost model and a linear program,
printed with its predicted time and, at the end, the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..config import EngineConfig
from ..durable import AppendFile, truncate_durably
from .pipeline_flags import add_pipeline_arguments
from ..default_model import MODEL_HELP
from ..errors import ConfigError, FlashError, first_paragraph
from ..options import add_arguments, from_arguments
from ..sampling import check_int, check_sampling_flags
from ..distributed.launch import load_for
from ..distributed.transport import launcher_rank
from ..offload import Policy
from ..store.atomic_dir import OutputError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.batch", description=first_paragraph(__doc__))
    p.add_argument("input", help='JSON lines: {"id", "prompt" | "messages", "max_tokens"?}')
    p.add_argument("output", help="JSON lines written as sequences finish; ids already there are skipped")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    add_arguments(p, EngineConfig)
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of lines that give none (default: 256)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=None, help="random seed (each sequence samples from it as alone)")
    p.add_argument(
        "--policy",
        default=None,
        help='the policy as JSON, the fields the search prints, e.g. \'{"gpu_batch": 8, "num_batches": 4}\' '
        "(default: chosen by the cost model)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(0, 4),
        default=0,
        help="let the search hold KV caches at 4 bits (an approximation: +0.3%% perplexity measured "
        "on Wikipedia text with the default model); 0 keeps them exact (default)",
    )
    add_pipeline_arguments(p, "reads the prompts and writes the answers")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        help="with --pipeline: decode micro-batches in flight through the ranks (default: chosen from every "
        "rank's measured stage time)",
    )
    args = p.parse_args(argv)
    if args.micro_batches < 0:
        p.error(f"--micro-batches must be >= 0 (got {args.micro_batches})")
    if args.micro_batches and not args.pipeline:
        p.error("--micro-batches applies with --pipeline; one process's policy sets its batches")
    if args.pipeline and args.policy is not None:
        p.error("--pipeline takes no --policy: micro-batches flow through the ranks instead of one process's schedule")
    return args


def read_jobs(path: str, max_tokens: int) -> list[dict]:
    """The input's lines as {"id", "prompt", "max_tokens"}; one line naming the first bad one."""
    jobs, seen = [], set()
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(d, dict) or "id" not in d:
                raise ConfigError(f'{where}: expected an object with an "id"')
            key = json.dumps(d["id"])
            if key in seen:
                raise ConfigError(f"{where}: id {d['id']!r} appears twice")
            seen.add(key)
            if ("prompt" in d) == ("messages" in d):
                raise ConfigError(f'{where}: give exactly one of "prompt" and "messages"')
            prompt = d.get("prompt", d.get("messages"))
            if "prompt" in d and not isinstance(prompt, str):
                raise ConfigError(f'{where}: "prompt" must be a string')
            if "messages" in d and not (
                isinstance(prompt, list)
                and prompt
                and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt
                )
            ):
                raise ConfigError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} strings')
            mt = d.get("max_tokens", max_tokens)
            if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
                raise ConfigError(f'{where}: "max_tokens" must be an integer >= 1 (got {mt!r})')
            jobs.append({"id": d["id"], "prompt": prompt, "max_tokens": mt})
    return jobs


def done_ids(path: str) -> set:
    """Ids already in the output; a last line cut short by an interrupted run is dropped from it."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as fh:
        data = fh.read()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    ids = set()
    for n, line in enumerate(keep.splitlines(), 1):
        try:
            ids.add(json.dumps(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{path} line {n}: not a result line of this command; give another output file") from None
    if len(keep) != len(data):
        print(f"warning: {path}: dropped a last line cut short by an earlier run", file=sys.stderr)
        truncate_durably(path, len(keep), OutputError)
    return ids


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        policy = Policy.from_json(args.policy) if args.policy is not None else None
        check_int("--max-tokens", args.max_tokens, low=1)
        check_sampling_flags(args.temp, args.top_p, args.top_k, args.seed)  # one line each, as the other commands
        todo = []
        if not args.pipeline or launcher_rank() == 0:  # the other ranks of a pipeline never see the prompts
            jobs = read_jobs(args.input, args.max_tokens)
            if not jobs:
                raise ConfigError(f"{args.input}: no prompts (one JSON object per line)")
            finished = done_ids(args.output)
            todo = [j for j in jobs if json.dumps(j["id"]) not in finished]
            print(
                f"{len(jobs)} prompts in {args.input}, {len(jobs) - len(todo)} already in {args.output}, "
                f"{len(todo)} to run",
                file=sys.stderr,
            )
            if not todo and not args.pipeline:  # (a pipeline's rank 0 joins anyway, to stop the others)
                return 0
        engine, status = load_for(args, from_arguments(EngineConfig, args), batch=True)
        if engine is None:  # a pipeline's rank other than 0: it served its layers until rank 0 stopped
            return status
        # appended and fsynced line by line: a line is in OUT (and skipped by a resumed run) only once
        # it is on the disk; a line a crash cut short is dropped by done_ids
        with engine, AppendFile(args.output, OutputError, fresh=False) as out:

            def write(seq):
                job = todo[seq.index]
                line = {"id": job["id"], "text": seq.text, "tokens": seq.generated, "finish_reason": seq.finish_reason}
                out.write((json.dumps(line) + "\n").encode())
                out.sync()

            if todo:
                engine.generate_batch(
                    [j["prompt"] for j in todo],
                    [j["max_tokens"] for j in todo],
                    args.temp,
                    args.top_p,
                    args.top_k,
                    args.seed,
                    None,
                    policy,
                    True,
                    on_done=write,
                    kv_bits=(0, 4) if args.kv_bits else (0,),
                    micro_batches=args.micro_batches,
                )
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished sequences are in the output; run the same command to go on", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
