// AVX-512 and AVX2 loops of the channel-major product (channel_major.cpp says what it computes and
// how the layout lies). Compiled without -m flags (target attributes); channel_major.cpp calls them
// only on CPUs that report the instructions.
//
// Codes are widened to float and multiplied (one multiply-add per code and row), the float
// arithmetic of qmatmul.cpp; on Zen 4 that measured faster than looking 4-bit products up in a
// 16-entry table of c * x per channel (vpermps), and it serves every width alike.
#include "channel_major.h"

#if MF_X86
#include <vector>

namespace mf {

namespace {

#define MF_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define MF_AVX2 __attribute__((target("avx2,fma,f16c")))

// Tiles ahead whose codes decode prefetches, channel by channel (at a group's last tiles, the next
// active group's first): a thread's stretch of a run is only a few KB (4096 outputs of 4-bit codes
// split between 2 threads: 1 KB), too short for the hardware prefetcher to learn each stream. The
// 4096 x 11008 matrix read from DRAM, half its inputs zeroed, 2 threads: 1.4-2.1 ms without, 0.74-0.82
// ms 2 tiles ahead (1 tile: 0.79-0.90, 4 tiles: as 2).
constexpr int64_t PREFETCH = 2;

// The first group after g with an active channel, or `groups`.
inline int64_t next_active(const CmShape& s, const CmRows& r, int64_t g) {
  for (g++; g < s.groups && r.gstart[g] == r.gstart[g + 1]; g++) {
  }
  return g;
}

// Where channel k's codes PREFETCH tiles after output n lie (within the thread's outputs n0..n1), or,
// past them, the codes of the next active group's channel in the same place of its list (kn: its
// first entry, nn: its count); null when there is none.
struct Ahead {
  const uint8_t* w;
  const CmShape& s;
  const CmRows& r;
  int64_t n0, n1;
  int32_t k0, kn, nn;
  __attribute__((always_inline)) const uint8_t* at(int32_t k, int64_t n, const uint8_t* codes) const {
    const int64_t ahead = n + PREFETCH * CM_TILE;
    if (ahead < n1) return codes + s.codes_at(PREFETCH * CM_TILE);
    return k - k0 < nn ? w + r.off[kn + k - k0] + s.codes_at(n0 + ahead - n1) : nullptr;
  }
};

inline Ahead ahead_of(const uint8_t* w, const CmShape& s, const CmRows& r, int64_t g, int64_t n0, int64_t n1) {
  const int64_t gn = next_active(s, r, g);
  const int32_t kn = gn < s.groups ? r.gstart[gn] : 0, nn = gn < s.groups ? r.gstart[gn + 1] - kn : 0;
  return Ahead{w, s, r, n0, n1, r.gstart[g], kn, nn};
}

// always_inline: GCC does not inline a function of the default target into one with target
// attributes on its own, and a call whose only effect is a prefetch counts as pure: it was dropped.
template <int BITS>
__attribute__((always_inline)) inline void prefetch_codes(const uint8_t* p) {
  if (p == nullptr) return;
  for (int l = 0; l < BITS / 2; l++) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * l), _MM_HINT_T0);
}

// Per-thread sums of a call's outputs (rows x (n1 - n0) floats), zeroed.
inline float* sums(int64_t n) {
  thread_local std::vector<float> scratch;
  if ((int64_t)scratch.size() < n) scratch.resize(n);
  std::memset(scratch.data(), 0, n * sizeof(float));
  return scratch.data();
}

// The sums of outputs n0..n1 into y, those past N (padding) left out.
inline void store_sums(const CmShape& s, const float* acc, int64_t rows, float* y, int64_t n0, int64_t n1) {
  const int64_t n = (s.N < n1 ? s.N : n1) - n0;
  for (int64_t r = 0; r < rows; r++) std::memcpy(y + r * s.N + n0, acc + r * (n1 - n0), n * sizeof(float));
}

// Outputs in the tile from n: CM_TILE, or fewer (a multiple of CM_STEP) at the range's end.
inline int64_t tile_width(int64_t n, int64_t n1) { return n1 - n < CM_TILE ? n1 - n : CM_TILE; }

// ---- AVX-512 ---------------------------------------------------------------------------------------
// Outputs 64 j .. 64 j + 63 of a channel's codes from `codes` as 4 vectors of 16 floats, in order.
template <int BITS>
MF_AVX512 inline void widen64(const uint8_t* codes, int j, __m512* w) {
  const __m128i* src = reinterpret_cast<const __m128i*>(codes + j * 8 * BITS);
  if (BITS == 8) {
    for (int i = 0; i < 4; i++) w[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(src + i)));
  } else if (BITS == 4) {
    const __m512i lo = _mm512_set1_epi32(15);
    for (int i = 0; i < 2; i++) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(src + i));
      w[2 * i] = _mm512_cvtepi32_ps(_mm512_and_si512(v, lo));
      w[2 * i + 1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    }
  } else {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(src)), lo = _mm512_set1_epi32(3);
    w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, lo));
    w[1] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 2), lo));
    w[2] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4), lo));
    w[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 6));
  }
}

// 16 scales (or biases) from their stored bytes.
MF_AVX512 inline __m512 scales16(const uint8_t* p, int type) {
  if (type == F16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  if (type == BF16)
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

// One tile of one row for group g: its 64 J outputs (J = 4: a whole tile) in 4 J registers over the
// active channels, then the group's scales and biases applied into `a`. J is a template argument so
// the sums stay in registers: the last tile of a range (576 outputs: 256, 256, 64) takes a narrower one.
template <int BITS, int J>
MF_AVX512 __attribute__((always_inline)) inline void decode_tile(const CmShape& s, const uint8_t* w, const CmRows& r,
                                                                 const Ahead& ahead, int64_t g, int64_t n,
                                                                 __m512 xs, float* a) {
  __m512 dot[4 * J];
  for (int i = 0; i < 4 * J; i++) dot[i] = _mm512_setzero_ps();
  for (int32_t k = r.gstart[g]; k < r.gstart[g + 1]; k++) {
    const uint8_t* codes = w + r.off[k] + s.codes_at(n);
    prefetch_codes<BITS>(ahead.at(k, n, codes));
    const __m512 xv = _mm512_set1_ps(r.x[r.col[k]]);
    for (int j = 0; j < J; j++) {
      __m512 c[4];
      widen64<BITS>(codes, j, c);
      for (int i = 0; i < 4; i++) dot[4 * j + i] = _mm512_fmadd_ps(c[i], xv, dot[4 * j + i]);
    }
  }
  const uint8_t* sc = s.scales(w, g, n);
  const uint8_t* bi = sc + s.biases_after_scales();
  for (int i = 0; i < 4 * J; i++) {
    const __m512 sv = scales16(sc + 16 * i * s.ssize, s.scale_type);
    const __m512 bv = scales16(bi + 16 * i * s.ssize, s.scale_type);
    _mm512_storeu_ps(a + 16 * i, _mm512_fmadd_ps(bv, xs, _mm512_fmadd_ps(sv, dot[i], _mm512_loadu_ps(a + 16 * i))));
  }
}

// One row: per group, per tile, the tile's outputs in registers, its terms added into `acc`.
template <int BITS>
MF_AVX512 void decode_avx512(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  float* acc = sums(n1 - n0);
  for (int64_t g = next_active(s, r, -1); g < s.groups; g = next_active(s, r, g)) {
    const Ahead ahead = ahead_of(w, s, r, g, n0, n1);
    const __m512 xs = _mm512_set1_ps(r.xs[g]);
    for (int64_t n = n0; n < n1; n += CM_TILE) {
      float* a = acc + n - n0;
      switch (tile_width(n, n1) / CM_STEP) {
        case 4: decode_tile<BITS, 4>(s, w, r, ahead, g, n, xs, a); break;
        case 3: decode_tile<BITS, 3>(s, w, r, ahead, g, n, xs, a); break;
        case 2: decode_tile<BITS, 2>(s, w, r, ahead, g, n, xs, a); break;
        default: decode_tile<BITS, 1>(s, w, r, ahead, g, n, xs, a); break;
      }
    }
  }
  store_sums(s, acc, 1, y, n0, n1);
}

// R rows: 64 outputs at a time, each widened code multiplied into R rows' accumulators.
template <int BITS, int R>
MF_AVX512 void rows_avx512(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  float* acc = sums(R * width);
  for (int64_t g = next_active(s, r, -1); g < s.groups; g = next_active(s, r, g)) {
    const int32_t k0 = r.gstart[g], k1 = r.gstart[g + 1];
    const Ahead ahead = ahead_of(w, s, r, g, n0, n1);
    for (int64_t n = n0; n < n1; n += CM_TILE) {
      const uint8_t* sc = s.scales(w, g, n);
      const uint8_t* bi = sc + s.biases_after_scales();
      const int steps = (int)(tile_width(n, n1) / CM_STEP);
      for (int j = 0; j < steps; j++) {
        __m512 dot[R][4];
        for (int row = 0; row < R; row++)
          for (int i = 0; i < 4; i++) dot[row][i] = _mm512_setzero_ps();
        for (int32_t k = k0; k < k1; k++) {
          const uint8_t* codes = w + r.off[k] + s.codes_at(n);
          if (j == 0) prefetch_codes<BITS>(ahead.at(k, n, codes));
          __m512 c[4];
          widen64<BITS>(codes, j, c);
          const float* xp = r.x + r.col[k];
          for (int row = 0; row < R; row++) {
            const __m512 xv = _mm512_set1_ps(xp[row * r.K]);
            for (int i = 0; i < 4; i++) dot[row][i] = _mm512_fmadd_ps(c[i], xv, dot[row][i]);
          }
        }
        for (int i = 0; i < 4; i++) {
          const int64_t o = 64 * j + 16 * i;
          const __m512 sv = scales16(sc + o * s.ssize, s.scale_type), bv = scales16(bi + o * s.ssize, s.scale_type);
          for (int row = 0; row < R; row++) {
            float* a = acc + row * width + n - n0 + o;
            const __m512 v = _mm512_fmadd_ps(sv, dot[row][i], _mm512_loadu_ps(a));
            _mm512_storeu_ps(a, _mm512_fmadd_ps(bv, _mm512_set1_ps(r.xs[row * s.groups + g]), v));
          }
        }
      }
    }
  }
  store_sums(s, acc, R, y, n0, n1);
}

template <int BITS>
MF_AVX512 void tiles_avx512(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  switch (r.rows) {
    case 1: return decode_avx512<BITS>(s, w, r, y, n0, n1);
    case 2: return rows_avx512<BITS, 2>(s, w, r, y, n0, n1);
    case 3: return rows_avx512<BITS, 3>(s, w, r, y, n0, n1);
    case 4: return rows_avx512<BITS, 4>(s, w, r, y, n0, n1);
    case 5: return rows_avx512<BITS, 5>(s, w, r, y, n0, n1);
    default: return rows_avx512<BITS, 6>(s, w, r, y, n0, n1);
  }
}

// ---- AVX2 ------------------------------------------------------------------------------------------
MF_AVX2 inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Outputs 32 j .. 32 j + 31 of a channel's codes from `codes` as 4 vectors of 8 floats, in order.
template <int BITS>
MF_AVX2 inline void widen32(const uint8_t* codes, int j, __m256* w) {
  if (BITS == 8) {
    for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi32_ps(bytes8(codes + 32 * j + 8 * i));
    return;
  }
  // a 16-byte block: 4-bit, 32 outputs (low nibbles then high); 2-bit, 64 (shifts 0, 2, 4, 6)
  const uint8_t* blk = codes + (BITS == 4 ? 16 * j : 16 * (j / 2));
  const int shift = BITS == 4 ? 0 : 4 * (j % 2);
  const __m256i a = bytes8(blk), b = bytes8(blk + 8), lo = _mm256_set1_epi32((1 << BITS) - 1);
  const __m128i s0 = _mm_cvtsi32_si128(shift), s1 = _mm_cvtsi32_si128(shift + BITS);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(a, s0), lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(b, s0), lo));
  w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(a, s1), lo));
  w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(b, s1), lo));
}

MF_AVX2 inline __m256 scales8(const uint8_t* p, int type) {
  if (type == F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (type == BF16)
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

// R rows (1 or 2), 32 outputs at a time: 4R accumulators of the 16 registers.
template <int BITS, int R>
MF_AVX2 void rows_avx2(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  float* acc = sums(R * width);
  for (int64_t g = next_active(s, r, -1); g < s.groups; g = next_active(s, r, g)) {
    const int32_t k0 = r.gstart[g], k1 = r.gstart[g + 1];
    const Ahead ahead = ahead_of(w, s, r, g, n0, n1);
    for (int64_t n = n0; n < n1; n += CM_TILE) {
      const uint8_t* sc = s.scales(w, g, n);
      const uint8_t* bi = sc + s.biases_after_scales();
      const int steps = (int)(tile_width(n, n1) / 32);
      for (int j = 0; j < steps; j++) {
        __m256 dot[R][4];
        for (int row = 0; row < R; row++)
          for (int i = 0; i < 4; i++) dot[row][i] = _mm256_setzero_ps();
        for (int32_t k = k0; k < k1; k++) {
          const uint8_t* codes = w + r.off[k] + s.codes_at(n);
          if (j == 0) prefetch_codes<BITS>(ahead.at(k, n, codes));
          __m256 c[4];
          widen32<BITS>(codes, j, c);
          const float* xp = r.x + r.col[k];
          for (int row = 0; row < R; row++) {
            const __m256 xv = _mm256_set1_ps(xp[row * r.K]);
            for (int i = 0; i < 4; i++) dot[row][i] = _mm256_fmadd_ps(c[i], xv, dot[row][i]);
          }
        }
        for (int i = 0; i < 4; i++) {
          const int64_t o = 32 * j + 8 * i;
          const __m256 sv = scales8(sc + o * s.ssize, s.scale_type), bv = scales8(bi + o * s.ssize, s.scale_type);
          for (int row = 0; row < R; row++) {
            float* a = acc + row * width + n - n0 + o;
            const __m256 v = _mm256_fmadd_ps(sv, dot[row][i], _mm256_loadu_ps(a));
            _mm256_storeu_ps(a, _mm256_fmadd_ps(bv, _mm256_set1_ps(r.xs[row * s.groups + g]), v));
          }
        }
      }
    }
  }
  store_sums(s, acc, R, y, n0, n1);
}

template <int BITS>
MF_AVX2 void tiles_avx2(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  if (r.rows == 1) return rows_avx2<BITS, 1>(s, w, r, y, n0, n1);
  rows_avx2<BITS, 2>(s, w, r, y, n0, n1);
}

}  // namespace

// list_row's lists (channel_major.cpp) 16 channels at a time: the active channels' numbers and run
// offsets compressed in registers and stored whole (col and off hold CM_LIST_SLACK entries more than
// K: the lanes past the active ones are overwritten by the next store). A register compress, not
// vpcompressd to memory: Zen 4 runs the memory form in microcode.
MF_AVX512 void cm_list_avx512(const CmShape& s, const float* x, float threshold, bool all, int32_t* gstart,
                              int32_t* col, int64_t* off) {
  const __m512 thr = _mm512_set1_ps(threshold);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t r = s.run;
  const __m512i lo = _mm512_setr_epi64(0, r, 2 * r, 3 * r, 4 * r, 5 * r, 6 * r, 7 * r);
  const __m512i hi = _mm512_add_epi64(lo, _mm512_set1_epi64(8 * s.run));
  int32_t n = 0;
  for (int64_t g = 0; g < s.groups; g++) {
    gstart[g] = n;
    for (int64_t c = 0; c < s.group; c += 16) {
      const int64_t ch = g * s.group + c;
      const __mmask16 m =
          all ? (__mmask16)0xFFFF : _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + ch)), thr, _CMP_GT_OQ);
      const __m512i first = _mm512_set1_epi64(g * s.block + c * s.run);
      const int n_lo = __builtin_popcount(m & 0xFF);
      _mm512_storeu_si512(col + n, _mm512_maskz_compress_epi32(m, _mm512_add_epi32(_mm512_set1_epi32((int)ch), lane)));
      _mm512_storeu_si512(off + n, _mm512_maskz_compress_epi64((__mmask8)m, _mm512_add_epi64(first, lo)));
      _mm512_storeu_si512(off + n + n_lo, _mm512_maskz_compress_epi64((__mmask8)(m >> 8), _mm512_add_epi64(first, hi)));
      n += __builtin_popcount(m);
    }
  }
  gstart[s.groups] = n;
}

bool cm_tiles_avx512(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  if (r.rows < 1 || r.rows > CM_MAX_ROWS) return false;
  switch (s.bits) {
    case 8: return tiles_avx512<8>(s, w, r, y, n0, n1), true;
    case 4: return tiles_avx512<4>(s, w, r, y, n0, n1), true;
    case 2: return tiles_avx512<2>(s, w, r, y, n0, n1), true;
  }
  return false;
}

bool cm_tiles_avx2(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  if (r.rows < 1 || r.rows > 2) return false;
  switch (s.bits) {
    case 8: return tiles_avx2<8>(s, w, r, y, n0, n1), true;
    case 4: return tiles_avx2<4>(s, w, r, y, n0, n1), true;
    case 2: return tiles_avx2<2>(s, w, r, y, n0, n1), true;
  }
  return false;
}

}  // namespace mf

#endif
