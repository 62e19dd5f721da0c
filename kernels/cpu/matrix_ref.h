// A stored matrix as the kernel library's whole-layer functions take it (mf_gated_ffn): where its
// parts lie, how they are quantized and, for a sparse product, the units it lists: the arguments
// mf_qmatmul / mf_blockmatmul take one by one (n_out is then the sparse product's output width). And
// a channel-major matrix as mf_cm_gated_ffn takes it.
// Plain C, shared by the library, the MLX primitives and the torch operators (their builds copy it).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mf_matrix {
  int kind;                // 0: affine groups (w = q * scale + bias); else a GGUF block type (gguf_blocks.h)
  const uint8_t* w;        // codes (affine, 32-bit words) or whole blocks
  const void* scales;      // affine only
  const void* biases;      // affine only
  int scale_type, bits, group;  // affine only
  int64_t n_out;           // outputs
  int transposed;          // 1: rows are outputs (y = x W^T); always for block types
  const int64_t* layout;   // null: a plain matrix; else the kernel's row layout (7 ints affine, 4 blocks)
  const int32_t* row_ids;    // a sparse product over listed blocks of rows (or rows of the input), or null
  const int32_t* group_ids;  // a sparse product over listed groups of the input, or null
  int arith;                 // 0: the float arithmetic; 1: the q8 arithmetic where it reads the matrix (q8.h)
} mf_matrix;

// A matrix in the channel-major layout (kernels/cpu/channel_major.cpp, mf_cm_relayout) as
// mf_cm_gated_ffn takes it: where the layout starts, and the shape and quantization it was made for.
typedef struct mf_cm_matrix {
  const uint8_t* w;
  int64_t n_out, k_in;
  int bits, group, scale_type;  // 2/4/8; 32 .. 256 inputs; 0 float16, 1 bfloat16, 2 float32
} mf_cm_matrix;

#ifdef __cplusplus
}
#endif
