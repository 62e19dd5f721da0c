"""What the fuzz and bad-input tests share: a time limit per case that a hang cannot escape, the
printed counts, and a tiny random llama store with a chat template (so message prompts go through
one)."""

import contextlib
import faulthandler
import signal
import sys

CASE_SECONDS = 10
TEMPLATE = (
    "{% for m in messages %}w{{ loop.index }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


class Hang(BaseException):
    """A case ran past its time (raised from the SIGALRM handler; a BaseException, so that no
    `except Exception` in the code under test swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: int = CASE_SECONDS):
    def on_alarm(signum, frame):
        raise Hang(f"case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    # native code does not return to the interpreter to take SIGALRM: this one ends the process (writing
    # to the real stderr: a case may have redirected sys.stderr)
    faulthandler.dump_traceback_later(seconds * 3, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


def report(what: str, tally, seconds: float) -> None:
    """A fuzz test's counts by outcome (collections.Counter), printed (visible with pytest -s)."""
    print(f"\n[fuzz] {what}: {sum(tally.values())} cases in {seconds:.1f} s")
    for k, v in sorted(tally.items()):
        print(f"[fuzz]   {v:5d}  {k}")


def templated_store(root) -> str:
    """A tiny random llama converted under `root` (a pathlib folder), with TEMPLATE as its chat template."""
    import mlx_flash
    import tiny_models

    tiny_models.build("llama", str(root / "hf"))
    with open(root / "hf" / "chat_template.jinja", "w") as fh:
        fh.write(TEMPLATE)
    return mlx_flash.convert(str(root / "hf"), str(root / "store"), progress=False)
