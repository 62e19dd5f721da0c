// One product in the q8 arithmetic (q8.h): x's rows quantized once for the stored kind's code order
// (and, for TILE_ROWS rows or more, into tiles with the rows in lanes), then the outputs split between
// the threads of qmatmul.cpp's pool in runs of 16, each computed by the path the CPU runs. Every path
// computes the same canonical order, so neither the path, nor the split, nor how many rows of x come
// together changes an output bit.
#include <vector>

#include "q8.h"

namespace mf {

int current_level();  // qmatmul.cpp: the path chosen (Isa levels 0 .. 4, as mf_cpu_isa)
bool cpu_has_avxvnni();

namespace {

// The lanes a path's tile kernels hold rows of x in (0: no tile kernel).
int tile_lanes(int level) { return level == 2 || level == 4 ? 16 : level == 1 || level == 3 ? 8 : 0; }

void run_path(int level, const Q8Job& job, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
#if MF_X86
  switch (level) {
    case 4:
      if (q8_avx512_vnni(job, n0, n1)) return;
      break;
    case 3:
      if (cpu_has_avxvnni() ? q8_avxvnni(job, n0, n1) : q8_avxvnni_evex(job, n0, n1)) return;
      break;
    case 2:
      if (q8_avx512_bw(job, n0, n1)) return;
      break;
    case 1:
      if (q8_avx2(job, n0, n1)) return;
      break;
  }
#endif
  q8_portable(job, n0, n1);
}

struct Part {
  const Q8Job* job;
  int level;
  int64_t units, N;
  int parts;
};

void run_part(void* arg, int part) {
  const Part& p = *static_cast<const Part*>(arg);
  const int64_t a = p.units * part / p.parts * 16, b = p.units * (part + 1) / p.parts * 16;
  run_path(p.level, *p.job, a, b < p.N ? b : p.N);
}

// Scratch of the calling thread for x's codes: reused from call to call.
struct Activations {
  std::vector<int64_t> boff, soff;
  std::vector<int8_t> q, tq;
  std::vector<float> d, s, td, ts;
  std::vector<int32_t> s8, ts8;
  std::vector<ActTile> tiles;
};

}  // namespace

int q8_matmul(const QMatrix& matrix, const float* x, int64_t T, float* y, int threads) {
  const bool affine = matrix.kind == QK_AFF2 || matrix.kind == QK_AFF4 || matrix.kind == QK_AFF8;
  if (matrix.K % 32 != 0 || matrix.K < 32) return -40;
  if (affine && matrix.group % 32 != 0) return -41;
  if (T == 0) return 0;
  const int level = current_level(), lanes = tile_lanes(level);
  thread_local Activations act;
  const int64_t K = matrix.K, nb = K / 32;
  act.boff.resize(nb);
  act.soff.resize(nb);
  for (int64_t b = 0; b < nb; b++) {  // where each block lies in a row (the same for every row)
    if (affine) {
      const int64_t per = matrix.group / 32, g = b / per, gid = matrix.group_ids ? matrix.group_ids[g] : g;
      const int bits = matrix.kind == QK_AFF2 ? 2 : matrix.kind == QK_AFF4 ? 4 : 8;
      act.boff[b] = gid * matrix.wg + (b % per) * 4 * bits;
      act.soff[b] = gid * matrix.sg;
    } else {
      const int64_t s = b / (super_block(matrix.kind) / 32);
      act.boff[b] = (matrix.group_ids ? matrix.group_ids[s] : s) * matrix.wg;
      act.soff[b] = 0;
    }
  }
  QMatrix m = matrix;
  m.boff = act.boff.data();
  m.soff = act.soff.data();
  m.one_block = m.row_ids == nullptr && m.rpb >= m.N;
  const int64_t block_bytes = affine ? 4 * (m.kind == QK_AFF2 ? 2 : m.kind == QK_AFF4 ? 4 : 8) : 0;
  m.side_by_side = m.rpb > 1 && m.wb == 0 && m.wr < m.wg && m.row_ids == nullptr;
  m.adjacent = affine;
  for (int64_t b = 0; b + 1 < nb && m.adjacent; b += 2) m.adjacent = act.boff[b + 1] == act.boff[b] + block_bytes;
  m.in_order = affine;
  for (int64_t b = 0; b < nb && m.in_order; b++) m.in_order = act.boff[b] == b * block_bytes;
  act.q.resize(T * K);
  act.d.resize(T * nb * QUARTERS);
  act.s.resize(T * nb);
  act.s8.resize(T * nb * QUARTERS);
  ActRows rows{T, K, act_order(m.kind), act.q.data(), act.d.data(), act.s.data(), act.s8.data()};
  quantize_rows(x, K, T, rows.order, rows);
  int64_t n_tiles = 0;
  if (T >= TILE_ROWS && lanes > 0) {
    n_tiles = (T + lanes - 1) / lanes;
    act.tq.resize(n_tiles * lanes * K);
    act.td.resize(n_tiles * lanes * nb * QUARTERS);
    act.ts.resize(n_tiles * lanes * nb);
    act.ts8.resize(n_tiles * lanes * nb * QUARTERS);
    act.tiles.resize(n_tiles);
    for (int64_t i = 0; i < n_tiles; i++) {
      ActTile& tile = act.tiles[i];
      tile.q = act.tq.data() + i * lanes * K;
      tile.d = act.td.data() + i * lanes * nb * QUARTERS;
      tile.s = act.ts.data() + i * lanes * nb;
      tile.s8 = act.ts8.data() + i * lanes * nb * QUARTERS;
      quantize_tile(x, K, i * lanes, T, lanes, tile);
    }
  }
  const Q8Job job{&m, &rows, n_tiles ? act.tiles.data() : nullptr, n_tiles, y};
  const int64_t units = (m.N + 15) / 16;  // runs of 16 outputs: every path's row groups fit in one
  int parts = threads < 1 ? 1 : threads;
  if (parts > units) parts = (int)units;
  while (parts > 1 && K * m.N / parts < 65536) parts--;  // small products do not pay for waking threads
  Part part{&job, level, units, m.N, parts};
  run_parts(parts, run_part, &part);
  return 0;
}

}  // namespace mf
