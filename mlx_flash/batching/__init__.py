"""The batching core: what every way of running several sequences shares (the throughput mode in
offload/, the server's continuous batch in service/, a pipeline's batches in distributed/), and the
finishing rules the single-sequence loop in engine.py uses too.

  finishing.py    one sequence's text and finish: EOS, stop strings, the token budget (TextStream)
  sequence.py     one sequence of a batch (Sequence) and the sampling options a batch shares
  schedule.py     how micro-batches walk the layers (Order: zig-zag or row), run_block, LayerOnce
  batch_cache.py  B sequences' KV as one cache: BatchKV over their own caches, BlockKV in one buffer
  prompts.py      prompts checked and encoded together, prefilled together; a run's BatchStats
"""
