// Keys or values held as affine codes (mlx_flash/models/kv_quant.py: x ~ code * scale + bias, a
// float16 scale and bias per group, value i of a byte at bits * i) as the attention kernel reads them
// (mf_attention_coded, attention.cpp): where element (token t, channel d) of block or row `blk`,
// head h lies. Strides count codes (not bytes) and float16 values, so one description serves keys
// grouped per channel over a block of tokens (KIVI's keys: group_tokens > 1, group_channels 1) and
// values grouped per token along the channels (group_tokens 1). Plain C, shared by the library,
// the MLX primitives and the torch operators (their builds copy it).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// What the frameworks pass as a list of MF_KV_CODES_INTS ints, in this order after `base`.
typedef struct mf_kv_codes {
  const uint8_t* base;     // codes, scales and biases all lie in this buffer
  int64_t nbytes;          // its size: every index the kernel may form is checked against it first
  int64_t bits;            // 8, 4 or 2; 32: raw float32 (strides count floats, scales unused)
  int64_t codes, scales, biases;           // byte offsets into base (scales and biases float16)
  int64_t cs[4];           // code strides: block (or row), head, token, channel
  int64_t ss[4];           // scale and bias strides: block (or row), head, token group, channel group
  int64_t group_tokens, group_channels;    // tokens and channels one scale and bias cover
  int64_t block_tokens;    // tokens of a block when a slot table names blocks (else unused)
} mf_kv_codes;

#define MF_KV_CODES_INTS 15  // bits, codes, scales, biases, cs[4], ss[4], group_tokens, group_channels, block_tokens

#ifdef __cplusplus
}
#endif
