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
// of 16 rows, a row's 4 plane bytes sit in one dword (one vpdpbusd can weight them by 1, 2, 4, 8 into
// the row's int32 lane: no horizontal sums anywhere), and a block is one sequential stream. This file
// has the portable loop; the AVX-512 ones follow.
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

// Paths (mf_tmac_matvec's `path`): 0 the fastest this CPU runs, 1 the portable loop.
enum Path { AUTO = 0, PORTABLE = 1 };

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

bool can_run(int path) { return path == PORTABLE; }

const int g_best = PORTABLE;

void build_tables(const float* x, int64_t K, int, int8_t* q, float* d, float* xs) {
  for (int64_t g = 0; g < K / 32; g++) group_table_portable(x + 32 * g, q + 128 * g, d + g, xs + g);
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
  for (int64_t b = b0; b < b1; b++) {
    const int64_t live = j.N - b * ROWS < ROWS ? j.N - b * ROWS : ROWS;
    block_portable(j.w, j.K, j.tb, b, (int)live, j.y + b * ROWS);
  }
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// Bit p set: this CPU runs path p (1 portable); bits 8..15: the path that path 0 (auto) takes.
MF_EXPORT int mf_tmac_paths() {
  int bits = g_best << 8;
  for (int p = PORTABLE; p <= PORTABLE; p++) bits |= can_run(p) ? 1 << p : 0;
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
// `path`: as mf_tmac_matvec's. Returns 0 or negative.
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
  if (!can_run(path)) return -2;
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
