"""`python -m mlx_flash.chat`: interactive chat (or a one-shot answer) streaming tokens as they come.

Commands inside the REPL: /reset (forget the conversation), /stats (speed of the last answer),
/quit. Ctrl-C stops the current answer, not the REPL; a turn that fails (a line that is not UTF-8,
a read error) prints one line and the conversation goes on; a conversation that outgrows the
context drops its oldest turns, saying so. Piped stdin is read line by line. The
conversation is a context of an in-process service (mlx_flash.Service), or, where the memory plan
keeps a long sequence's older KV on flash (KV tiers), one sequence of the model's whole context:
each turn prefills only its own tokens, the earlier turns' KV is kept.
"""

from __future__ import annotations

import argparse
import sys

from ..api import load_config
from ..config import EngineConfig
from ..default_model import MODEL_HELP
from ..errors import ConfigError, FlashError, PipelineFault, first_paragraph
from ..memory import peak_rss, process_rss
from ..options import add_arguments, from_arguments
from ..sampling import check_int, check_sampling_flags
from ..service import Service
from ..service.sequences import TieredConversations
from ..stats import sparsity_words
from .pipeline_flags import add_pipeline_arguments

HELP = "commands: /reset  /stats  /quit   (Ctrl-C stops an answer; Ctrl-D or /quit exits)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.chat", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help=MODEL_HELP)
    add_arguments(p, EngineConfig)  # the engine's options, documented in mlx_flash.config / mlx_flash.options
    p.add_argument(
        "--speculative",
        type=int,
        default=0,
        help="greedy only: draft this many tokens by prompt lookup and verify them in one pass",
    )
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per answer (default: 512)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--system", default=None, help="system prompt for chat mode")
    p.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    p.add_argument("--raw", action="store_true", help="with --prompt: plain completion, no chat template")
    p.add_argument("--verbose", action="store_true", help="print speed stats after one-shot answers")
    add_pipeline_arguments(p, "answers")
    args = p.parse_args(argv)
    if args.raw and args.prompt is None:
        p.error("--raw needs --prompt")
    return args


def sampling(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        speculative=args.speculative,
    )


def stream_answer(steps, out=sys.stdout) -> str:
    """Stream the steps of one answer to `out`; Ctrl-C stops it. Returns the text produced."""
    pieces = []
    try:
        for step in steps:
            out.write(step.text)
            out.flush()
            pieces.append(step.text)
    except KeyboardInterrupt:
        out.write(" [stopped]")
    out.write("\n")
    out.flush()
    return "".join(pieces)


def kv_words(engine) -> str:
    """Where the KV plan keeps a sequence's tokens, and what the tiers read back since load."""
    plan = engine.memory_plan
    if not plan.get("kv_on_flash"):
        return f"KV planned for {plan['kv_tokens']} tokens"
    read = engine.kv_bytes_read
    return (
        f"KV: {plan['kv_tokens']} tokens resident of a {plan['kv_context']}-token context, the older ones on "
        f"flash ({read / 1e6:.0f} MB read back since load)"
    )


def format_stats(engine) -> str:
    s = engine.last
    if not s.steps:
        return "no answer yet"
    n = len(s.steps)
    wall, compute = sum(t.wall_ms for t in s.steps) / n, sum(t.compute_ms for t in s.steps) / n
    io, mem = sum(t.io_ms for t in s.steps) / n, sum(t.mem_ms for t in s.steps) / n
    nbytes, reads = sum(t.bytes_read for t in s.steps), sum(t.reads for t in s.steps)
    chunk = f", mean chunk {nbytes / reads / 1024:.0f} KiB" if reads else ""
    reused = f" ({s.cached_tokens} reused)" if s.cached_tokens else ""
    text = (
        f"prompt {s.prompt_tokens} tok{reused}, new ones in {s.prefill_s * 1e3:.0f} ms ({s.prefill_tps:.1f} tok/s) | "
        f"generated {s.generated_tokens} tok at {s.decode_tps:.1f} tok/s\n"
        f"per token: {wall:.2f} ms = compute {compute:.2f} + io wait {io:.2f} + mem-mgmt {mem:.2f} ms; "
        f"read {nbytes / 1e6 / n:.2f} MB in {reads / n:.1f} reads{chunk}"
    )
    if s.draft_proposed:
        text += f"\nspeculative: {s.draft_accepted} of {s.draft_proposed} drafted tokens kept"
    plan = engine.memory_plan
    if "backend" in plan:
        text += f"\nbackend: {plan['backend']}"
    if "arithmetic" in plan:
        text += f"\narithmetic: {plan['arithmetic']}"
    if engine.thresholded:
        text += f"\n{sparsity_words(engine)}"
    if "limit" in plan:
        text += (
            f"\nmemory: {process_rss() / 1e6:.0f} MB held now, peak {peak_rss() / 1e6:.0f} MB, limit "
            f"{plan['limit'] / 1e6:.0f} MB ({plan['limit_meaning']}); "
            + kv_words(engine)
            + (f"; {plan['streamed_layers']} layers' attention streamed" if plan.get("streamed_layers") else "")
        )
    st = engine.ffn.stats()
    if st.sparse_mode and st.decode_layer_steps:
        steps, F = st.decode_layer_steps, st.neurons
        rows = st.cached_rows
        text += (
            f"\nsparse FFN ({st.sparse_mode}): {st.rows_active / steps / F:.1%} of neurons active, "
            f"{st.rows_loaded / steps / F:.1%} of rows read per token and layer"
        )
        if st.sparse_kernel:
            text += f"; kernel: {st.sparse_kernel}"
        if rows:
            text += f"; cached rows per layer {min(rows)}-{max(rows)} of {st.cache_capacity}"
    if st.expert_policy:
        hits, misses = map(sum, zip(*st.expert_hits))
        text += (
            f"\nexpert cache ({st.expert_policy}, {st.expert_slots} slots): "
            f"{hits / max(1, hits + misses):.1%} hits over {hits + misses} routed experts"
        )
        if st.preload:
            text += (
                f"\nexpert preloading ({st.preload} per layer): {st.preloaded_used / max(1, st.routed_experts):.1%} "
                f"of the experts decode steps routed to were already preloaded"
            )
    return text


def repl(engine, args, inp=sys.stdin, out=sys.stdout) -> None:
    import io
    import tempfile

    interactive = inp.isatty()
    if isinstance(inp, io.TextIOWrapper):  # a line that is not UTF-8 is refused, not the end of the session
        inp.reconfigure(errors="surrogateescape")
    # a model split across ranks keeps each conversation's KV on every rank; a plan with KV tiers, the
    # conversation's whole context (its older tokens on flash); else a service in a folder that lasts as
    # long as the chat
    with (
        tempfile.TemporaryDirectory(prefix="mlx-flash-chat-") as tmp,
        chat_conversations(engine, args.pipeline, tmp) as conversations,
    ):
        _converse(engine, conversations, args, inp, out, interactive)


def load_engine(args, cfg):
    """(the engine the flags ask for, None); on a pipeline's rank other than 0, once rank 0 stopped it,
    (None, its exit status). distributed/ is entered for --pipeline only."""
    if not args.pipeline:
        return load_config(args.model, cfg), None
    from ..distributed.launch import load_for  # deferred: a pipeline's ranks, for --pipeline only

    return load_for(args, cfg, verbose=args.verbose)


def chat_conversations(engine, pipeline: bool, directory: str):
    """What holds the REPL's conversation: with --pipeline, its KV on every rank; with a plan that keeps a
    long sequence's older KV on flash, its whole context (TieredConversations); else an in-process
    Service keeping its contexts in `directory`."""
    if pipeline:
        from ..distributed.conversations import PipelineConversations  # deferred: for --pipeline only

        return PipelineConversations(engine)
    if engine.kv_tiers is not None:
        return TieredConversations(engine)
    return Service(engine, directory=directory)


def _converse(engine, svc, args, inp, out, interactive: bool) -> None:
    ctx = svc.new_context(system=args.system)
    if interactive:
        print(f"mlx_flash chat — {HELP}", file=out)
    while True:
        try:
            if interactive:
                out.write(">>> ")
                out.flush()
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            svc.delete(ctx)
            ctx = svc.new_context(system=args.system)
            print("(conversation cleared)", file=out)
            continue
        if line == "/stats":
            print(format_stats(engine), file=out)
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]}; {HELP}", file=out)
            continue
        if not _is_utf8(line):
            print("error: that line is not valid UTF-8; nothing was sent", file=out)
            continue
        try:
            ctx = _turn(svc, ctx, line, args, out)
        except PipelineFault:  # the ranks are gone: no later turn could be answered
            raise
        except (FlashError, OSError) as e:  # the turn fails, the session goes on
            print(f"\nerror: {_one_line(e)}", file=out)


def _is_utf8(line: str) -> bool:
    try:
        line.encode("utf-8")
        return True
    except UnicodeEncodeError:  # surrogateescape kept the undecodable bytes as lone surrogates
        return False


def _one_line(e: FlashError | OSError) -> str:
    text = str(e) if isinstance(e, FlashError) else f"{e.filename or ''}: {e.strerror or e}"
    return " ".join(text.split())


def _turn(svc, ctx: str, line: str, args, out) -> str:
    """One user turn answered in context ctx; returns the context the conversation goes on in. A
    conversation that would leave the answer too little room (less than --max-tokens, or half the
    context) goes on in a new context holding the most recent turns that leave it, saying so."""
    message = {"role": "user", "content": line}
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = [m for m in svc.get(ctx).messages if m["role"] != "system"]
    limit = svc.max_tokens
    room = min(args.max_tokens, limit // 2)

    def fits(kept) -> bool:
        return len(svc.engine.encode_prompt(system + kept + [message])) + room <= limit

    if not history or fits(history):
        return _answer(svc, ctx, [message], False, args, out)
    dropped = next((d for d in range(2, len(history), 2) if fits(history[d:])), len(history))  # whole turns
    new = svc.new_context(system=args.system)
    try:
        _answer(
            svc,
            new,
            system + history[dropped:] + [message],
            True,
            args,
            out,
            note=f"(the conversation outgrew the context: its oldest {-(-dropped // 2)} turn(s) were dropped)",
        )
    except BaseException:
        svc.delete(new)
        raise
    svc.delete(ctx)
    return new


def _answer(svc, ctx: str, prompt, whole: bool, args, out, note: str = "") -> str:
    steps = svc.call(ctx, prompt, whole=whole, **sampling(args))  # raises before anything changes
    if note:
        print(note, file=out)
    stream_answer(steps, out)
    return ctx


def check_flags(args) -> None:
    """The answer's flags, refused before the model loads (stream_generate refuses them only after)."""
    check_sampling_flags(args.temp, args.top_p, args.top_k, args.seed)
    check_int("--max-tokens", args.max_tokens, low=1)
    check_int("--speculative", args.speculative, low=0)
    if args.speculative and args.temp != 0:
        raise ConfigError(f"--speculative {args.speculative} needs --temp 0 (got {args.temp})")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_flags(args)

        cfg = from_arguments(EngineConfig, args)
        engine, status = load_engine(args, cfg)
        if engine is None:  # a pipeline's rank other than 0: it served its layers until rank 0 stopped
            return status
        with engine:
            templated = engine.tokenizer.has_chat_template
            if args.prompt is None and not templated:
                raise ConfigError(
                    "this model has no chat template (a base model, not a chat one), so there is no "
                    "conversation to hold: pass --prompt TEXT, which it continues as plain text"
                )
            if args.prompt is not None and not templated and not args.raw:
                print("(this model has no chat template: the prompt is continued as plain text)", file=sys.stderr)
            if args.prompt is not None:
                prompt = (
                    args.prompt
                    if args.raw or not templated
                    else (
                        ([{"role": "system", "content": args.system}] if args.system else [])
                        + [{"role": "user", "content": args.prompt}]
                    )
                )
                stream_answer(engine.stream_generate(prompt, **sampling(args)))
                if args.verbose:
                    print(format_stats(engine), file=sys.stderr)
            else:
                repl(engine, args)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
