// The CPU kernel library (kernels/cpu/*.cpp, compiled at install into mlx_flash.kernels._qmatmul) as
// the MLX primitives call it: its exported functions, looked up once in the library the Python
// binding already loaded, so both frameworks and the ctypes path share one thread pool and one
// instruction-set choice (mf_set_isa in tests reaches every caller).
#pragma once

#include <cstdint>
#include <string>

namespace mlx_flash {

struct KernelLibrary {
  int (*qmatmul)(const float* x, int64_t T, int64_t K, const uint32_t* w, const void* scales, const void* biases,
                 int scale_type, int64_t N, int bits, int group, int transposed, float* y, int threads,
                 const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids) = nullptr;
  int (*blockmatmul)(const float* x, int64_t T, int64_t K, const uint8_t* w, int type, int64_t N, float* y,
                     int threads, const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids) = nullptr;
  int64_t (*rows)(const int32_t* ids, int64_t n, int64_t rows, const uint8_t* w, const uint8_t* scales,
                  const uint8_t* biases, int kind, int bits, int group, int scale_type, int64_t K, int64_t wr,
                  int64_t sr, float* out) = nullptr;
  int (*attention)(const float* q, int64_t B, int64_t Hq, int64_t T, int64_t hd, const int64_t* qs, const void* k,
                   const void* v, int kv_type, int64_t Hkv, const int64_t* ks, const int64_t* vs, const int32_t* table,
                   int64_t max_blocks, int64_t block_tokens, const int32_t* kv_len, const int32_t* q_pos, float scale,
                   float* out, const int64_t* os, int threads) = nullptr;
  int (*rms_norm)(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* y) = nullptr;
  int (*rope)(const float* x, int64_t B, int64_t H, int64_t T, int64_t hd, const int64_t* xs, const float* inv_freq,
              int64_t dims, int traditional, const int32_t* pos, float scale, float* y) = nullptr;
  int (*silu_mul)(const float* g, const float* u, int64_t n, float* y) = nullptr;
  int (*write_tokens)(float* buf, int64_t B, int64_t H, int64_t cap, int64_t hd, const float* x, const int64_t* xs,
                      int64_t T, int64_t offset) = nullptr;
};

// Look the functions up in the already loaded library at `path` (throws naming what is missing).
void load_kernel_library(const std::string& path);

// The functions (throws when load_kernel_library has not succeeded).
const KernelLibrary& kernels();

}  // namespace mlx_flash
