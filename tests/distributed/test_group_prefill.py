"""A GROUP message (several sequences' prompt chunks of different lengths, run layer by layer so a
streamed layer is read once for all, rows of similar length in one left-padded pass) computes each
sequence as a step of it alone does, to float32 rounding: checked on a pipeline of one rank, whose
steps run in this process."""

import numpy as np
import pytest

from one_rank import OneRank

from mlx_flash.distributed.pipeline import Pipeline


PROMPTS = [[1, 520, 3312, 314, 4470, 30], [1, 28, 1090, 2096, 253, 5646, 314, 253, 7765, 30], [1, 4459, 42]]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_group_computes_each_sequence_as_alone(store_dir, backend):
    import mlx_flash

    local = mlx_flash.load(store_dir, backend=backend, ffn="stream")  # layers read from flash: each once per group
    try:
        p = Pipeline(local, OneRank(), [range(local.args.num_hidden_layers)])
        e = local.with_runner(p)
        with e.ops.inference():
            # alone: each sequence's steps; the second split in two chunks
            alone = []
            for k, ids in enumerate(PROMPTS):
                c = e.new_caches(64)
                chunks = [ids[:4], ids[4:]] if k == 1 else [ids]
                for chunk in chunks:
                    logits = e.ops.to_numpy(p.forward(e, e.ops.tokens([chunk]), c, False))
                alone.append(logits[0, -1])
            # grouped: the first chunks of all three in one message, then the rest of the second
            caches = [e.new_caches(64) for _ in PROMPTS]
            reads = e.io_bytes()
            p.submit_group([PROMPTS[0], PROMPTS[1][:4], PROMPTS[2]], caches)
            first = e.ops.to_numpy(p.collect())
            assert e.io_bytes() - reads == e.store.manifest.ffn.layer_nbytes * e.args.num_hidden_layers
            p.submit_group([PROMPTS[1][4:]], [caches[1]])
            second = e.ops.to_numpy(p.collect())
        assert first.shape[:2] == (3, 1) and second.shape[:2] == (1, 1)
        # the first two rows share a left-padded pass (the third has one of its own): float32 rounding of
        # a batched product apart, as the throughput mode's batches
        np.testing.assert_allclose(first[0, -1], alone[0], atol=1e-4, rtol=0)
        np.testing.assert_array_equal(first[2, -1], alone[2])
        np.testing.assert_allclose(second[0, -1], alone[1], atol=1e-4, rtol=0)  # its first chunk's KV was batched
        assert [c[0].offset for c in caches] == [len(ids) for ids in PROMPTS]
    finally:
        local.close()  # (the pipeline of one rank has no other rank to stop)
