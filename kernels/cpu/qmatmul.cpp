// Fused quantized matmul on the CPU: float32 activations times affine group-quantized weights in the
// store's layout (MLX's: w = q * scale + bias, `bits` 2, 4 or 8 (2 on the portable path only), groups of `group` along the packed axis,
// codes packed little-endian into uint32 words), float32 accumulation, no dequantized copy of a weight.
//
//   transposed = 1:  y[T, N] = x[T, K] @ W^T,  W stored [N, K/pack] (rows are outputs; the usual linear)
//   transposed = 0:  y[T, N] = x[T, K] @ W,    W stored [K, N/pack] (rows are inputs; neuron-major down)
//
// Per group the dot product splits as  s * sum(q * x) + b * sum(x),  so codes are only widened to
// float and multiplied, never scaled per element. One source, three instruction sets picked at run
// time from what the CPU reports (AVX-512, AVX2+FMA+F16C, portable C++); the x86 paths are compiled
// with function-level target attributes, so the library itself needs no -m flags and runs anywhere.
// Threads come from a small persistent pool (output columns are split between them); the plain-ops
// reference is kernels/qmatmul_ref.py (mlx_flash.kernels.qmatmul_ref) and tests/kernels/test_qmatmul.py
// compares the two on every path this CPU can run.

// Python.h only gives the library an (empty) module entry point, so that importing every module of
// the package, as tools do, finds a module here; the functions are called through ctypes.
#include <Python.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MF_X86 1
#else
#define MF_X86 0
#endif

namespace {

enum ScaleType { F16 = 0, BF16 = 1, F32 = 2 };

struct Problem {
  const float* x;     // [T, K]
  const uint32_t* w;  // packed codes
  const void* scales;
  const void* biases;
  int scale_type;
  int64_t T, K, N;
  int bits, group;
  float* y;  // [T, N]
  const float* xsum;   // [T, K/group] (transposed only): sum of x over each group
  const float* xperm;  // [T, K] (transposed 4-bit only): x with each 32-block as its 16 even then 16 odd elements
};

// ---- scalar helpers ------------------------------------------------------------------------------
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        exp--;
      }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float load_scale(const void* p, int type, int64_t i) {
  if (type == F32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (type == BF16) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return half_to_float(h);
}

inline int code_at(const uint32_t* row, int bits, int64_t j) {
  const int per = 32 / bits;
  return (row[j / per] >> (bits * (j % per))) & ((1u << bits) - 1);
}

// ---- portable kernels ----------------------------------------------------------------------------
void rows_generic(const Problem& p, int64_t n0, int64_t n1) {  // transposed: outputs n0..n1
  const int64_t words = p.K * p.bits / 32, groups = p.K / p.group;
  for (int64_t n = n0; n < n1; n++) {
    const uint32_t* row = p.w + n * words;
    for (int64_t t = 0; t < p.T; t++) {
      const float* x = p.x + t * p.K;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; g++) {
        float dot = 0.f;
        for (int64_t j = g * p.group; j < (g + 1) * p.group; j++) dot += (float)code_at(row, p.bits, j) * x[j];
        acc += load_scale(p.scales, p.scale_type, n * groups + g) * dot +
               load_scale(p.biases, p.scale_type, n * groups + g) * p.xsum[t * groups + g];
      }
      p.y[t * p.N + n] = acc;
    }
  }
}

void cols_generic(const Problem& p, int64_t n0, int64_t n1) {  // not transposed: outputs n0..n1
  const int64_t words = p.N * p.bits / 32, groups = p.N / p.group;
  for (int64_t t = 0; t < p.T; t++)
    for (int64_t n = n0; n < n1; n++) p.y[t * p.N + n] = 0.f;
  for (int64_t k = 0; k < p.K; k++) {
    const uint32_t* row = p.w + k * words;
    for (int64_t g = n0 / p.group; g < n1 / p.group; g++) {
      const float s = load_scale(p.scales, p.scale_type, k * groups + g);
      const float b = load_scale(p.biases, p.scale_type, k * groups + g);
      for (int64_t t = 0; t < p.T; t++) {
        const float xs = p.x[t * p.K + k] * s, xb = p.x[t * p.K + k] * b;
        float* y = p.y + t * p.N;
        for (int64_t j = g * p.group; j < (g + 1) * p.group; j++) y[j] += xs * (float)code_at(row, p.bits, j) + xb;
      }
    }
  }
}

#if MF_X86
// ---- AVX2 + FMA ----------------------------------------------------------------------------------
__attribute__((target("avx2,fma"))) inline __m256 codes8_avx2(const uint8_t* src, int bits) {
  // 8 consecutive codes as floats: 4-bit from one uint32 word, 8-bit from two.
  if (bits == 4) {
    uint32_t word;
    std::memcpy(&word, src, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  }
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Up to 4 tokens share each decoded group of codes (prefill reuses the widening across tokens).
__attribute__((target("avx2,fma"))) void rows_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.K * p.bits / 8, groups = p.K / p.group;
  const int step_bytes = p.bits;  // bytes holding 8 codes
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(p.w) + n * row_bytes;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      float bias_acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < groups; g++) {
        __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const uint8_t* src = row + g * p.group * p.bits / 8;
        for (int j = 0; j < p.group; j += 8, src += step_bytes) {
          const __m256 c = codes8_avx2(src, p.bits);
          for (int t = 0; t < tn; t++)
            dot[t] = _mm256_fmadd_ps(c, _mm256_loadu_ps(p.x + (t0 + t) * p.K + g * p.group + j), dot[t]);
        }
        const float s = load_scale(p.scales, p.scale_type, n * groups + g);
        const float b = load_scale(p.biases, p.scale_type, n * groups + g);
        const __m256 vs = _mm256_set1_ps(s);
        for (int t = 0; t < tn; t++) {
          acc[t] = _mm256_fmadd_ps(vs, dot[t], acc[t]);
          bias_acc[t] += b * p.xsum[(t0 + t) * groups + g];
        }
      }
      for (int t = 0; t < tn; t++) p.y[(t0 + t) * p.N + n] = hsum_avx2(acc[t]) + bias_acc[t];
    }
  }
}

__attribute__((target("avx2,fma"))) void cols_avx2(const Problem& p, int64_t n0, int64_t n1) {
  // Tokens in tiles of 4, so that the tile's outputs stay in cache while every row of W passes.
  const int64_t row_bytes = p.N * p.bits / 8, groups = p.N / p.group;
  for (int64_t t = 0; t < p.T; t++) std::memset(p.y + t * p.N + n0, 0, (n1 - n0) * sizeof(float));
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t k = 0; k < p.K; k++) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(p.w) + k * row_bytes;
      __m256 xs[4], xb[4];
      for (int64_t g = n0 / p.group; g < n1 / p.group; g++) {
        const float s = load_scale(p.scales, p.scale_type, k * groups + g);
        const float b = load_scale(p.biases, p.scale_type, k * groups + g);
        for (int t = 0; t < tn; t++) {
          const float xv = p.x[(t0 + t) * p.K + k];
          xs[t] = _mm256_set1_ps(xv * s);
          xb[t] = _mm256_set1_ps(xv * b);
        }
        const uint8_t* src = row + g * p.group * p.bits / 8;
        for (int j = 0; j < p.group; j += 8, src += p.bits) {
          const __m256 c = codes8_avx2(src, p.bits);
          for (int t = 0; t < tn; t++) {
            float* y = p.y + (t0 + t) * p.N + g * p.group + j;
            _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), _mm256_fmadd_ps(c, xs[t], xb[t])));
          }
        }
      }
    }
  }
}

// 4-bit rows, groups a multiple of 32: byte i of a 32-code block holds codes 2i (low nibble) and 2i+1
// (high nibble), so masking and shifting the 16 bytes gives the even and the odd codes in order, to
// be multiplied by x permuted the same way (xperm). Per-row scales are widened once per row.
__attribute__((target("avx2,fma,f16c"))) void row_scales(const Problem& p, int64_t n, float* sc, float* bi) {
  const int64_t groups = p.K / p.group;
  if (p.scale_type == F16) {
    const uint16_t* s = static_cast<const uint16_t*>(p.scales) + n * groups;
    const uint16_t* b = static_cast<const uint16_t*>(p.biases) + n * groups;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      _mm256_storeu_ps(sc + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g))));
      _mm256_storeu_ps(bi + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + g))));
    }
    for (; g < groups; g++) {
      sc[g] = _cvtsh_ss(s[g]);
      bi[g] = _cvtsh_ss(b[g]);
    }
    return;
  }
  for (int64_t g = 0; g < groups; g++) {
    sc[g] = load_scale(p.scales, p.scale_type, n * groups + g);
    bi[g] = load_scale(p.biases, p.scale_type, n * groups + g);
  }
}

__attribute__((target("avx2,fma,f16c"))) void rows4_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.K / 2, groups = p.K / p.group, blocks = p.group / 32;
  thread_local std::vector<float> sc, bi;
  sc.resize(groups);
  bi.resize(groups);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      row_scales(p, n, sc.data(), bi.data());
      const uint8_t* src = reinterpret_cast<const uint8_t*>(p.w) + n * row_bytes;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t g = 0; g < groups; g++) {
        __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t blk = 0; blk < blocks; blk++, src += 16) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
          const __m128i ev = _mm_and_si128(v, low), od = _mm_and_si128(_mm_srli_epi16(v, 4), low);
          const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ev));
          const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ev, 8)));
          const __m256 c2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(od));
          const __m256 c3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(od, 8)));
          for (int t = 0; t < tn; t++) {
            const float* xp = p.xperm + (t0 + t) * p.K + (g * p.group + blk * 32);
            dot[t] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(xp), dot[t]);
            dot[t] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xp + 8), dot[t]);
            dot[t] = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xp + 16), dot[t]);
            dot[t] = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xp + 24), dot[t]);
          }
        }
        const __m256 vs = _mm256_set1_ps(sc[g]);
        for (int t = 0; t < tn; t++) acc[t] = _mm256_fmadd_ps(vs, dot[t], acc[t]);
      }
      for (int t = 0; t < tn; t++) {
        float bias = 0.f;
        const float* xs = p.xsum + (t0 + t) * groups;
        for (int64_t g = 0; g < groups; g++) bias += bi[g] * xs[g];
        p.y[(t0 + t) * p.N + n] = hsum_avx2(acc[t]) + bias;
      }
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) inline float scale_f16c(const void* p, int type, int64_t i) {
  return type == F16 ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : load_scale(p, type, i);
}
// ---- AVX2, many tokens (prefill): the same tiles as the AVX-512 path below, 8 lanes wide ---------
__attribute__((target("avx2,fma,f16c"))) void widen_block_avx2(const uint8_t* src, int bits, float s, float b,
                                                                 float* dst, int64_t count) {
  const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  if (bits == 4) {  // each 32-block as its 16 even then 16 odd codes (the order of xperm)
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t j = 0; j < count; j += 32, src += 16, dst += 32) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i ev = _mm_and_si128(v, low), od = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      const __m128i parts[4] = {ev, _mm_srli_si128(ev, 8), od, _mm_srli_si128(od, 8)};
      for (int i = 0; i < 4; i++)
        _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vs, vb));
    }
    return;
  }
  for (int64_t j = 0; j < count; j += 8, src += 8, dst += 8) {
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
    _mm256_storeu_ps(dst, _mm256_fmadd_ps(c, vs, vb));
  }
}

template <int TN, int RN>
__attribute__((target("avx2,fma,f16c"))) inline void block_dots_avx2(const float* x, int64_t x_stride,
                                                                      const float* tile, int64_t K, float* y,
                                                                      int64_t y_stride) {
  __m256 acc[TN][RN];
  for (int t = 0; t < TN; t++)
    for (int r = 0; r < RN; r++) acc[t][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[RN];
    for (int r = 0; r < RN; r++) w[r] = _mm256_loadu_ps(tile + r * K + k);
    for (int t = 0; t < TN; t++) {
      const __m256 xv = _mm256_loadu_ps(x + t * x_stride + k);
      for (int r = 0; r < RN; r++) acc[t][r] = _mm256_fmadd_ps(xv, w[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TN; t++)
    for (int r = 0; r < RN; r++) y[t * y_stride + r] = hsum_avx2(acc[t][r]);
}

template <int RN>
__attribute__((target("avx2,fma,f16c"))) inline void token_blocks_avx2(const Problem& p, const float* xs,
                                                                        const float* tile, int64_t n) {
  int64_t t = 0;
  for (; t + 3 <= p.T; t += 3) block_dots_avx2<3, RN>(xs + t * p.K, p.K, tile, p.K, p.y + t * p.N + n, p.N);
  for (; t < p.T; t++) block_dots_avx2<1, RN>(xs + t * p.K, p.K, tile, p.K, p.y + t * p.N + n, p.N);
}

__attribute__((target("avx2,fma,f16c"))) void rows_tiled_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / p.group, row_bytes = p.K * p.bits / 8;
  const float* xs = p.bits == 4 ? p.xperm : p.x;
  thread_local std::vector<float> tile, sc, bi;
  tile.resize(4 * p.K);
  sc.resize(groups);
  bi.resize(groups);
  for (int64_t n = n0; n < n1; n += 4) {
    const int rn = (int)(n1 - n < 4 ? n1 - n : 4);
    for (int r = 0; r < rn; r++) {
      row_scales(p, n + r, sc.data(), bi.data());
      const uint8_t* row = reinterpret_cast<const uint8_t*>(p.w) + (n + r) * row_bytes;
      for (int64_t g = 0; g < groups; g++)
        widen_block_avx2(row + g * p.group * p.bits / 8, p.bits, sc[g], bi[g], tile.data() + r * p.K + g * p.group,
                         p.group);
    }
    switch (rn) {
      case 4: token_blocks_avx2<4>(p, xs, tile.data(), n); break;
      case 3: token_blocks_avx2<3>(p, xs, tile.data(), n); break;
      case 2: token_blocks_avx2<2>(p, xs, tile.data(), n); break;
      default: token_blocks_avx2<1>(p, xs, tile.data(), n); break;
    }
  }
}

template <int TN>
__attribute__((target("avx2,fma,f16c"))) inline void column_block_dots_avx2(const float* x, int64_t K,
                                                                             const float* tile, float* y, int64_t N,
                                                                             bool paired) {
  __m256 acc[TN][4];
  for (int t = 0; t < TN; t++)
    for (int v = 0; v < 4; v++) acc[t][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    __m256 w[4];
    for (int v = 0; v < 4; v++) w[v] = _mm256_loadu_ps(tile + k * 32 + 8 * v);
    for (int t = 0; t < TN; t++) {
      const __m256 xv = _mm256_set1_ps(x[t * K + k]);
      for (int v = 0; v < 4; v++) acc[t][v] = _mm256_fmadd_ps(xv, w[v], acc[t][v]);
    }
  }
  for (int t = 0; t < TN; t++) {
    alignas(32) float out[32];
    for (int v = 0; v < 4; v++) _mm256_store_ps(out + 8 * v, acc[t][v]);
    for (int i = 0; i < 16; i++) {
      if (paired) {  // even then odd codes: interleave back
        y[t * N + 2 * i] = out[i];
        y[t * N + 2 * i + 1] = out[16 + i];
      } else {
        y[t * N + i] = out[i];
        y[t * N + 16 + i] = out[16 + i];
      }
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) void cols_tiled_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.N / p.group, row_bytes = p.N * p.bits / 8;
  thread_local std::vector<float> tile;
  tile.resize(p.K * 32);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w);
  for (int64_t c = n0; c < n1; c += 32) {
    const int64_t g = c / p.group;
    for (int64_t k = 0; k < p.K; k++)
      widen_block_avx2(w + k * row_bytes + c * p.bits / 8, p.bits, scale_f16c(p.scales, p.scale_type, k * groups + g),
                       scale_f16c(p.biases, p.scale_type, k * groups + g), tile.data() + k * 32, 32);
    const bool paired = p.bits == 4;
    int64_t t = 0;
    for (; t + 2 <= p.T; t += 2)
      column_block_dots_avx2<2>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
    for (; t < p.T; t++) column_block_dots_avx2<1>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
  }
}

// ---- AVX2, one token (decode): 4 rows share every load of x; neuron-major rows fold scale into x --
template <int BITS>
__attribute__((target("avx2,fma,f16c"))) inline void widen32_avx2(const uint8_t* src, __m256* c) {
  // 32 codes as four 8-float vectors: 4-bit as even then odd codes, 8-bit in order
  if (BITS == 4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i ev = _mm_and_si128(v, low), od = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ev));
    c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ev, 8)));
    c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(od));
    c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(od, 8)));
    return;
  }
  for (int i = 0; i < 4; i++)
    c[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i))));
}

template <int RN, int BITS>
__attribute__((target("avx2,fma,f16c"))) inline void rows_matvec_avx2(const Problem& p, int64_t n, float* const* sc,
                                                                       float* const* bi) {
  const int64_t row_bytes = p.K * BITS / 8, groups = p.K / p.group, blocks = p.group / 32;
  const float* x = BITS == 4 ? p.xperm : p.x;
  const uint8_t* src[RN];
  __m256 acc[RN];
  for (int r = 0; r < RN; r++) {
    row_scales(p, n + r, sc[r], bi[r]);
    src[r] = reinterpret_cast<const uint8_t*>(p.w) + (n + r) * row_bytes;
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; g++) {
    __m256 dot[RN];
    for (int r = 0; r < RN; r++) dot[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < blocks; blk++) {
      const float* xp = x + g * p.group + blk * 32;
      __m256 xv[4];
      for (int i = 0; i < 4; i++) xv[i] = _mm256_loadu_ps(xp + 8 * i);
      for (int r = 0; r < RN; r++) {
        __m256 c[4];
        widen32_avx2<BITS>(src[r], c);
        src[r] += BITS * 4;
        for (int i = 0; i < 4; i++) dot[r] = _mm256_fmadd_ps(c[i], xv[i], dot[r]);
      }
    }
    for (int r = 0; r < RN; r++) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r][g]), dot[r], acc[r]);
  }
  for (int r = 0; r < RN; r++) {
    float bias = 0.f;
    for (int64_t g = 0; g < groups; g++) bias += bi[r][g] * p.xsum[g];
    p.y[n + r] = hsum_avx2(acc[r]) + bias;
  }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void rows_decode_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / p.group;
  thread_local std::vector<float> scratch;
  scratch.resize(8 * groups);
  float* sc[4] = {scratch.data(), scratch.data() + groups, scratch.data() + 2 * groups, scratch.data() + 3 * groups};
  float* bi[4] = {sc[3] + groups, sc[3] + 2 * groups, sc[3] + 3 * groups, sc[3] + 4 * groups};
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_matvec_avx2<4, BITS>(p, n, sc, bi);
  for (; n < n1; n++) rows_matvec_avx2<1, BITS>(p, n, sc, bi);
}

template <int BITS, int NB>
__attribute__((target("avx2,fma,f16c"))) inline void cols_matvec_avx2(const Problem& p, int64_t c) {
  const int64_t row_bytes = p.N * BITS / 8, groups = p.N / p.group;
  __m256 acc[NB][4];
  float bias[NB];
  int64_t g[NB];
  for (int j = 0; j < NB; j++) {
    for (int i = 0; i < 4; i++) acc[j][i] = _mm256_setzero_ps();
    bias[j] = 0.f;
    g[j] = (c + 32 * j) / p.group;
  }
  const uint8_t* src = reinterpret_cast<const uint8_t*>(p.w) + c * BITS / 8;
  for (int64_t k = 0; k < p.K; k++, src += row_bytes) {
    const float xk = p.x[k];
    for (int j = 0; j < NB; j++) {
      const __m256 xs = _mm256_set1_ps(xk * scale_f16c(p.scales, p.scale_type, k * groups + g[j]));
      bias[j] += xk * scale_f16c(p.biases, p.scale_type, k * groups + g[j]);
      __m256 cv[4];
      widen32_avx2<BITS>(src + j * BITS * 4, cv);
      for (int i = 0; i < 4; i++) acc[j][i] = _mm256_fmadd_ps(xs, cv[i], acc[j][i]);
    }
  }
  for (int j = 0; j < NB; j++) {
    alignas(32) float out[32];
    for (int i = 0; i < 4; i++) _mm256_store_ps(out + 8 * i, acc[j][i]);
    float* y = p.y + c + 32 * j;
    for (int i = 0; i < 16; i++) {
      if (BITS == 4) {  // even then odd codes: interleave back
        y[2 * i] = out[i] + bias[j];
        y[2 * i + 1] = out[16 + i] + bias[j];
      } else {
        y[i] = out[i] + bias[j];
        y[16 + i] = out[16 + i] + bias[j];
      }
    }
  }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void cols_decode_avx2(const Problem& p, int64_t n0, int64_t n1) {
  int64_t c = n0;
  for (; c + 64 <= n1; c += 64) cols_matvec_avx2<BITS, 2>(p, c);
  for (; c < n1; c += 32) cols_matvec_avx2<BITS, 1>(p, c);
}

// ---- AVX-512 -------------------------------------------------------------------------------------
__attribute__((target("avx512f,avx512bw"))) inline __m512 codes16_avx512(const uint8_t* src, int bits) {
  // 16 consecutive codes as floats: 4-bit from two uint32 words, 8-bit from four.
  if (bits == 4) {
    uint64_t words;
    std::memcpy(&words, src, 8);
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    __m512i v = _mm512_permutexvar_epi32(pick, _mm512_set1_epi64((long long)words));
    v = _mm512_srlv_epi32(v, shifts);
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  }
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}

__attribute__((target("avx512f,avx512bw"))) void rows_avx512(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.K * p.bits / 8, groups = p.K / p.group;
  const int step_bytes = 2 * p.bits;  // bytes holding 16 codes
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(p.w) + n * row_bytes;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      float bias_acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < groups; g++) {
        __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        const uint8_t* src = row + g * p.group * p.bits / 8;
        for (int j = 0; j < p.group; j += 16, src += step_bytes) {
          const __m512 c = codes16_avx512(src, p.bits);
          for (int t = 0; t < tn; t++)
            dot[t] = _mm512_fmadd_ps(c, _mm512_loadu_ps(p.x + (t0 + t) * p.K + g * p.group + j), dot[t]);
        }
        const float s = load_scale(p.scales, p.scale_type, n * groups + g);
        const float b = load_scale(p.biases, p.scale_type, n * groups + g);
        const __m512 vs = _mm512_set1_ps(s);
        for (int t = 0; t < tn; t++) {
          acc[t] = _mm512_fmadd_ps(vs, dot[t], acc[t]);
          bias_acc[t] += b * p.xsum[(t0 + t) * groups + g];
        }
      }
      for (int t = 0; t < tn; t++) p.y[(t0 + t) * p.N + n] = _mm512_reduce_add_ps(acc[t]) + bias_acc[t];
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void rows4_avx512(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.K / 2, groups = p.K / p.group, blocks = p.group / 32;
  thread_local std::vector<float> sc, bi;
  sc.resize(groups);
  bi.resize(groups);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      row_scales(p, n, sc.data(), bi.data());
      const uint8_t* src = reinterpret_cast<const uint8_t*>(p.w) + n * row_bytes;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t g = 0; g < groups; g++) {
        __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t blk = 0; blk < blocks; blk++, src += 16) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
          const __m512 ev = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
          const __m512 od = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
          for (int t = 0; t < tn; t++) {
            const float* xp = p.xperm + (t0 + t) * p.K + (g * p.group + blk * 32);
            dot[t] = _mm512_fmadd_ps(ev, _mm512_loadu_ps(xp), dot[t]);
            dot[t] = _mm512_fmadd_ps(od, _mm512_loadu_ps(xp + 16), dot[t]);
          }
        }
        const __m512 vs = _mm512_set1_ps(sc[g]);
        for (int t = 0; t < tn; t++) acc[t] = _mm512_fmadd_ps(vs, dot[t], acc[t]);
      }
      for (int t = 0; t < tn; t++) {
        float bias = 0.f;
        const float* xs = p.xsum + (t0 + t) * groups;
        for (int64_t g = 0; g < groups; g++) bias += bi[g] * xs[g];
        p.y[(t0 + t) * p.N + n] = _mm512_reduce_add_ps(acc[t]) + bias;
      }
    }
  }
}

// Decode (one token): RN rows at once share every load of x and give the CPU RN independent chains
// of multiply-adds (one row alone waits on its own accumulator once per group). 4-bit codes come as
// a 32-block's even then odd codes (x read as xperm), 8-bit ones in order (x as is).
template <int RN, int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void rows_matvec_avx512(const Problem& p, int64_t n,
                                                                                          float* const* sc,
                                                                                          float* const* bi) {
  const int64_t row_bytes = p.K * BITS / 8, groups = p.K / p.group, blocks = p.group / 32;
  const __m128i low = _mm_set1_epi8(0x0F);
  const float* x = BITS == 4 ? p.xperm : p.x;
  const uint8_t* src[RN];
  __m512 acc[RN];
  for (int r = 0; r < RN; r++) {
    row_scales(p, n + r, sc[r], bi[r]);
    src[r] = reinterpret_cast<const uint8_t*>(p.w) + (n + r) * row_bytes;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; g++) {
    __m512 dot[RN];
    for (int r = 0; r < RN; r++) dot[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; blk++) {
      const float* xp = x + g * p.group + blk * 32;
      const __m512 x0 = _mm512_loadu_ps(xp), x1 = _mm512_loadu_ps(xp + 16);
      for (int r = 0; r < RN; r++) {
        __m512 c0, c1;
        if (BITS == 4) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r]));
          c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
          c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
        } else {
          c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r]))));
          c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r] + 16))));
        }
        src[r] += BITS * 4;  // bytes of 32 codes
        dot[r] = _mm512_fmadd_ps(c0, x0, dot[r]);
        dot[r] = _mm512_fmadd_ps(c1, x1, dot[r]);
      }
    }
    for (int r = 0; r < RN; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r][g]), dot[r], acc[r]);
  }
  for (int r = 0; r < RN; r++) {
    float bias = 0.f;
    for (int64_t g = 0; g < groups; g++) bias += bi[r][g] * p.xsum[g];
    p.y[n + r] = _mm512_reduce_add_ps(acc[r]) + bias;
  }
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void rows_decode_avx512(const Problem& p, int64_t n0,
                                                                                    int64_t n1) {
  const int64_t groups = p.K / p.group;
  thread_local std::vector<float> scratch;
  scratch.resize(8 * groups);
  float* sc[4] = {scratch.data(), scratch.data() + groups, scratch.data() + 2 * groups, scratch.data() + 3 * groups};
  float* bi[4] = {sc[3] + groups, sc[3] + 2 * groups, sc[3] + 3 * groups, sc[3] + 4 * groups};
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_matvec_avx512<4, BITS>(p, n, sc, bi);
  for (; n < n1; n++) rows_matvec_avx512<1, BITS>(p, n, sc, bi);
}

__attribute__((target("avx512f,avx512bw"))) void cols_avx512(const Problem& p, int64_t n0, int64_t n1) {
  // Tokens in tiles of 4, so that the tile's outputs stay in cache while every row of W passes.
  const int64_t row_bytes = p.N * p.bits / 8, groups = p.N / p.group;
  for (int64_t t = 0; t < p.T; t++) std::memset(p.y + t * p.N + n0, 0, (n1 - n0) * sizeof(float));
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t k = 0; k < p.K; k++) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(p.w) + k * row_bytes;
      __m512 xs[4], xb[4];
      for (int64_t g = n0 / p.group; g < n1 / p.group; g++) {
        const float s = load_scale(p.scales, p.scale_type, k * groups + g);
        const float b = load_scale(p.biases, p.scale_type, k * groups + g);
        for (int t = 0; t < tn; t++) {
          const float xv = p.x[(t0 + t) * p.K + k];
          xs[t] = _mm512_set1_ps(xv * s);
          xb[t] = _mm512_set1_ps(xv * b);
        }
        const uint8_t* src = row + g * p.group * p.bits / 8;
        for (int j = 0; j < p.group; j += 16, src += 2 * p.bits) {
          const __m512 c = codes16_avx512(src, p.bits);
          for (int t = 0; t < tn; t++) {
            float* y = p.y + (t0 + t) * p.N + g * p.group + j;
            _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_fmadd_ps(c, xs[t], xb[t])));
          }
        }
      }
    }
  }
}
// ---- AVX-512, many tokens (prefill): decode a tile of weights to float once, reuse it per token ----
// With T >= 4 the work per weight is T multiply-adds, so widening codes in the inner loop no longer
// pays; instead a few rows (or a 64-column block) are widened into a small per-thread float tile,
// in the order x is read (4-bit: each 32-block as its even then odd codes, matching xperm), and a
// 4-token x 4-row register block multiplies them. The tile is scratch the size of a few rows: no
// copy of the weight matrix exists.
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void widen_block_avx512(const uint8_t* src, int bits,
                                                                                    float s, float b, float* dst,
                                                                                    int64_t count) {
  // `count` codes (a multiple of 32) of one row, one group's scale and bias, into dst.
  const __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
  if (bits == 4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t j = 0; j < count; j += 32, src += 16, dst += 32) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m512 ev = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
      const __m512 od = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(ev, vs, vb));
      _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(od, vs, vb));
    }
    return;
  }
  for (int64_t j = 0; j < count; j += 16, src += 16, dst += 16) {
    const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(c, vs, vb));
  }
}

template <int TN, int RN>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void block_dots_avx512(
    const float* x, int64_t x_stride, const float* tile, int64_t K, float* y, int64_t y_stride) {
  // y[t * y_stride + r] = dot(x[t], tile[r]) for TN tokens and RN tile rows (each K floats).
  __m512 acc[TN][RN];
  for (int t = 0; t < TN; t++)
    for (int r = 0; r < RN; r++) acc[t][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[RN];
    for (int r = 0; r < RN; r++) w[r] = _mm512_loadu_ps(tile + r * K + k);
    for (int t = 0; t < TN; t++) {
      const __m512 xv = _mm512_loadu_ps(x + t * x_stride + k);
      for (int r = 0; r < RN; r++) acc[t][r] = _mm512_fmadd_ps(xv, w[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TN; t++)
    for (int r = 0; r < RN; r++) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[t][r]);
}

template <int RN>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void token_blocks_avx512(
    const Problem& p, const float* xs, const float* tile, int64_t n) {
  int64_t t = 0;
  for (; t + 4 <= p.T; t += 4) block_dots_avx512<4, RN>(xs + t * p.K, p.K, tile, p.K, p.y + t * p.N + n, p.N);
  for (; t < p.T; t++) block_dots_avx512<1, RN>(xs + t * p.K, p.K, tile, p.K, p.y + t * p.N + n, p.N);
}

__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void rows_tiled_avx512(const Problem& p, int64_t n0,
                                                                                   int64_t n1) {
  const int64_t groups = p.K / p.group, row_bytes = p.K * p.bits / 8;
  const float* xs = p.bits == 4 ? p.xperm : p.x;  // the order the tile is widened in
  thread_local std::vector<float> tile, sc, bi;
  tile.resize(4 * p.K);
  sc.resize(groups);
  bi.resize(groups);
  for (int64_t n = n0; n < n1; n += 4) {
    const int rn = (int)(n1 - n < 4 ? n1 - n : 4);
    for (int r = 0; r < rn; r++) {
      row_scales(p, n + r, sc.data(), bi.data());
      const uint8_t* row = reinterpret_cast<const uint8_t*>(p.w) + (n + r) * row_bytes;
      for (int64_t g = 0; g < groups; g++)
        widen_block_avx512(row + g * p.group * p.bits / 8, p.bits, sc[g], bi[g], tile.data() + r * p.K + g * p.group,
                           p.group);
    }
    switch (rn) {
      case 4: token_blocks_avx512<4>(p, xs, tile.data(), n); break;
      case 3: token_blocks_avx512<3>(p, xs, tile.data(), n); break;
      case 2: token_blocks_avx512<2>(p, xs, tile.data(), n); break;
      default: token_blocks_avx512<1>(p, xs, tile.data(), n); break;
    }
  }
}

template <int TN>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void column_block_dots_avx512(
    const float* x, int64_t K, const float* tile, float* y, int64_t N, bool paired) {
  // y[t, 0:32] = x[t] @ tile (tile [K, 32]); `paired`: tile columns are a 32-block's even then odd codes.
  __m512 acc[TN][2];
  for (int t = 0; t < TN; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const __m512 w0 = _mm512_loadu_ps(tile + k * 32), w1 = _mm512_loadu_ps(tile + k * 32 + 16);
    for (int t = 0; t < TN; t++) {
      const __m512 xv = _mm512_set1_ps(x[t * K + k]);
      acc[t][0] = _mm512_fmadd_ps(xv, w0, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(xv, w1, acc[t][1]);
    }
  }
  for (int t = 0; t < TN; t++) {
    if (!paired) {
      _mm512_storeu_ps(y + t * N, acc[t][0]);
      _mm512_storeu_ps(y + t * N + 16, acc[t][1]);
      continue;
    }
    alignas(64) float even[16], odd[16];
    _mm512_store_ps(even, acc[t][0]);
    _mm512_store_ps(odd, acc[t][1]);
    for (int i = 0; i < 16; i++) {
      y[t * N + 2 * i] = even[i];
      y[t * N + 2 * i + 1] = odd[i];
    }
  }
}

// Neuron-major weights (rows are inputs) with many tokens: widen one 32-column block of every row,
// then multiply it by up to 8 tokens at a time.
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void cols_tiled_avx512(const Problem& p, int64_t n0,
                                                                                   int64_t n1) {
  const int64_t groups = p.N / p.group, row_bytes = p.N * p.bits / 8;
  thread_local std::vector<float> tile;
  tile.resize(p.K * 32);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w);
  for (int64_t c = n0; c < n1; c += 32) {
    const int64_t g = c / p.group;
    for (int64_t k = 0; k < p.K; k++)
      widen_block_avx512(w + k * row_bytes + c * p.bits / 8, p.bits, scale_f16c(p.scales, p.scale_type, k * groups + g),
                         scale_f16c(p.biases, p.scale_type, k * groups + g), tile.data() + k * 32, 32);
    const bool paired = p.bits == 4;
    int64_t t = 0;
    for (; t + 8 <= p.T; t += 8)
      column_block_dots_avx512<8>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
    for (; t + 4 <= p.T; t += 4)
      column_block_dots_avx512<4>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
    for (; t < p.T; t++) column_block_dots_avx512<1>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
  }
}
// Decode (one token), neuron-major weights: y[c] = sum_k (x_k s_kg) q_kc + sum_k x_k b_kg, so each
// code costs one multiply-add with a broadcast and each bias one scalar per row. NB 32-column blocks
// (up to 4: 128 bytes of an 8-bit row) go together, reading each row's codes as one run.
template <int BITS, int NB>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void cols_matvec_avx512(const Problem& p, int64_t c) {
  const int64_t row_bytes = p.N * BITS / 8, groups = p.N / p.group;
  const __m128i low = _mm_set1_epi8(0x0F);
  __m512 acc[NB][2];
  float bias[NB];
  int64_t g[NB];
  for (int j = 0; j < NB; j++) {
    acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    bias[j] = 0.f;
    g[j] = (c + 32 * j) / p.group;
  }
  const uint8_t* src = reinterpret_cast<const uint8_t*>(p.w) + c * BITS / 8;
  for (int64_t k = 0; k < p.K; k++, src += row_bytes) {
    const float xk = p.x[k];
    for (int j = 0; j < NB; j++) {
      const __m512 xs = _mm512_set1_ps(xk * scale_f16c(p.scales, p.scale_type, k * groups + g[j]));
      bias[j] += xk * scale_f16c(p.biases, p.scale_type, k * groups + g[j]);
      const uint8_t* b = src + j * BITS * 4;
      __m512 c0, c1;
      if (BITS == 4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
        c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
        c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
      } else {
        c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
        c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16))));
      }
      acc[j][0] = _mm512_fmadd_ps(xs, c0, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(xs, c1, acc[j][1]);
    }
  }
  for (int j = 0; j < NB; j++) {
    const __m512 vb = _mm512_set1_ps(bias[j]);
    float* y = p.y + c + 32 * j;
    if (BITS == 8) {
      _mm512_storeu_ps(y, _mm512_add_ps(acc[j][0], vb));
      _mm512_storeu_ps(y + 16, _mm512_add_ps(acc[j][1], vb));
    } else {  // even then odd codes: interleave back
      alignas(64) float even[16], odd[16];
      _mm512_store_ps(even, _mm512_add_ps(acc[j][0], vb));
      _mm512_store_ps(odd, _mm512_add_ps(acc[j][1], vb));
      for (int i = 0; i < 16; i++) {
        y[2 * i] = even[i];
        y[2 * i + 1] = odd[i];
      }
    }
  }
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void cols_decode_avx512(const Problem& p, int64_t n0,
                                                                                    int64_t n1) {
  int64_t c = n0;
  for (; c + 128 <= n1; c += 128) cols_matvec_avx512<BITS, 4>(p, c);
  for (; c < n1; c += 32) cols_matvec_avx512<BITS, 1>(p, c);
}
#endif

// ---- instruction set ------------------------------------------------------------------------------
enum Isa { GENERIC = 0, AVX2 = 1, AVX512 = 2 };

int detect_isa() {
#if MF_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return AVX512;
  if (avx2) return AVX2;
#endif
  return GENERIC;
}

int g_isa = detect_isa();

void run_range(const Problem& p, int transposed, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
#if MF_X86
  if (p.bits == 2) return transposed ? rows_generic(p, n0, n1) : cols_generic(p, n0, n1);  // no SIMD path yet
  // Prefill (4+ tokens) on AVX-512: widen a few rows to float once and reuse them across tokens.
  if (g_isa == AVX512 && p.T >= 4 && p.group % 32 == 0)
    return transposed ? rows_tiled_avx512(p, n0, n1) : cols_tiled_avx512(p, n0, n1);
  if (g_isa == AVX2 && p.T >= 4 && p.group % 32 == 0)
    return transposed ? rows_tiled_avx2(p, n0, n1) : cols_tiled_avx2(p, n0, n1);
  if (g_isa == AVX2 && p.T == 1 && p.group % 32 == 0) {
    if (transposed) return p.bits == 4 ? rows_decode_avx2<4>(p, n0, n1) : rows_decode_avx2<8>(p, n0, n1);
    return p.bits == 4 ? cols_decode_avx2<4>(p, n0, n1) : cols_decode_avx2<8>(p, n0, n1);
  }
  if (g_isa == AVX512 && p.T == 1 && p.group % 32 == 0) {
    if (transposed) return p.bits == 4 ? rows_decode_avx512<4>(p, n0, n1) : rows_decode_avx512<8>(p, n0, n1);
    return p.bits == 4 ? cols_decode_avx512<4>(p, n0, n1) : cols_decode_avx512<8>(p, n0, n1);
  }
  if (g_isa >= AVX2 && transposed && p.bits == 4 && p.group % 32 == 0)
    return g_isa == AVX512 ? rows4_avx512(p, n0, n1) : rows4_avx2(p, n0, n1);
  // The SIMD loops take 16 (AVX-512) or 8 (AVX2) codes at a time inside a group.
  if (g_isa == AVX512 && p.group % 16 == 0) return transposed ? rows_avx512(p, n0, n1) : cols_avx512(p, n0, n1);
  if (g_isa >= AVX2 && p.group % 8 == 0) return transposed ? rows_avx2(p, n0, n1) : cols_avx2(p, n0, n1);
#endif
  transposed ? rows_generic(p, n0, n1) : cols_generic(p, n0, n1);
}

// ---- thread pool ---------------------------------------------------------------------------------
// Workers spin for up to 2 ms for the next job (a decode step's products come every few tens of
// microseconds, between attention ops that run on the calling thread; waking a sleeping thread costs
// more than a small product), then sleep on a condition variable so an idle engine costs no CPU. Threads do not
// survive fork(): a forked child computes on its calling thread alone.
inline void cpu_relax() {
#if MF_X86
  _mm_pause();
#endif
}

class Pool {
 public:
  ~Pool() { resize(0); }

  void resize(int workers) {
    if ((int)threads_.size() == workers && owner_ == getpid()) return;
    if (owner_ == getpid()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_.store(true);
        generation_.fetch_add(1);
      }
      cv_.notify_all();
      for (auto& t : threads_) t.join();
    } else {
      for (auto& t : threads_) t.detach();  // the parent's threads: not in this process
    }
    threads_.clear();
    stop_.store(false);
    owner_ = getpid();
    // A worker starts from the generation at its creation, not at its first instruction: a job
    // posted before it gets to run must still count as new.
    const uint64_t now = generation_.load();
    for (int i = 0; i < workers; i++) threads_.emplace_back([this, i, now] { loop(i + 1, now); });
  }

  // Run fn(part) for part in 0..parts-1; part 0 on the calling thread.
  template <class F>
  void run(int parts, F&& fn) {
    if (parts <= 1 || (int)threads_.size() < parts - 1 || owner_ != getpid()) {
      for (int part = 0; part < parts; part++) fn(part);
      return;
    }
    job_ = [&fn](int part) { fn(part); };
    parts_ = parts;
    pending_.store(parts - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
  }

  int workers() const { return owner_ == getpid() ? (int)threads_.size() : 0; }

 private:
  void loop(int part, uint64_t seen) {
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; generation_.load(std::memory_order_acquire) == seen; i++) {
        cpu_relax();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(2000)) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return generation_.load() != seen; });
        }
      }
      seen = generation_.load();
      if (stop_.load()) return;
      if (part < parts_) {
        job_(part);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::function<void(int)> job_;
  int parts_ = 0;
  pid_t owner_ = getpid();
};

Pool g_pool;
std::mutex g_call_mu;  // one matmul at a time uses the pool

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// Bumped whenever an exported signature or the layout it reads changes; the binding refuses a
// library whose number differs from its own (a checkout updated without reinstalling).
MF_EXPORT int mf_abi_version() { return 1; }  // unchanged: same signatures, same layout

// Which code path run_range takes on this CPU: 0 portable, 1 AVX2+FMA+F16C, 2 AVX-512 (F, BW).
MF_EXPORT int mf_cpu_isa() { return g_isa; }

// Force a path (tests compare every path this CPU can run); returns the previous one, or -1 if the
// CPU cannot run the one asked for.
MF_EXPORT int mf_set_isa(int isa) {
  if (isa < 0 || isa > detect_isa()) return -1;
  int old = g_isa;
  g_isa = isa;
  return old;
}

// y = x @ W^T (transposed) or x @ W, see the top of this file. Returns 0, or a negative code for bad arguments (checked
// again in Python, which names them).
MF_EXPORT int mf_qmatmul(const float* x, int64_t T, int64_t K, const uint32_t* w, const void* scales, const void* biases,
               int scale_type, int64_t N, int bits, int group, int transposed, float* y, int threads) {
  if (bits != 2 && bits != 4 && bits != 8) return -1;
  if (group <= 0 || group % 8 != 0) return -2;
  const int64_t packed = transposed ? K : N;
  if (packed % group != 0) return -3;
  if (scale_type < F16 || scale_type > F32) return -4;
  std::lock_guard<std::mutex> lock(g_call_mu);
  static std::vector<float> xsum, xperm;  // scratch, reused across calls (one call at a time)
  if (transposed) {
    const int64_t groups = K / group;
    xsum.resize(T * groups);
    if (bits == 4 && group % 32 == 0) {
      xperm.resize(T * K);
      for (int64_t i = 0; i < T * K; i += 32)
        for (int j = 0; j < 16; j++) {
          xperm[i + j] = x[i + 2 * j];
          xperm[i + 16 + j] = x[i + 2 * j + 1];
        }
    }
    for (int64_t t = 0; t < T; t++)
      for (int64_t g = 0; g < groups; g++) {
        float s = 0.f;
        for (int64_t j = g * group; j < (g + 1) * group; j++) s += x[t * K + j];
        xsum[t * groups + g] = s;
      }
  }
  // Split outputs into equal parts, group-aligned when W is not transposed (a group spans columns).
  const int64_t unit = transposed ? 1 : group, units = N / unit;
  int parts = threads < 1 ? 1 : threads;
  if (parts > units) parts = (int)units;
  // Small problems do not pay for waking threads: ~64K weights per part at least.
  const int64_t weights = K * N;
  while (parts > 1 && weights / parts < 65536) parts--;
  const Problem p{x, w, scales, biases, scale_type, T, K, N, bits, group, y, xsum.data(), xperm.data()};
  if (g_pool.workers() < parts - 1) g_pool.resize(parts - 1);  // grows once; a forked child starts its own
  g_pool.run(parts, [&](int part) {
    const int64_t a = units * part / parts, b = units * (part + 1) / parts;
    run_range(p, transposed, a * unit, b * unit);
  });
  return 0;
}

}  // extern "C"

static struct PyModuleDef qmatmul_module = {PyModuleDef_HEAD_INIT, "_qmatmul",
                                            "The CPU quantized matmul; called through ctypes (mlx_flash.kernels.qmatmul).",
                                            -1, nullptr};

PyMODINIT_FUNC PyInit__qmatmul(void) { return PyModule_Create(&qmatmul_module); }
