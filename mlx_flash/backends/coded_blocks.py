"""Where attention finds the codes, scales and biases of a read buffer of compressed KV blocks
(models/kv_coded_blocks.BlockFormat), as kernels/kv_codes.CodedLayout describes them to
mf_attention_coded: derived once per format and buffer size from the numpy views the format writes
through, so the kernel reads exactly what `BlockFormat.encode` put there."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..kernels.kv_codes import CodedLayout, from_views
from ..models.kv_coded_blocks import BlockFormat


@lru_cache(maxsize=8)
def block_layouts(fmt: BlockFormat, blocks: int) -> tuple[CodedLayout, CodedLayout, np.ndarray]:
    """(keys' layout, values' layout, slot table int32 [1, blocks]) of a buffer of `blocks` blocks,
    block j at byte j * fmt.nbytes, its blocks in order."""
    kc, ks, kb, vc, vs, vb = fmt.views(np.zeros((blocks, fmt.nbytes), np.uint8))
    # the kernel's index order: (block, head, token, channel) for codes, (block, head, token group,
    # channel group) for scales; keys' codes are packed along tokens, values' along channels
    _, kl = from_views(kc.transpose(0, 1, 3, 2), *(s.transpose(0, 1, 3, 2) for s in (ks, kb)),
                       fmt.bits, "tokens", fmt.tokens, 1, fmt.tokens)  # fmt: skip
    _, vl = from_views(vc, vs, vb, fmt.bits, "channels", 1, fmt.group, fmt.tokens)
    table = np.arange(blocks, dtype=np.int32)[None]
    table.flags.writeable = False
    return kl, vl, table
