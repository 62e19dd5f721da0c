"""One rank of a pipelined greedy run (tests/distributed/test_pipeline.py): rank 0 writes the greedy
tokens, every step's logits and the layer ranges to OUT; the other ranks serve their layers.

    python greedy_rank.py STORE BACKEND OUT STEPS [tiny]   (under a launcher's environment)

`tiny`: a prompt of ids inside a tiny test model's vocabulary.
"""

import sys

import numpy as np

PROMPT = [1, 504, 3458, 282, 4649, 314, 1183, 30, 216, 2683, 33]
TINY_PROMPT = [1, 5, 17, 3, 40, 22, 9, 61, 7, 30, 12, 44]  # past a tiny Gemma 3's window of 8


def main() -> int:
    import mlx_flash
    from mlx_flash.distributed.launch import join

    model, backend, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    engine, status = join(model, mlx_flash.EngineConfig(backend=backend))
    if engine is None:
        return status
    from greedy import greedy

    with engine:
        toks, logits = greedy(engine, TINY_PROMPT if sys.argv[5:] == ["tiny"] else PROMPT, n)
    np.savez(out, tokens=np.array(toks), logits=logits, stages=np.array([[s.start, s.stop] for s in status]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
