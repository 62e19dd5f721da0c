// Rows of a stored matrix as float32: embedding lookups read a few rows of the token embedding,
// never a whole matrix, from the stored bytes (an affine 2/4/8-bit matrix in the store's layout, or a
// GGUF block type). Affine: w = q * scale + bias, the product exact in float32 so the one rounding is
// the add (as MLX's dequantize, and kernels/qmatmul_ref.py's rounded once to float32); block types: gguf_blocks.h's
// decoding, equal to the gguf package's bit for bit. Plain-ops references: kernels/qmatmul_ref.py
// (dequantize) and kernels/gguf_blocks_ref.py.
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

using namespace mf;

namespace {

void affine_row(const uint8_t* w, const uint8_t* scales, const uint8_t* biases, int bits, int group, int scale_type,
                int64_t K, float* out) {
  const int64_t ssize = scale_type == F32 ? 4 : 2;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(w);
  for (int64_t g = 0; g < K / group; g++) {
    const float s = load_scale(scales + g * ssize, scale_type, 0), b = load_scale(biases + g * ssize, scale_type, 0);
    for (int64_t j = g * group; j < (g + 1) * group; j++) out[j] = (float)code_at(words, bits, j) * s + b;
  }
}

template <int TYPE>
void block_row(const uint8_t* w, int64_t K, float* out) {
  for (int64_t g = 0; g < K / block_weights(TYPE); g++)
    decode_block<TYPE>(w + g * block_bytes(TYPE), out + g * block_weights(TYPE));
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// out[i, :K] = row ids[i] of the matrix (i < n), zeros for an id outside [0, rows). kind 0: affine,
// row r's codes at w + r * wr bytes, its group g's scale and bias at scales|biases + r * sr + g *
// (scale size) bytes; kind a GGUF block type (gguf_blocks.h): row r's blocks from w + r * wr. Returns
// the number of ids outside [0, rows), or a negative code for bad arguments.
MF_EXPORT int64_t mf_rows(const int32_t* ids, int64_t n, int64_t rows, const uint8_t* w, const uint8_t* scales,
                          const uint8_t* biases, int kind, int bits, int group, int scale_type, int64_t K, int64_t wr,
                          int64_t sr, float* out) {
  if (kind == 0 && ((bits != 2 && bits != 4 && bits != 8) || group <= 0 || K % group)) return -1;
  if (kind != 0 && (block_bytes(kind) == 0 || K % block_weights(kind))) return -2;
  int64_t outside = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t r = ids[i];
    float* o = out + i * K;
    if (r < 0 || r >= rows) {
      std::memset(o, 0, K * sizeof(float));
      outside++;
      continue;
    }
    const uint8_t* row = w + r * wr;
    switch (kind) {
      case 0: affine_row(row, scales + r * sr, biases + r * sr, bits, group, scale_type, K, o); break;
      case Q5_0: block_row<Q5_0>(row, K, o); break;
      case Q5_1: block_row<Q5_1>(row, K, o); break;
      case Q4_K: block_row<Q4_K>(row, K, o); break;
      case Q5_K: block_row<Q5_K>(row, K, o); break;
      case Q6_K: block_row<Q6_K>(row, K, o); break;
    }
  }
  return outside;
}

}  // extern "C"
