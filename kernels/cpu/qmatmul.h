// Shared by the CPU kernel's translation units (see qmatmul.cpp for what the kernel computes): the
// problem description, scalar helpers, and each instruction set's entry point. Each ISA file is
// compiled without -m flags; its functions carry target attributes and qmatmul.cpp calls them only
// after the CPU said it has the instructions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MF_X86 1
#else
#define MF_X86 0
#endif

namespace mf {

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
  // Where row n's codes and scales lie (transposed only; the store's bundles interleave several
  // matrices, and the kernel reads them where they were read to). Rows come in blocks of `rpb`:
  // the codes of row n, group g start at  w + (n / rpb) * wb + (n % rpb) * wr + g * wg  bytes, its
  // scale and bias at  scales|biases + (n / rpb) * sb + (n % rpb) * sr + g * sg  bytes. A plain
  // [N, K/pack] matrix is one block: wr = K*bits/8, wg = group*bits/8, sr = groups*sg, sg = scale size.
  // Not transposed (rows are inputs): row k's codes start at  w + k * wr  bytes, its group g's scale
  // and bias at  scales|biases + k * sr + g * sg  (a plain [K, N/pack] matrix: wr = N*bits/8).
  int64_t rpb, wb, wr, wg, sb, sr, sg;
  // Sparse products over a slab of bundles (null: none). row_ids[i]: the block (transposed) or row
  // (not transposed) that block or input row i of this product is; group_ids[g]: the group that
  // group g is (a groups-apart down matrix: its groups are the bundles). The product then covers
  // only the listed ones, in list order: N = len(row_ids) * rpb outputs, or K = len(group_ids) *
  // group or K = len(row_ids) inputs.
  const int32_t* row_ids;
  const int32_t* group_ids;
};

inline int64_t block_of(const Problem& p, int64_t n) {
  return p.row_ids ? p.row_ids[n / p.rpb] : n / p.rpb;
}

inline int64_t group_of(const Problem& p, int64_t g) {
  return p.group_ids ? p.group_ids[g] : g;
}

inline const uint8_t* row_codes(const Problem& p, int64_t n) {
  return reinterpret_cast<const uint8_t*>(p.w) + block_of(p, n) * p.wb + (n % p.rpb) * p.wr;
}

// Group g of a row whose codes start at `row` (transposed).
inline const uint8_t* group_codes(const Problem& p, const uint8_t* row, int64_t g) {
  return row + group_of(p, g) * p.wg;
}

inline int64_t scale_offset(const Problem& p, int64_t n, int64_t g) {  // bytes
  return block_of(p, n) * p.sb + (n % p.rpb) * p.sr + group_of(p, g) * p.sg;
}

// Not transposed: input row k's codes, and the byte offset of its group g's scale and bias.
inline const uint8_t* input_row(const Problem& p, int64_t k) {
  return reinterpret_cast<const uint8_t*>(p.w) + (p.row_ids ? p.row_ids[k] : k) * p.wr;
}

inline int64_t input_scale(const Problem& p, int64_t k, int64_t g) {
  return (p.row_ids ? p.row_ids[k] : k) * p.sr + g * p.sg;
}

// Rows side by side inside each group and the groups far apart: the down matrix of a block store,
// whose group g of every row is bundle g (240 KB apart in a 7B layer). Walking such a matrix row by
// row jumps a bundle per group, every row again: each jump lands in the same few cache sets (the
// bundle size is a multiple of 4 KiB), so the lines a row shares with the next are evicted before
// it gets to them and every read waits on memory (4.8 GB/s against 19 for the gate rows, 7B
// shape). Decode walks such matrices group by group instead (groups_decode_*).
inline bool groups_apart(const Problem& p) {
  return p.rpb > 1 && p.wr < p.wg && p.wb == 0 && p.sr < p.sg && p.row_ids == nullptr;
}

// Groups a group-by-group decode pass reads before it returns to the first row: a few streams,
// each row's running sum loaded and stored once per pass.
constexpr int64_t GROUP_PASS = 4;

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

inline float scale_at(const void* base, int type, int64_t byte_offset) {
  return load_scale(static_cast<const char*>(base) + byte_offset, type, 0);
}

inline int code_at(const uint32_t* row, int bits, int64_t j) {
  const int per = 32 / bits;
  return (row[j / per] >> (bits * (j % per))) & ((1u << bits) - 1);
}

// Each path computes outputs n0..n1 of p (transposed: rows are outputs) and returns false when it
// has no loop for this problem (bits, group size, token count), leaving it to the next path.
void run_portable(const Problem& p, int transposed, int64_t n0, int64_t n1);
#if MF_X86
bool run_avx2(const Problem& p, int transposed, int64_t n0, int64_t n1);
bool run_avx512(const Problem& p, int transposed, int64_t n0, int64_t n1);

// x86 helpers shared by the AVX2 and AVX-512 files (every AVX-512 CPU has AVX2, FMA and F16C).
__attribute__((target("avx2,fma,f16c"))) void row_scales(const Problem& p, int64_t n, float* sc, float* bi);

__attribute__((target("avx2,fma,f16c"))) inline float scale_f16c(const void* p, int type, int64_t i) {
  return type == F16 ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : load_scale(p, type, i);
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace mf
