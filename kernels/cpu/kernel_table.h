// The CPU kernel library's exported functions as a table of pointers, looked up by name in the copy
// Python loaded (mlx_flash.kernels._qmatmul): what the MLX extension (kernels/mlx/) and the torch
// operators (kernels/torch/ops.cpp) call, so every caller shares one thread pool and one
// instruction-set choice (mf_set_isa in tests reaches them all). Header-only: the torch operators'
// build copies it beside ops.cpp.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kv_codes.h"
#include "matrix_ref.h"

namespace mlx_flash {

struct KernelLibrary {
  int (*qmatmul)(const float* x, int64_t T, int64_t K, const uint32_t* w, const void* scales, const void* biases,
                 int scale_type, int64_t N, int bits, int group, int transposed, float* y, int threads,
                 const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids, int arith) = nullptr;
  int (*blockmatmul)(const float* x, int64_t T, int64_t K, const uint8_t* w, int type, int64_t N, float* y,
                     int threads, const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids,
                     int arith) = nullptr;
  int64_t (*rows)(const int32_t* ids, int64_t n, int64_t rows, const uint8_t* w, const uint8_t* scales,
                  const uint8_t* biases, int kind, int bits, int group, int scale_type, int64_t K, int64_t wr,
                  int64_t sr, float* out) = nullptr;
  int (*attention)(const float* q, int64_t B, int64_t Hq, int64_t T, int64_t hd, const int64_t* qs, const void* k,
                   const void* v, int kv_type, int64_t Hkv, const int64_t* ks, const int64_t* vs, const int32_t* table,
                   int64_t max_blocks, int64_t block_tokens, const int32_t* kv_len, const int32_t* q_pos, float scale,
                   float* out, const int64_t* os, int threads, int64_t window) = nullptr;
  int (*attention_coded)(const float* q, int64_t B, int64_t Hq, int64_t T, int64_t hd, const int64_t* qs,
                         const void* k, const void* v, int kv_type, int64_t Hkv, const int64_t* ks, const int64_t* vs,
                         int64_t residual_tokens, const int32_t* table, int64_t max_blocks, const int32_t* kv_len,
                         const int32_t* q_pos, float scale, float* out, const int64_t* os, int threads,
                         const mf_kv_codes* kc, const int32_t* k_coded, const mf_kv_codes* vc,
                         const int32_t* v_coded) = nullptr;
  int (*attention_mixed)(const float* q, int64_t B, int64_t Hq, int64_t T, int64_t hd, const int64_t* qs,
                         const void* k, const void* v, int kv_type, int64_t Hkv, const int64_t* ks, const int64_t* vs,
                         const int32_t* table, const int32_t* classes, int64_t max_blocks, int64_t block_tokens,
                         const int32_t* kv_len, const int32_t* q_pos, float scale, float* out, const int64_t* os,
                         int threads, int n_codes, const mf_kv_codes* kc, const mf_kv_codes* vc) = nullptr;
  int (*rms_norm)(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* y) = nullptr;
  int (*rope)(const float* x, int64_t B, int64_t H, int64_t T, int64_t hd, const int64_t* xs, const float* inv_freq,
              int64_t dims, int traditional, const int32_t* pos, float scale, float* y) = nullptr;
  int (*silu_mul)(const float* g, const float* u, int64_t n, float* y) = nullptr;
  int (*write_tokens)(float* buf, int64_t B, int64_t H, int64_t cap, int64_t hd, const float* x, const int64_t* xs,
                      int64_t T, int64_t offset) = nullptr;
  int (*gated_ffn)(const float* x, int64_t T, int64_t K, const mf_matrix* gate, const mf_matrix* up,
                   const mf_matrix* down, float* hidden, float* y, int threads) = nullptr;
  int (*moe_experts)(const float* x, int64_t N, int64_t D, const int32_t* ids, const float* wts, int64_t K, int64_t E,
                     const mf_matrix* const* experts, int64_t Dout, float* scratch, float* y, int threads) = nullptr;
  int64_t (*cm_bytes)(int64_t N, int64_t K, int bits, int group, int scale_type) = nullptr;
  int (*cm_matmul)(const uint8_t* cm, int64_t N, int64_t K, int bits, int group, int scale_type, const float* x,
                   int64_t T, float threshold, float* y, int threads, int64_t* counters) = nullptr;
  int (*cm_gated_ffn)(const float* x, int64_t T, const mf_cm_matrix* gate, const mf_cm_matrix* up,
                      const mf_cm_matrix* down, float t_gu, float t_down, int act, float* hidden, float* y,
                      int threads, int64_t* gate_counters, int64_t* up_counters, int64_t* down_counters) = nullptr;
};

// A compressed-KV layout from the MF_KV_CODES_INTS ints the frameworks pass (kv_codes.h's order),
// over a buffer of `nbytes` bytes; false when the list has another length.
inline bool kv_codes_from(const int64_t* v, size_t n, const uint8_t* base, int64_t nbytes, mf_kv_codes* out) {
  if (n != MF_KV_CODES_INTS) return false;
  *out = mf_kv_codes{base,  nbytes, v[0],  v[1],  v[2],  v[3],  {v[4], v[5], v[6], v[7]}, {v[8], v[9], v[10], v[11]},
                     v[12], v[13], v[14]};
  return true;
}

namespace detail {
template <class F>
void find(void* handle, const char* name, const std::string& path, F& out) {
  void* sym = dlsym(handle, name);
  if (sym == nullptr) throw std::runtime_error(path + ": the CPU kernel library has no " + name + " (stale build)");
  out = reinterpret_cast<F>(sym);
}
}  // namespace detail

// The table of the library already loaded from `path` (throws naming what is missing).
inline KernelLibrary kernel_table(const std::string& path) {
  // RTLD_NOLOAD: only the copy Python loaded (a second copy would bring a second thread pool).
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) throw std::runtime_error(path + ": the CPU kernel library is not loaded in this process");
  KernelLibrary lib;
  detail::find(handle, "mf_qmatmul", path, lib.qmatmul);
  detail::find(handle, "mf_blockmatmul", path, lib.blockmatmul);
  detail::find(handle, "mf_rows", path, lib.rows);
  detail::find(handle, "mf_attention", path, lib.attention);
  detail::find(handle, "mf_attention_coded", path, lib.attention_coded);
  detail::find(handle, "mf_attention_mixed", path, lib.attention_mixed);
  detail::find(handle, "mf_rms_norm", path, lib.rms_norm);
  detail::find(handle, "mf_rope", path, lib.rope);
  detail::find(handle, "mf_silu_mul", path, lib.silu_mul);
  detail::find(handle, "mf_write_tokens", path, lib.write_tokens);
  detail::find(handle, "mf_gated_ffn", path, lib.gated_ffn);
  detail::find(handle, "mf_moe_experts", path, lib.moe_experts);
  detail::find(handle, "mf_cm_bytes", path, lib.cm_bytes);
  detail::find(handle, "mf_cm_matmul", path, lib.cm_matmul);
  detail::find(handle, "mf_cm_gated_ffn", path, lib.cm_gated_ffn);
  return lib;
}

}  // namespace mlx_flash
