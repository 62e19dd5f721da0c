// Device helpers shared by the CUDA kernels that read the store's affine codes where they lie
// (sparse_ffn.cu, qmatmul.cu). In an unnamed namespace: each .cu compiles alone (nvcc -c, no device
// linking), so each keeps its own copy and no symbol is defined twice in one extension.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>

namespace mf {
namespace {

// Scale or bias i of an array of `type` (0 float16, 1 bfloat16, 2 float32; qmatmul.h's ScaleType).
// bfloat16 is the high half of a float32, so widening it is a shift.
__device__ __forceinline__ float load_scale(const uint8_t* p, int type, int64_t i) {
  if (type == 2) return __ldg(reinterpret_cast<const float*>(p) + i);
  const unsigned short v = __ldg(reinterpret_cast<const unsigned short*>(p) + i);
  if (type == 1) return __uint_as_float(static_cast<unsigned>(v) << 16);
  return __half2float(__ushort_as_half(v));
}

// y[i] = the sum over c < chunks of partial[c * n + i], added in chunk order: products split over
// chunks give the same result however the chunks were scheduled.
__global__ void sum_partials(const float* __restrict__ partial, int chunks, int64_t n, float* __restrict__ y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = 0.f;
  for (int c = 0; c < chunks; c++) s += partial[c * n + i];
  y[i] = s;
}

}  // namespace
}  // namespace mf
