"""FlexGen's throughput mode: many sequences through a model larger than its memory budget.

  schedule.py        the zig-zag block order (layer-major over micro-batches) and the row order
  batch_generate.py  blocks of sequences: prefill and decode through the schedule
  sequence.py        one sequence's tokens, text and finish (as Engine.stream_tokens makes them)
  policy.py          a policy: batch shape, weight placement, KV width, order, overlap
  cost_model.py      a block's time and memory under a policy, from measured speeds
  calibration.py     the compute speeds, measured on one layer of the loaded model
  search.py          the LP over placement for each batch shape, the best policy
  quantized_kv.py    per-sequence KV caches, exact or group-wise 4-bit
  run.py             all of it for engine.generate_batch and `python -m mlx_flash.batch`
"""

from .policy import Policy
from .schedule import Order

__all__ = ["Order", "Policy"]
