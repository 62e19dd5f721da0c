"""FlexGen's throughput mode: many sequences through a model larger than its memory budget, on the
batching core (mlx_flash/batching: sequences, the zig-zag schedule, batch caches, prefill together).

  batch_generate.py  blocks of sequences: prefill and decode through the schedule
  policy.py          a policy: batch shape, weight placement, KV width, order, overlap
  cost_model.py      a block's time and memory under a policy, from measured speeds
  calibration.py     the compute speeds, measured on one layer of the loaded model
  search.py          the LP over placement for each batch shape, the best policy
  quantized_kv.py    per-sequence KV caches, exact or group-wise 4-bit
  run.py             all of it for engine.generate_batch in one process (runner.LocalRunner.run_batch)
"""

from ..batching.schedule import Order
from .policy import Policy

__all__ = ["Order", "Policy"]
