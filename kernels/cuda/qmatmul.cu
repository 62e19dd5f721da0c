// The affine stored product on CUDA (qmatmul.cuh), decode-shaped: a launch covers up to
// kMatmulTokens tokens, whose accumulators stay in registers, and reads the matrix once; equal to
// the plain-ops reference kernels/qmatmul_ref.py (tests/kernels/test_cuda_qmatmul.py on an NVIDIA
// GPU).
//
// rows_out_kernel (a linear, y = x · Wᵀ): one warp per output row, kRowsPerBlock rows a block. Lane l
//   takes words l, l+32, ... of the row, so each load of the warp reads 128 consecutive bytes; a word
//   never straddles a group (groups are multiples of 32 codes), so it adds
//   scale * sum(code * x) + bias * sum(x) over its codes. The warp then sums with shuffles.
// rows_out_wide_kernel: the same product with 16-byte loads where the shapes allow them (a row of a
//   multiple of 4 words, 16-byte aligned words and x): lane l takes words 4l..4l+3, 4(l+32).., so a
//   warp's load reads 512 consecutive bytes, and each 4 codes' x values come as one float4. Measured
//   on an H100 against the one-word kernel in one run (python -m mlx_flash.bench matmul --cuda): 8-bit codes,
//   one token (decode), 1.2x on the 7B shapes (1,348 against 1,112 GB/s); 4-bit codes no faster
//   (about 530 GB/s, a fifth of a copy's rate); 8 tokens no faster (one 8-bit shape 0.85x). What
//   bounds those is the per-code work (widening each code, summing x per group for the bias, per
//   row and token), not the loads.
// rows_in_kernel (rows are inputs, y = x · W, e.g. a neuron-major down matrix): a thread per output
//   column n, so neighbouring threads read the same or neighbouring words of an input row; the rows
//   are split into kInputChunks ranges (blockIdx.y) whose partial sums sum_partials adds in a fixed
//   order, which gives enough blocks when there are few outputs.
#include "qmatmul.cuh"

#include "affine.cuh"

namespace mf {
namespace {

constexpr int kRowsPerBlock = 8;   // warps of rows_out_kernel per block
constexpr int kInputThreads = 256;  // threads of rows_in_kernel (and of sum_partials) per block

// A row's T sums, one partial per lane of its warp: added across the warp with shuffles (the same
// order in every kernel), and lane 0 writes token t's at out[t * stride].
template <int T>
__device__ __forceinline__ void warp_sum_to(const float (&acc)[T], int lane, float* __restrict__ out, int64_t stride) {
#pragma unroll
  for (int t = 0; t < T; t++) {
    float v = acc[t];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) out[t * stride] = v;
  }
}

template <int BITS, int T>
__global__ void rows_out_kernel(const float* __restrict__ x, AffineMatrix m, float* __restrict__ y) {
  constexpr int kPer = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (n >= m.rows) return;  // n is the warp's: its lanes leave together, before any shuffle
  const int64_t K = m.codes, words = K / kPer, groups = K / m.group;
  const uint32_t* __restrict__ row = m.words + n * words;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; t++) acc[t] = 0.f;
  for (int64_t i = lane; i < words; i += 32) {
    const uint32_t word = __ldg(row + i);
    const int64_t k0 = i * kPer, g = n * groups + k0 / m.group;
    const float s = load_scale(m.scales, m.scale_type, g), b = load_scale(m.biases, m.scale_type, g);
    float dot[T], xs[T];
#pragma unroll
    for (int t = 0; t < T; t++) dot[t] = xs[t] = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; j++) {
      const float code = static_cast<float>((word >> (BITS * j)) & kMask);
#pragma unroll
      for (int t = 0; t < T; t++) {
        const float xv = __ldg(x + t * K + k0 + j);
        dot[t] = fmaf(code, xv, dot[t]);
        xs[t] += xv;
      }
    }
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = fmaf(s, dot[t], fmaf(b, xs[t], acc[t]));
  }
  warp_sum_to(acc, lane, y + n, m.rows);
}

template <int BITS, int T>
__global__ void rows_out_wide_kernel(const float* __restrict__ x, AffineMatrix m, float* __restrict__ y) {
  constexpr int kPer = 32 / BITS;  // codes a word: 16, 8 or 4, a multiple of the 4 a float4 holds
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (n >= m.rows) return;  // n is the warp's: its lanes leave together, before any shuffle
  const int64_t K = m.codes, words = K / kPer, groups = K / m.group, quads = words / 4;
  const uint4* __restrict__ row = reinterpret_cast<const uint4*>(m.words + n * words);
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; t++) acc[t] = 0.f;
#pragma unroll 2
  for (int64_t q = lane; q < quads; q += 32) {
    const uint4 four = __ldg(row + q);
    const uint32_t word4[4] = {four.x, four.y, four.z, four.w};
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const uint32_t word = word4[u];
      const int64_t k0 = (q * 4 + u) * kPer, g = n * groups + k0 / m.group;  // a word never straddles a group
      const float s = load_scale(m.scales, m.scale_type, g), b = load_scale(m.biases, m.scale_type, g);
      float dot[T], xs[T];
#pragma unroll
      for (int t = 0; t < T; t++) dot[t] = xs[t] = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; j += 4) {
        const float c0 = static_cast<float>((word >> (BITS * j)) & kMask);
        const float c1 = static_cast<float>((word >> (BITS * (j + 1))) & kMask);
        const float c2 = static_cast<float>((word >> (BITS * (j + 2))) & kMask);
        const float c3 = static_cast<float>((word >> (BITS * (j + 3))) & kMask);
#pragma unroll
        for (int t = 0; t < T; t++) {
          const float4 xv = __ldg(reinterpret_cast<const float4*>(x + t * K + k0 + j));
          dot[t] = fmaf(c3, xv.w, fmaf(c2, xv.z, fmaf(c1, xv.y, fmaf(c0, xv.x, dot[t]))));
          xs[t] += xv.x;
          xs[t] += xv.y;
          xs[t] += xv.z;
          xs[t] += xv.w;
        }
      }
#pragma unroll
      for (int t = 0; t < T; t++) acc[t] = fmaf(s, dot[t], fmaf(b, xs[t], acc[t]));
    }
  }
  warp_sum_to(acc, lane, y + n, m.rows);
}

// Whether rows_out_wide_kernel's 16-byte loads fit: every row a whole number of uint4s, and the
// words and x (each token's row of K floats) starting on 16 bytes.
bool wide_loads(const float* x, const AffineMatrix& m) {
  const int64_t words = m.codes * m.bits / 32;
  return words % 4 == 0 && m.codes % 4 == 0 && reinterpret_cast<uintptr_t>(m.words) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

template <int BITS, int T>
__global__ void rows_in_kernel(const float* __restrict__ x, AffineMatrix m, float* __restrict__ partial) {
  constexpr int kPer = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, N = m.codes, K = m.rows;
  if (n >= N) return;
  const int64_t k_begin = K * blockIdx.y / kInputChunks, k_end = K * (blockIdx.y + 1) / kInputChunks;
  const int64_t words = N / kPer, groups = N / m.group, g = n / m.group;
  const int shift = BITS * static_cast<int>(n % kPer);
  const uint32_t* __restrict__ column = m.words + n / kPer;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; t++) acc[t] = 0.f;
  for (int64_t k = k_begin; k < k_end; k++) {
    const float code = static_cast<float>((__ldg(column + k * words) >> shift) & kMask);
    const int64_t si = k * groups + g;
    // scale * code is exact in float32 (a <= 8-bit code): one rounding, as the reference's dequantize
    const float w = fmaf(code, load_scale(m.scales, m.scale_type, si), load_scale(m.biases, m.scale_type, si));
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = fmaf(w, __ldg(x + t * K + k), acc[t]);
  }
#pragma unroll
  for (int t = 0; t < T; t++) partial[(static_cast<int64_t>(blockIdx.y) * T + t) * N + n] = acc[t];
}

bool readable(const AffineMatrix& m) {
  return (m.bits == 2 || m.bits == 4 || m.bits == 8) && m.group > 0 && m.group % 32 == 0 && m.codes >= 0 &&
         m.codes % m.group == 0 && m.rows >= 0 && m.scale_type >= 0 && m.scale_type <= 2;
}

template <int BITS, int T>
void launch(const float* x, const AffineMatrix& m, bool rows_are_outputs, float* y, float* scratch,
            cudaStream_t stream) {
  if (rows_are_outputs) {
    const int64_t blocks = (m.rows + kRowsPerBlock - 1) / kRowsPerBlock;
    if (wide_loads(x, m))
      rows_out_wide_kernel<BITS, T><<<static_cast<unsigned>(blocks), kRowsPerBlock * 32, 0, stream>>>(x, m, y);
    else
      rows_out_kernel<BITS, T><<<static_cast<unsigned>(blocks), kRowsPerBlock * 32, 0, stream>>>(x, m, y);
    return;
  }
  const dim3 grid(static_cast<unsigned>((m.codes + kInputThreads - 1) / kInputThreads), kInputChunks);
  rows_in_kernel<BITS, T><<<grid, kInputThreads, 0, stream>>>(x, m, scratch);
  const int64_t n = T * m.codes;
  sum_partials<<<static_cast<unsigned>((n + kInputThreads - 1) / kInputThreads), kInputThreads, 0, stream>>>(
      scratch, kInputChunks, n, y);
}

template <int BITS>
void launch_tokens(int T, const float* x, const AffineMatrix& m, bool rows_are_outputs, float* y, float* scratch,
                   cudaStream_t stream) {
  switch (T) {
#define MF_CASE(N)                                                   \
  case N:                                                            \
    launch<BITS, N>(x, m, rows_are_outputs, y, scratch, stream); \
    break;
    MF_CASE(1) MF_CASE(2) MF_CASE(3) MF_CASE(4) MF_CASE(5) MF_CASE(6) MF_CASE(7) MF_CASE(8)
#undef MF_CASE
  }
}

}  // namespace

int64_t affine_scratch_floats(const AffineMatrix& m, int64_t T, bool rows_are_outputs) {
  return rows_are_outputs ? 0 : static_cast<int64_t>(kInputChunks) * (T < kMatmulTokens ? T : kMatmulTokens) * m.codes;
}

cudaError_t affine_matmul(const float* x, int64_t T, const AffineMatrix& m, bool rows_are_outputs, float* y,
                          float* scratch, cudaStream_t stream) {
  if (!readable(m) || T < 0) return cudaErrorInvalidValue;
  const int64_t k_in = rows_are_outputs ? m.codes : m.rows, n_out = rows_are_outputs ? m.rows : m.codes;
  if (n_out == 0) return cudaSuccess;  // nothing to write (and an empty grid is no launch)
  for (int64_t t0 = 0; t0 < T; t0 += kMatmulTokens) {  // each launch reuses the scratch: one stream orders them
    const int t = static_cast<int>(T - t0 < kMatmulTokens ? T - t0 : kMatmulTokens);
    const float* xt = x + t0 * k_in;
    float* yt = y + t0 * n_out;
    switch (m.bits) {
      case 2: launch_tokens<2>(t, xt, m, rows_are_outputs, yt, scratch, stream); break;
      case 4: launch_tokens<4>(t, xt, m, rows_are_outputs, yt, scratch, stream); break;
      default: launch_tokens<8>(t, xt, m, rows_are_outputs, yt, scratch, stream); break;
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace mf
