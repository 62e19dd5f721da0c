// AVX2 + FMA + F16C loops of the CPU kernel (8 lanes): decode blocks 4 rows, prefill widens
// per-thread float tiles, the rest widens 8 codes at a time. Compiled without -m flags (target
// attributes); qmatmul.cpp calls run_avx2 only on CPUs that report these instructions.
#include "qmatmul.h"

#if MF_X86
#include <vector>

namespace mf {

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


// Up to 4 tokens share each decoded group of codes (prefill reuses the widening across tokens).
__attribute__((target("avx2,fma"))) void rows_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / p.group;
  const int step_bytes = p.bits;  // bytes holding 8 codes
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = row_codes(p, n);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      float bias_acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < groups; g++) {
        __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const uint8_t* src = group_codes(p, row, g);
        for (int j = 0; j < p.group; j += 8, src += step_bytes) {
          const __m256 c = codes8_avx2(src, p.bits);
          for (int t = 0; t < tn; t++)
            dot[t] = _mm256_fmadd_ps(c, _mm256_loadu_ps(p.x + (t0 + t) * p.K + g * p.group + j), dot[t]);
        }
        const int64_t so = scale_offset(p, n, g);
        const float s = scale_at(p.scales, p.scale_type, so), b = scale_at(p.biases, p.scale_type, so);
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
  for (int64_t t = 0; t < p.T; t++) std::memset(p.y + t * p.N + n0, 0, (n1 - n0) * sizeof(float));
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t k = 0; k < p.K; k++) {
      const uint8_t* row = input_row(p, k);
      __m256 xs[4], xb[4];
      for (int64_t g = n0 / p.group; g < n1 / p.group; g++) {
        const float s = scale_at(p.scales, p.scale_type, input_scale(p, k, g));
        const float b = scale_at(p.biases, p.scale_type, input_scale(p, k, g));
        for (int t = 0; t < tn; t++) {
          const float xv = p.x[(t0 + t) * p.K + k];
          xs[t] = _mm256_set1_ps(xv * s);
          xb[t] = _mm256_set1_ps(xv * b);
        }
        const uint8_t* src = group_codes(p, row, g);
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
  if (p.scale_type == F16 && p.sg == 2 && p.group_ids == nullptr) {  // a row's scales side by side
    const uint16_t* s = reinterpret_cast<const uint16_t*>(static_cast<const char*>(p.scales) + scale_offset(p, n, 0));
    const uint16_t* b = reinterpret_cast<const uint16_t*>(static_cast<const char*>(p.biases) + scale_offset(p, n, 0));
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
    const int64_t so = scale_offset(p, n, g);
    // F16C's conversion: the portable one (scale_at) costs ~20 cycles a value, more than the
    // group's 32 multiply-adds when every group's scale is read this way
    sc[g] = scale_f16c(static_cast<const char*>(p.scales) + so, p.scale_type, 0);
    bi[g] = scale_f16c(static_cast<const char*>(p.biases) + so, p.scale_type, 0);
  }
}

__attribute__((target("avx2,fma,f16c"))) void rows4_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / p.group, blocks = p.group / 32;
  thread_local std::vector<float> sc, bi;
  sc.resize(groups);
  bi.resize(groups);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      row_scales(p, n, sc.data(), bi.data());
      const uint8_t* row = row_codes(p, n);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t g = 0; g < groups; g++) {
        __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const uint8_t* src = group_codes(p, row, g);
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
  const int64_t groups = p.K / p.group;
  const float* xs = p.bits == 4 ? p.xperm : p.x;
  thread_local std::vector<float> tile, sc, bi;
  tile.resize(4 * p.K);
  sc.resize(groups);
  bi.resize(groups);
  for (int64_t n = n0; n < n1; n += 4) {
    const int rn = (int)(n1 - n < 4 ? n1 - n : 4);
    for (int r = 0; r < rn; r++) {
      row_scales(p, n + r, sc.data(), bi.data());
      const uint8_t* row = row_codes(p, n + r);
      for (int64_t g = 0; g < groups; g++)
        widen_block_avx2(group_codes(p, row, g), p.bits, sc[g], bi[g], tile.data() + r * p.K + g * p.group,
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
  thread_local std::vector<float> tile;
  tile.resize(p.K * 32);
  for (int64_t c = n0; c < n1; c += 32) {
    const int64_t g = c / p.group;
    for (int64_t k = 0; k < p.K; k++)
      widen_block_avx2(input_row(p, k) + c * p.bits / 8, p.bits, scale_f16c(static_cast<const char*>(p.scales) + input_scale(p, k, g), p.scale_type, 0),
                       scale_f16c(static_cast<const char*>(p.biases) + input_scale(p, k, g), p.scale_type, 0), tile.data() + k * 32, 32);
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
  const int64_t groups = p.K / p.group, blocks = p.group / 32;
  const float* x = BITS == 4 ? p.xperm : p.x;
  const uint8_t *row[RN], *src[RN];
  __m256 acc[RN];
  for (int r = 0; r < RN; r++) {
    row_scales(p, n + r, sc[r], bi[r]);
    row[r] = row_codes(p, n + r);
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; g++) {
    __m256 dot[RN];
    for (int r = 0; r < RN; r++) {
      dot[r] = _mm256_setzero_ps();
      src[r] = group_codes(p, row[r], g);
    }
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
    // fused explicitly: groups_decode adds the same terms in the same order and must round alike
    for (int64_t g = 0; g < groups; g++) bias = std::fma(bi[r][g], p.xsum[g], bias);
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

// Decode over rows that lie side by side inside each group, the groups far apart (groups_apart):
// GROUP_PASS groups at a time, every row of the range, in memory order; a row's running sum is a
// vector in scratch. Per row, the same operations in the same order as rows_matvec_avx2.
template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void groups_decode_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / p.group, blocks = p.group / 32, rows = n1 - n0;
  const float* x = BITS == 4 ? p.xperm : p.x;
  thread_local std::vector<float> scratch;
  scratch.assign(rows * 9, 0.f);
  float *acc = scratch.data(), *bias = acc + rows * 8;  // [rows, 8] and [rows]
  for (int64_t g0 = 0; g0 < groups; g0 += GROUP_PASS) {
    const int64_t g1 = g0 + GROUP_PASS < groups ? g0 + GROUP_PASS : groups;
    for (int64_t n = n0; n < n1; n++) {
      __m256 a = _mm256_loadu_ps(acc + (n - n0) * 8);
      float b = bias[n - n0];
      const uint8_t* row = row_codes(p, n);
      for (int64_t g = g0; g < g1; g++) {
        const uint8_t* src = group_codes(p, row, g);
        __m256 dot = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < blocks; blk++, src += BITS * 4) {
          const float* xp = x + g * p.group + blk * 32;
          __m256 c[4];
          widen32_avx2<BITS>(src, c);
          for (int i = 0; i < 4; i++) dot = _mm256_fmadd_ps(c[i], _mm256_loadu_ps(xp + 8 * i), dot);
        }
        const int64_t so = scale_offset(p, n, g);  // the biases lie like the scales
        const float s = scale_f16c(static_cast<const char*>(p.scales) + so, p.scale_type, 0);
        a = _mm256_fmadd_ps(_mm256_set1_ps(s), dot, a);
        b = std::fma(scale_f16c(static_cast<const char*>(p.biases) + so, p.scale_type, 0), p.xsum[g], b);
      }
      _mm256_storeu_ps(acc + (n - n0) * 8, a);
      bias[n - n0] = b;
    }
  }
  for (int64_t n = n0; n < n1; n++) p.y[n] = hsum_avx2(_mm256_loadu_ps(acc + (n - n0) * 8)) + bias[n - n0];
}

template <int BITS, int NB>
__attribute__((target("avx2,fma,f16c"))) inline void cols_matvec_avx2(const Problem& p, int64_t c) {
  __m256 acc[NB][4];
  float bias[NB];
  int64_t g[NB];
  for (int j = 0; j < NB; j++) {
    for (int i = 0; i < 4; i++) acc[j][i] = _mm256_setzero_ps();
    bias[j] = 0.f;
    g[j] = (c + 32 * j) / p.group;
  }
  for (int64_t k = 0; k < p.K; k++) {
    const uint8_t* src = input_row(p, k) + c * BITS / 8;
    const float xk = p.x[k];
    for (int j = 0; j < NB; j++) {
      const __m256 xs = _mm256_set1_ps(xk * scale_f16c(static_cast<const char*>(p.scales) + input_scale(p, k, g[j]), p.scale_type, 0));
      bias[j] += xk * scale_f16c(static_cast<const char*>(p.biases) + input_scale(p, k, g[j]), p.scale_type, 0);
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

bool run_avx2(const Problem& p, int transposed, int64_t n0, int64_t n1) {
  if (p.bits == 2 || p.group % 8 != 0) return false;
  if (p.group % 32 == 0) {
    if (p.T >= 4) return transposed ? rows_tiled_avx2(p, n0, n1) : cols_tiled_avx2(p, n0, n1), true;
    if (p.T == 1) {
      if (transposed && groups_apart(p))
        return p.bits == 4 ? groups_decode_avx2<4>(p, n0, n1) : groups_decode_avx2<8>(p, n0, n1), true;
      if (transposed) return p.bits == 4 ? rows_decode_avx2<4>(p, n0, n1) : rows_decode_avx2<8>(p, n0, n1), true;
      return p.bits == 4 ? cols_decode_avx2<4>(p, n0, n1) : cols_decode_avx2<8>(p, n0, n1), true;
    }
    if (transposed && p.bits == 4) return rows4_avx2(p, n0, n1), true;
  }
  transposed ? rows_avx2(p, n0, n1) : cols_avx2(p, n0, n1);  // 8 codes at a time inside a group
  return true;
}

}  // namespace mf
#endif
