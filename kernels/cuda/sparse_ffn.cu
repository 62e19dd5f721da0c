// The CUDA member of the sparse FFN kernels: decode (and up to kMaxTokens tokens) over a slab of
// bundle rows, reading the stored 4/8-bit affine codes where they lie; equal to the plain-ops
// reference kernels/sparse_ffn_ref.py (tests/kernels/test_cuda_sparse.py on an NVIDIA GPU).
//
// Grids are sized for the slab's slot count and every kernel reads `count` from device memory:
// work past it exits, so a step never waits for the host to learn how many bundles are active.
//
// sparse_gate_up: one warp per neuron row n = j*block + r (a grid-stride loop over rows). Lane l
//   takes the 32-code chunks l, l+32, ... of the row (16 bytes at 4 bits, 32 at 8: the warp reads
//   consecutive words), accumulates s*sum(q*x) + b*sum(x) per chunk for gate and up (a chunk never
//   straddles a group: groups are multiples of 32), and the warp sums with shuffles.
// sparse_down: a thread per output row d (block layout: the bundle's d-th row of codes, 16 bytes at
//   4 bits, so consecutive threads read consecutive bytes of one bundle) or per output d (column
//   layout), looping over the bundles of its chunk (blockIdx.y: j = chunk, chunk + kDownChunks, ...);
//   the chunks' partial sums are then added in chunk order by a second kernel.
#include "sparse_ffn.cuh"

#include "affine.cuh"

namespace mf {
namespace {

__device__ __forceinline__ int active_count(const int32_t* count, int slots) {
  const int c = *count;
  return c < 0 ? 0 : (c > slots ? slots : c);
}

// x · (the 32 codes of one chunk) and the chunk's sum of x, for T tokens; words: 4 (4-bit) or 8.
template <int T>
__device__ __forceinline__ void chunk_dot(const uint32_t* words, int bits, const float* x, int stride, float* q,
                                          float* xs) {
  const int per = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
#pragma unroll
  for (int t = 0; t < T; t++) q[t] = xs[t] = 0.f;
  for (int w = 0; w < bits; w++) {
    const uint32_t word = words[w];
    for (int k = 0; k < per; k++) {
      const float code = static_cast<float>((word >> (bits * k)) & mask);
#pragma unroll
      for (int t = 0; t < T; t++) {
        const float xv = __ldg(x + t * stride + w * per + k);
        q[t] = fmaf(code, xv, q[t]);
        xs[t] += xv;
      }
    }
  }
}

template <int T>
__global__ void gate_up_kernel(const float* __restrict__ x, const uint8_t* __restrict__ slab, int slots,
                               const int32_t* __restrict__ idx, const int32_t* __restrict__ count, SlabLayout lay,
                               float* __restrict__ h) {
  const int lane = threadIdx.x & 31;
  const int warps = (blockDim.x >> 5) * gridDim.x;
  const int B = lay.block, D = lay.d_model, width = slots * B;
  const int rows = active_count(count, slots) * B;
  for (int n = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; n < width; n += warps) {
    if (n >= rows) {  // past count: zero, so h holds no stale values
      if (lane < T) h[lane * width + n] = 0.f;
      continue;
    }
    const int j = n / B, r = n % B;
    const uint8_t* row = slab + static_cast<int64_t>(idx[j]) * lay.row_bytes;
    const uint32_t* gw = reinterpret_cast<const uint32_t*>(row + lay.gate.w) + r * (D * lay.gate.bits / 32);
    const uint32_t* uw = reinterpret_cast<const uint32_t*>(row + lay.up.w) + r * (D * lay.up.bits / 32);
    float ag[T], au[T], q[T], xs[T];
#pragma unroll
    for (int t = 0; t < T; t++) ag[t] = au[t] = 0.f;
    for (int c = lane; c < D / 32; c += 32) {
      const int gi = r * (D / lay.gate.group) + c * 32 / lay.gate.group;
      const int ui = r * (D / lay.up.group) + c * 32 / lay.up.group;
      chunk_dot<T>(gw + c * lay.gate.bits, lay.gate.bits, x + c * 32, D, q, xs);
      const float gs = load_scale(row + lay.gate.s, lay.scale_type, gi);
      const float gb = load_scale(row + lay.gate.b, lay.scale_type, gi);
#pragma unroll
      for (int t = 0; t < T; t++) ag[t] += gs * q[t] + gb * xs[t];
      chunk_dot<T>(uw + c * lay.up.bits, lay.up.bits, x + c * 32, D, q, xs);
      const float us = load_scale(row + lay.up.s, lay.scale_type, ui);
      const float ub = load_scale(row + lay.up.b, lay.scale_type, ui);
#pragma unroll
      for (int t = 0; t < T; t++) au[t] += us * q[t] + ub * xs[t];
    }
#pragma unroll
    for (int t = 0; t < T; t++) {
      float g = ag[t], u = au[t];
      for (int off = 16; off > 0; off >>= 1) {
        g += __shfl_xor_sync(0xffffffffu, g, off);
        u += __shfl_xor_sync(0xffffffffu, u, off);
      }
      if (lane == 0) h[t * width + n] = g / (1.f + expf(-g)) * u;
    }
  }
}

template <int T>
__global__ void down_kernel(const float* __restrict__ h, int h_stride, const uint8_t* __restrict__ slab, int slots,
                            const int32_t* __restrict__ idx, const int32_t* __restrict__ count, SlabLayout lay,
                            float* __restrict__ partial) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y, D = lay.d_model;
  if (d >= D) return;
  const int cnt = active_count(count, slots), B = lay.block, bits = lay.down.bits;
  const uint32_t mask = (1u << bits) - 1u;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; t++) acc[t] = 0.f;
  for (int j = chunk; j < cnt; j += kDownChunks) {
    const uint8_t* row = slab + static_cast<int64_t>(idx[j]) * lay.row_bytes;
    const float* hj = h + j * B;
    if (lay.down_layout == 0) {  // block: row d holds the bundle's B codes, one group
      const uint32_t* w = reinterpret_cast<const uint32_t*>(row + lay.down.w) + d * (B * bits / 32);
      const float s = load_scale(row + lay.down.s, lay.scale_type, d);
      const float b = load_scale(row + lay.down.b, lay.scale_type, d);
      const int per = 32 / bits;
      float q[T], hs[T];
#pragma unroll
      for (int t = 0; t < T; t++) q[t] = hs[t] = 0.f;
      for (int i = 0; i < B / per; i++) {
        const uint32_t word = w[i];
        for (int k = 0; k < per; k++) {
          const float code = static_cast<float>((word >> (bits * k)) & mask);
#pragma unroll
          for (int t = 0; t < T; t++) {
            const float hv = __ldg(hj + t * h_stride + i * per + k);
            q[t] = fmaf(code, hv, q[t]);
            hs[t] += hv;
          }
        }
      }
#pragma unroll
      for (int t = 0; t < T; t++) acc[t] += s * q[t] + b * hs[t];
    } else {  // column: the neuron's down column, code d, group d / group
      const uint32_t word = reinterpret_cast<const uint32_t*>(row + lay.down.w)[d * bits / 32];
      const float code = static_cast<float>((word >> (bits * (d % (32 / bits)))) & mask);
      const int g = d / lay.down.group;
      const float wv = code * load_scale(row + lay.down.s, lay.scale_type, g) + load_scale(row + lay.down.b, lay.scale_type, g);
#pragma unroll
      for (int t = 0; t < T; t++) acc[t] = fmaf(wv, __ldg(hj + t * h_stride), acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < T; t++) partial[(static_cast<int64_t>(chunk) * T + t) * D + d] = acc[t];
}

bool layout_ok(const SlabLayout& lay, int T) {
  auto ok = [](const SlabMatrix& m) { return (m.bits == 4 || m.bits == 8) && m.group > 0 && m.group % 32 == 0; };
  return T >= 1 && T <= kMaxTokens && lay.d_model % 32 == 0 && lay.block >= 1 && lay.row_bytes % 4 == 0 &&
         ok(lay.gate) && ok(lay.up) && (lay.down.bits == 4 || lay.down.bits == 8) && lay.scale_type >= 0 &&
         lay.scale_type <= 2 && (lay.down_layout == 0 ? lay.block * lay.down.bits % 32 == 0 : lay.block == 1);
}

}  // namespace

cudaError_t sparse_gate_up(const float* x, int T, const uint8_t* slab, int slots, const int32_t* idx,
                           const int32_t* count, const SlabLayout& lay, float* h, cudaStream_t stream) {
  if (!layout_ok(lay, T) || slots < 1) return cudaErrorInvalidValue;
  const int threads = 256, rows = slots * lay.block;
  const int blocks = (rows + threads / 32 - 1) / (threads / 32) < 65535 ? (rows + threads / 32 - 1) / (threads / 32) : 65535;
  switch (T) {
#define MF_CASE(N) \
  case N:          \
    gate_up_kernel<N><<<blocks, threads, 0, stream>>>(x, slab, slots, idx, count, lay, h); \
    break;
    MF_CASE(1) MF_CASE(2) MF_CASE(3) MF_CASE(4) MF_CASE(5) MF_CASE(6) MF_CASE(7) MF_CASE(8)
#undef MF_CASE
  }
  return cudaGetLastError();
}

cudaError_t sparse_down(const float* h, int T, int h_stride, const uint8_t* slab, int slots, const int32_t* idx,
                        const int32_t* count, const SlabLayout& lay, float* scratch, float* y, cudaStream_t stream) {
  if (!layout_ok(lay, T) || slots < 1 || h_stride < slots * lay.block) return cudaErrorInvalidValue;
  const int threads = 128;
  const dim3 grid((lay.d_model + threads - 1) / threads, kDownChunks);
  switch (T) {
#define MF_CASE(N) \
  case N:          \
    down_kernel<N><<<grid, threads, 0, stream>>>(h, h_stride, slab, slots, idx, count, lay, scratch); \
    break;
    MF_CASE(1) MF_CASE(2) MF_CASE(3) MF_CASE(4) MF_CASE(5) MF_CASE(6) MF_CASE(7) MF_CASE(8)
#undef MF_CASE
  }
  const int n = T * lay.d_model;
  sum_partials<<<(n + 255) / 256, 256, 0, stream>>>(scratch, kDownChunks, n, y);
  return cudaGetLastError();
}

}  // namespace mf
