// AVX-512 forms of three steps of attention.cpp's unit, each computing what the plain loops there
// compute, in the same order, to the bit (the plain loops stay for AVX2 and other CPUs):
// - the transposed key tile, 16 x 16 floats at a time in registers: a block's keys lie as rows (hd
//   floats a key) and the tile wants them as columns (KB keys a channel), so the plain copy stores
//   each element alone; here 16 loads, 64 shuffles and 16 stores move 256 elements;
// - the scores and the probabilities times values of 4 query rows, their sums held in registers
//   (GCC kept the plain loops' [4][16] sums on the stack: a load and a store around every
//   multiply-add, perf), and a row's masked maxima and exponentials 16 lanes at a time (GCC left
//   them scalar once the block's length was no longer a constant). In a decode step a block serves
//   only the 3 query rows of one key head, so these, not the arithmetic, bounded the kernel.
#pragma once

#if MF_X86
#include <immintrin.h>

#include <cstdint>

namespace mf {

// r[i] <- column i of the 16 x 16 matrix whose rows are r[0 .. 15].
__attribute__((target("avx512f"))) inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {  // per 128-bit lane: rows 2i, 2i + 1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {  // per 128-bit lane: one column of rows 4i .. 4i + 3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 2; i++)  // then the 128-bit lanes themselves, twice
    for (int m = 0; m < 4; m++) {
      t[8 * i + m] = _mm512_shuffle_f32x4(r[8 * i + m], r[8 * i + 4 + m], 0x88);
      t[8 * i + 4 + m] = _mm512_shuffle_f32x4(r[8 * i + m], r[8 * i + 4 + m], 0xdd);
    }
  for (int m = 0; m < 8; m++) {
    r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
  }
}

// 16 keys (rows of hd floats, hd a multiple of 16, st floats apart) into dst[d * dstep + i], i < 16.
__attribute__((target("avx512f"))) inline void transpose_keys16(const float* src, int64_t st, int64_t hd, float* dst,
                                                                int64_t dstep) {
  for (int64_t d0 = 0; d0 < hd; d0 += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * st + d0);
    transpose16(r);
    for (int m = 0; m < 16; m++) _mm512_storeu_ps(dst + (d0 + m) * dstep, r[m]);
  }
}

// Lanes j0 + i < lim of 16 (i < 16).
__attribute__((target("avx512f"))) inline __mmask16 lanes_below(int64_t j0, int64_t lim) {
  const int64_t n = lim - j0;
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

// Lanes lo <= j0 + i < lim of 16.
__attribute__((target("avx512f"))) inline __mmask16 lanes_within(int64_t j0, int64_t lo, int64_t lim) {
  return (__mmask16)(lanes_below(j0, lim) & ~lanes_below(j0, lo));
}

// mx[i] = the largest of mx[i] and row[j0 + i] for lo <= j0 + i < lim (j0 = 0, 16, .. < n), as
// `v > mx ? v : mx` lane by lane.
__attribute__((target("avx512f"))) inline void masked_max(const float* row, int64_t n, int64_t lo, int64_t lim,
                                                           float* mx) {
  __m512 m = _mm512_loadu_ps(mx);
  for (int64_t j0 = 0; j0 < n; j0 += 16)
    m = _mm512_mask_max_ps(m, lanes_within(j0, lo, lim), _mm512_loadu_ps(row + j0), m);
  _mm512_storeu_ps(mx, m);
}

// attention.cpp's exp_neg on 16 lanes: the same operations, each rounded alike (its multiply-adds
// are fused there too), so every lane equals it to the bit.
__attribute__((target("avx512f,fma"))) inline __m512 exp_neg16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_setzero_ps());
  const __m512 big = _mm512_set1_ps(12582912.f);
  const __m512 shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big);
  const __m512 n = _mm512_sub_ps(shifted, big);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 e = _mm512_set1_ps(1.f / 720.f);
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 120.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 24.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 6.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(big));
  return _mm512_mul_ps(e, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23)));
}

// row[j] = exp_neg(row[j] - m) for lo <= j < lim, 0 for the other j < n; lr[i] += row[j0 + i] per 16-lane block.
__attribute__((target("avx512f,fma"))) inline void masked_exp(float* row, int64_t n, int64_t lo, int64_t lim, float m,
                                                              float* lr) {
  __m512 l = _mm512_loadu_ps(lr);
  const __m512 vm = _mm512_set1_ps(m);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(row + j0), vm));
    const __m512 p = _mm512_maskz_mov_ps(lanes_within(j0, lo, lim), e);
    _mm512_storeu_ps(row + j0, p);
    l = _mm512_add_ps(l, p);
  }
  _mm512_storeu_ps(lr, l);
}

// sc[rr][j] = sum over d = 0 .. hd - 1, in order, of q_rr[d] * kt[d * kb + j] (one multiply-add
// each), for 4 rows (q_rr = qr[rr]) and j < n (a multiple of 16): two 16-key columns at a time.
__attribute__((target("avx512f,fma"))) inline void tile_scores(const float* const* qr, const float* kt, int64_t kb,
                                                               int64_t hd, int64_t n, float* sc, int64_t sc_stride) {
  int64_t jc = 0;
  for (; jc + 32 <= n; jc += 32) {
    __m512 a[4][2];
    for (int rr = 0; rr < 4; rr++) a[rr][0] = a[rr][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * kb + jc), k1 = _mm512_loadu_ps(kt + d * kb + jc + 16);
      for (int rr = 0; rr < 4; rr++) {
        const __m512 qd = _mm512_set1_ps(qr[rr][d]);
        a[rr][0] = _mm512_fmadd_ps(qd, k0, a[rr][0]);
        a[rr][1] = _mm512_fmadd_ps(qd, k1, a[rr][1]);
      }
    }
    for (int rr = 0; rr < 4; rr++) {
      _mm512_storeu_ps(sc + rr * sc_stride + jc, a[rr][0]);
      _mm512_storeu_ps(sc + rr * sc_stride + jc + 16, a[rr][1]);
    }
  }
  for (; jc < n; jc += 16) {
    __m512 a[4];
    for (int rr = 0; rr < 4; rr++) a[rr] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * kb + jc);
      for (int rr = 0; rr < 4; rr++) a[rr] = _mm512_fmadd_ps(_mm512_set1_ps(qr[rr][d]), k0, a[rr]);
    }
    for (int rr = 0; rr < 4; rr++) _mm512_storeu_ps(sc + rr * sc_stride + jc, a[rr]);
  }
}

// For the nr <= 4 rows: acc_rr[i] = acc_rr[i] * c[rr], then += p_rr[j] * v_j[i] for j < last in
// order (one multiply-add each), i < MC * 16 from acc_rr = ar[rr] + dc, v_j = vb + j * v_stride + dc.
template <int MC>
__attribute__((target("avx512f,fma"))) inline void tile_values_chunk(float* const* ar, const float* c, const float* sc,
                                                                     int64_t sc_stride, const float* vb,
                                                                     int64_t v_stride, int64_t last, int nr) {
  __m512 a[4][MC];
  for (int rr = 0; rr < 4; rr++)
    for (int m = 0; m < MC; m++) a[rr][m] = _mm512_mul_ps(_mm512_loadu_ps(ar[rr] + 16 * m), _mm512_set1_ps(c[rr]));
  for (int64_t j = 0; j < last; j++) {
    __m512 v[MC];
    for (int m = 0; m < MC; m++) v[m] = _mm512_loadu_ps(vb + j * v_stride + 16 * m);
    for (int rr = 0; rr < 4; rr++) {
      const __m512 pj = _mm512_set1_ps(sc[rr * sc_stride + j]);
      for (int m = 0; m < MC; m++) a[rr][m] = _mm512_fmadd_ps(pj, v[m], a[rr][m]);
    }
  }
  for (int rr = 0; rr < nr; rr++)
    for (int m = 0; m < MC; m++) _mm512_storeu_ps(ar[rr] + 16 * m, a[rr][m]);
}

// The same over hdp (a multiple of 16) columns, 64 at a time; ar[rr] for rr >= nr are read, not written.
__attribute__((target("avx512f,fma"))) inline void tile_values(float* const* ar, const float* c, const float* sc,
                                                               int64_t sc_stride, const float* vb, int64_t hdp,
                                                               int64_t last, int nr) {
  for (int64_t dc = 0; dc < hdp; dc += 64) {
    float* at[4] = {ar[0] + dc, ar[1] + dc, ar[2] + dc, ar[3] + dc};
    switch ((hdp - dc) >= 64 ? 4 : (hdp - dc) / 16) {
      case 4: tile_values_chunk<4>(at, c, sc, sc_stride, vb + dc, hdp, last, nr); break;
      case 3: tile_values_chunk<3>(at, c, sc, sc_stride, vb + dc, hdp, last, nr); break;
      case 2: tile_values_chunk<2>(at, c, sc, sc_stride, vb + dc, hdp, last, nr); break;
      default: tile_values_chunk<1>(at, c, sc, sc_stride, vb + dc, hdp, last, nr); break;
    }
  }
}

}  // namespace mf
#else
#include <cstdint>

// Elsewhere attention.cpp's unit_body<true> is never instantiated: these only declare the names its
// discarded branches use (no definition is needed, none is called).
namespace mf {
void transpose_keys16(const float* src, int64_t st, int64_t hd, float* dst, int64_t dstep);
void tile_scores(const float* const* qr, const float* kt, int64_t kb, int64_t hd, int64_t n, float* sc,
                 int64_t sc_stride);
void masked_max(const float* row, int64_t n, int64_t lo, int64_t lim, float* mx);
void masked_exp(float* row, int64_t n, int64_t lo, int64_t lim, float m, float* lr);
void tile_values(float* const* ar, const float* c, const float* sc, int64_t sc_stride, const float* vb, int64_t hdp,
                 int64_t last, int nr);
}  // namespace mf
#endif
