"""Host round trips of the MLX backend, counted: every evaluation (mx.eval, mx.async_eval) and every
export of an MLX array to the host (item, tolist, __array__, numpy's array/asarray/ascontiguousarray/
frombuffer; a bare memoryview is not wrapped, memoryview being a type the package tests with
isinstance). Used by tests/backends/test_mlx_round_trips.py, also inside a child process in a cgroup."""

import contextlib

import mlx.core as mx
import numpy as np


@contextlib.contextmanager
def counted_round_trips():
    """Yields a list that grows by one entry (what was called) per evaluation or export."""
    calls = []
    patched = []

    def wrap(owner, name, test=lambda *a, **k: True):
        orig = getattr(owner, name)

        def counting(*a, **k):
            if test(*a, **k):
                calls.append(name)
            return orig(*a, **k)

        setattr(owner, name, counting)
        patched.append((owner, name, orig))

    is_mx = lambda a=None, *rest, **k: isinstance(a, mx.array)  # noqa: E731
    try:
        wrap(mx, "eval")
        wrap(mx, "async_eval")
        for name in ("item", "tolist", "__array__"):
            wrap(mx.array, name)
        for name in ("array", "asarray", "ascontiguousarray", "frombuffer"):
            wrap(np, name, is_mx)
        yield calls
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)


def decode_round_trips(engine, prompt: str | list[int], tokens: int) -> int:
    """Round trips while `engine` greedily decodes `tokens` tokens after prefilling `prompt` (text, or
    token ids)."""
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    caches = engine.new_caches()
    token = int(np.argmax(engine.prefill(ids, caches)))
    with counted_round_trips() as calls:
        for _ in range(tokens):
            token = int(np.argmax(engine.forward([token], caches)[-1]))
    return len(calls)
