// T-MAC's table-lookup product (Wei et al., EuroSys 2025) for one row of x (decode) times affine 4-bit
// weights in groups of 32, rows are outputs: y[n] = sum_k (s[n,g] c[n,k] + b[n,g]) x[k]. Instead of
// multiplying codes, each code is split into its 4 bit planes; for each run of 4 inputs a table of the
// 16 sums of a subset of them is built once per token (int8, one scale per group of 32 inputs, shared
// by every row), and each plane's 4 bits of a run index that table:
//   sum_k c[n,k] x[k] = sum_j 2^j sum_runs T_run[bits j of the run's 4 codes].
// The integer lookups are summed exactly; the group's scale (times the table scale) and its bias
// (times the group's input sum, in float) are applied by two fused multiply-adds. Plain-ops
// reference: kernels/tmac_ref.py, whose every step this file computes in the same order, so every
// path (and any split between threads) equals it to the bit.
//
// The weights are read in T-MAC's own layout, not the store's bytes: mf_tmac_repack rewrites a store
// matrix once, offline (the same size). Blocks of 16 rows; per block and group a 320-byte record: 4
// run pairs of 64 bytes (dword r = row r; byte j = plane j; low nibble: the pair's first run, high
// nibble its second), then the 16 rows' float16 scales and biases. So a 64-byte load is 128 weights
// of 16 rows, a row's 4 plane bytes sit in one dword (one vpdpbusd weights them by 1, 2, 4, 8 into
// the row's int32 lane: no horizontal sums anywhere), and a block is one sequential stream. The
// vector loop reads 4 blocks side by side (4 streams sharing each table load); one stream of the 4
// blocks interleaved per group measured slower (DRAM-bound 7B shape on one core: 2.4 ms against 1.46).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qmatmul.h"

namespace mf {
void run_parts(int parts, void (*fn)(void*, int), void* arg);  // qmatmul.cpp: the kernels' thread pool
}

using namespace mf;

namespace {

constexpr int64_t ROWS = 16, RUNS = 8, RECORD = 4 * 64 + 4 * ROWS;  // rows a block, runs a group, bytes

// Paths (mf_tmac_matvec's `path`): 0 the fastest this CPU runs, then:
enum Path { AUTO = 0, PORTABLE = 1, BW = 2, VNNI = 3, VBMI = 4 };
//   BW:   vpshufb lookups (index nibbles masked), planes weighted and paired by vpmaddubsw into int16,
//         widened once a group by vpmaddwd (AVX-512 F/BW/VL: every AVX-512 CPU since Skylake-X)
//   VNNI: vpshufb lookups, planes weighted and summed into int32 by vpdpbusd
//   VBMI: vpermb lookups (it reads 6 index bits and ignores the top 2, and the table is broadcast to
//         all 4 of its 16-byte quarters, so no nibble needs masking), vpdpbusd

struct Tables {  // one row of x as the product reads it
  const int8_t* q;  // [K / 4][16] int8 entries
  const float* d;   // [K / 32] table scales
  const float* xs;  // [K / 32] group sums of x
};

// ---- tables (portable) ----------------------------------------------------------------------------
// One group's 8 runs: entries T[idx] = T[idx - 2^m] + x[m] for idx's top bit m, in float32; the scale
// max|T| / 127; entries round-half-even(T * (127 / max|T|)); the group sum a tree of the runs' T[15].
void group_table_portable(const float* x, int8_t* q, float* d, float* xs) {
  float t[RUNS][16], amax = 0.f;
  for (int r = 0; r < RUNS; r++) {
    t[r][0] = 0.f;
    for (int m = 0; m < 4; m++)
      for (int i = 0; i < (1 << m); i++) t[r][(1 << m) + i] = t[r][i] + x[4 * r + m];
    for (int i = 0; i < 16; i++) amax = std::fabs(t[r][i]) > amax ? std::fabs(t[r][i]) : amax;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int r = 0; r < RUNS; r++)
    for (int i = 0; i < 16; i++) {
      q[16 * r + i] = (int8_t)std::nearbyint(t[r][i] * id);  // the default rounding: to nearest, ties to even
    }
  *d = amax / 127.f;
  const float a0 = t[0][15] + t[1][15], a1 = t[2][15] + t[3][15], a2 = t[4][15] + t[5][15], a3 = t[6][15] + t[7][15];
  const float b0 = a0 + a1, b1 = a2 + a3;
  *xs = b0 + b1;
}

// ---- product (portable) ---------------------------------------------------------------------------
// Rows of block `blk` (rows 16 blk .. 16 blk + live): the same record walk as the vector paths.
void block_portable(const uint8_t* w, int64_t K, const Tables& tb, int64_t blk, int live, float* y) {
  const int64_t groups = K / 32;
  const uint8_t* rec = w + blk * groups * RECORD;
  float acc[ROWS] = {0.f};
  for (int64_t g = 0; g < groups; g++, rec += RECORD) {
    const int8_t* tg = tb.q + g * RUNS * 16;
    uint16_t sh[ROWS], bh[ROWS];
    std::memcpy(sh, rec + 256, sizeof(sh));
    std::memcpy(bh, rec + 256 + sizeof(sh), sizeof(bh));
    for (int r = 0; r < live; r++) {
      int32_t total = 0;
      for (int p = 0; p < 4; p++)
        for (int j = 0; j < 4; j++) {
          const uint8_t byte = rec[64 * p + 4 * r + j];
          total += (tg[32 * p + (byte & 15)] + tg[32 * p + 16 + (byte >> 4)]) * (1 << j);
        }
      // fused multiply-adds, each rounded once (std::fma: the same result with or without the instruction)
      acc[r] = std::fma((float)total, half_to_float(sh[r]) * tb.d[g], acc[r]);
      acc[r] = std::fma(half_to_float(bh[r]), tb.xs[g], acc[r]);
    }
  }
  for (int r = 0; r < live; r++) y[r] = acc[r];
}

#if MF_X86
#define TMAC_BW "avx512f,avx512bw,avx512vl,avx2,fma,f16c"

// ---- tables (AVX-512 F) ---------------------------------------------------------------------------
// A run's 16 entries in the 16 lanes of one register: x[m] added, in order m = 0..3, to the lanes
// whose index has bit m (the portable path's sums); then its steps, lane by lane.
__attribute__((target(TMAC_BW))) void group_table_avx512(const float* x, int8_t* q, float* d, float* xs) {
  static const __mmask16 bit[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
  __m512 t[RUNS], amax = _mm512_setzero_ps();
  for (int r = 0; r < RUNS; r++) {
    t[r] = _mm512_setzero_ps();
    for (int m = 0; m < 4; m++) t[r] = _mm512_mask_add_ps(t[r], bit[m], t[r], _mm512_set1_ps(x[4 * r + m]));
    amax = _mm512_max_ps(amax, _mm512_abs_ps(t[r]));
  }
  const float top = _mm512_reduce_max_ps(amax);
  const __m512 id = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
  for (int r = 0; r < RUNS; r++) {  // vcvtps2dq rounds to nearest, ties to even (the default mode)
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(t[r], id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * r), _mm512_cvtepi32_epi8(v));
  }
  *d = top / 127.f;
  const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[1]), _mm512_add_ps(t[2], t[3])),
                                 _mm512_add_ps(_mm512_add_ps(t[4], t[5]), _mm512_add_ps(t[6], t[7])));
  const __m128 top4 = _mm512_extractf32x4_ps(s, 3);  // lanes 12..15: T[15] is the last
  *xs = _mm_cvtss_f32(_mm_shuffle_ps(top4, top4, 3));
}

// ---- product (AVX-512): tmac_x86.inc once per path ------------------------------------------------
namespace bw {
#define TMAC_TARGET TMAC_BW
#define TMAC_LOOKUP_VPERMB 0
#define TMAC_DPBUSD 0
#include "tmac_x86.inc"
#undef TMAC_TARGET
#undef TMAC_LOOKUP_VPERMB
#undef TMAC_DPBUSD
}  // namespace bw

namespace vnni {
#define TMAC_TARGET TMAC_BW ",avx512vnni"
#define TMAC_LOOKUP_VPERMB 0
#define TMAC_DPBUSD 1
#include "tmac_x86.inc"
#undef TMAC_TARGET
#undef TMAC_LOOKUP_VPERMB
#undef TMAC_DPBUSD
}  // namespace vnni

namespace vbmi {
#define TMAC_TARGET TMAC_BW ",avx512vnni,avx512vbmi"
#define TMAC_LOOKUP_VPERMB 1
#define TMAC_DPBUSD 1
#include "tmac_x86.inc"
#undef TMAC_TARGET
#undef TMAC_LOOKUP_VPERMB
#undef TMAC_DPBUSD
}  // namespace vbmi
#endif

bool can_run(int path) {
#if MF_X86
  __builtin_cpu_init();
  const bool bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
                  __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool vnni = bw && __builtin_cpu_supports("avx512vnni");
  switch (path) {
    case PORTABLE: return true;
    case BW: return bw;
    case VNNI: return vnni;
    case VBMI: return vnni && __builtin_cpu_supports("avx512vbmi");
  }
  return false;
#else
  return path == PORTABLE;
#endif
}

int best_path() {
  for (int path : {VBMI, VNNI, BW})
    if (can_run(path)) return path;
  return PORTABLE;
}

const int g_best = best_path();

void build_tables(const float* x, int64_t K, int path, int8_t* q, float* d, float* xs) {
  for (int64_t g = 0; g < K / 32; g++) {
#if MF_X86
    if (path != PORTABLE) {
      group_table_avx512(x + 32 * g, q + 128 * g, d + g, xs + g);
      continue;
    }
#endif
    group_table_portable(x + 32 * g, q + 128 * g, d + g, xs + g);
  }
}

struct Job {
  const uint8_t* w;
  int64_t N, K;
  Tables tb;
  float* y;
  int path, parts;
};

void run_part(void* arg, int part) {
  const Job& j = *static_cast<const Job*>(arg);
  const int64_t blocks = (j.N + ROWS - 1) / ROWS;
  const int64_t b0 = blocks * part / j.parts, b1 = blocks * (part + 1) / j.parts;
  switch (j.path) {
#if MF_X86
    case BW: return bw::product(j.w, j.K, j.tb, b0, b1, j.N, j.y);
    case VNNI: return vnni::product(j.w, j.K, j.tb, b0, b1, j.N, j.y);
    case VBMI: return vbmi::product(j.w, j.K, j.tb, b0, b1, j.N, j.y);
#endif
    default:
      for (int64_t b = b0; b < b1; b++) {
        const int64_t live = j.N - b * ROWS < ROWS ? j.N - b * ROWS : ROWS;
        block_portable(j.w, j.K, j.tb, b, (int)live, j.y + b * ROWS);
      }
  }
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// Bit p set: this CPU runs path p (1 portable, 2 AVX-512 BW, 3 AVX-512 VNNI, 4 AVX-512 VBMI + VNNI);
// bits 8..15: the path that path 0 (auto) takes.
MF_EXPORT int mf_tmac_paths() {
  int bits = g_best << 8;
  for (int p = PORTABLE; p <= VBMI; p++) bits |= can_run(p) ? 1 << p : 0;
  return bits;
}

// Bytes of an N x K matrix in the T-MAC layout (N rounded up to a block of 16 rows).
MF_EXPORT int64_t mf_tmac_bytes(int64_t N, int64_t K) { return (N + ROWS - 1) / ROWS * (K / 32) * RECORD; }

// A store matrix (uint32 words [N, K / 8], code k at bits 4 (k % 8) of word k / 8; float16 scales and
// biases [N, K / 32]) -> `out` (mf_tmac_bytes) in the T-MAC layout at the top of this file. Offline:
// a one-time rewrite, not part of a product. Returns 0, or a negative code for bad arguments.
MF_EXPORT int mf_tmac_repack(const uint32_t* w, const uint16_t* scales, const uint16_t* biases, int64_t N, int64_t K,
                             uint8_t* out) {
  if (N < 1 || K < 32 || K % 32) return -1;
  const int64_t groups = K / 32;
  std::memset(out, 0, mf_tmac_bytes(N, K));
  for (int64_t n = 0; n < N; n++) {
    uint8_t* rec = out + (n / ROWS) * groups * RECORD;
    const int r = (int)(n % ROWS);
    for (int64_t g = 0; g < groups; g++, rec += RECORD) {
      for (int p = 0; p < 4; p++) {
        const uint32_t word = w[n * (K / 8) + 4 * g + p];
        uint32_t t = 0;  // bit 8j + c <- bit 4c + j: code c's bit j into plane j's byte
        for (int j = 0; j < 4; j++)
          for (int c = 0; c < 8; c++) t |= ((word >> (4 * c + j)) & 1u) << (8 * j + c);
        std::memcpy(rec + 64 * p + 4 * r, &t, 4);
      }
      std::memcpy(rec + 256 + 2 * r, scales + n * groups + g, 2);
      std::memcpy(rec + 256 + 2 * ROWS + 2 * r, biases + n * groups + g, 2);
    }
  }
  return 0;
}

// The tables of one row x [K] (what a product builds first): q [K / 4, 16] int8, d and xs [K / 32].
// `path` 1: the portable loops, else the AVX-512 ones where the CPU has them. Returns 0 or negative.
MF_EXPORT int mf_tmac_tables(const float* x, int64_t K, int8_t* q, float* d, float* xs, int path) {
  if (K < 32 || K % 32) return -1;
  if (path == AUTO) path = g_best;
  if (!can_run(path)) return -2;
  build_tables(x, K, path, q, d, xs);
  return 0;
}

// y [N] = x [K] @ W^T with W in the T-MAC layout (mf_tmac_repack), on `threads` threads of the
// kernels' pool (row blocks split between them), by `path` (0: the fastest this CPU runs). Returns
// 0, or a negative code for bad arguments or a path this CPU cannot run.
MF_EXPORT int mf_tmac_matvec(const uint8_t* w, int64_t N, int64_t K, const float* x, float* y, int threads, int path) {
  if (N < 1 || K < 32 || K % 32) return -1;
  if (path == AUTO) path = g_best;
  if (path < PORTABLE || path > VBMI || !can_run(path)) return -2;
  thread_local std::vector<int8_t> q;  // the calling thread's scratch, reused from call to call
  thread_local std::vector<float> d, xs;
  q.resize(K / 4 * 16);
  d.resize(K / 32);
  xs.resize(K / 32);
  build_tables(x, K, path, q.data(), d.data(), xs.data());
  const int64_t blocks = (N + ROWS - 1) / ROWS;
  int parts = threads < 1 ? 1 : threads;
  if (parts > blocks) parts = (int)blocks;
  while (parts > 1 && K * N / parts < 65536) parts--;  // small products do not pay for waking threads
  Job job{w, N, K, Tables{q.data(), d.data(), xs.data()}, y, path, parts};
  run_parts(parts, run_part, &job);
  return 0;
}

}  // extern "C"
