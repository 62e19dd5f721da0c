// The channel-major product: float32 activations times a stored affine matrix (2/4/8-bit codes in
// groups along K, float16/bfloat16/float32 scales and biases; rows are outputs) that skips every
// input channel whose activation is (nearly) zero, TEAL-style activation sparsity: a channel c of
// row t is active iff |x[t, c]| > threshold (a negative threshold: every channel, the dense product
// in this layout), and the codes of an inactive channel are neither read nor computed on.
//
//   y[t, n] = sum over groups g with an active channel of
//             scale[n, g] * sum_{active c in g} x[t, c] q[n, c] + bias[n, g] * sum_{active c in g} x[t, c]
//
// The store keeps a row's codes along K, so skipping a channel there skips 4 bits in every row. The
// layout here (mf_cm_relayout, once per matrix: the same codes, scales and biases, reordered; the
// scales' bytes as stored) puts a channel's codes for every output side by side:
//
//   group g (inputs g * group ..): for each of its channels, the codes of outputs 0 .. N-1 (padded
//            with zero codes to a multiple of CM_STEP = 64), 16-byte blocks of 16 * 8 / bits outputs
//            (cm_code in channel_major.h: a block's bytes widen to 16 consecutive outputs a shift);
//            then the scales of outputs 0 .. N-1, then their biases (stored type, padded with zeros)
//
// An inactive channel is then one stretch of bytes nobody reads. In the first layout tried, tiles
// outermost (a tile's 128-byte pieces of every channel side by side), the prefetchers fetched the
// pieces of inactive channels with the active ones: read from DRAM, half the channels zeroed took as
// long as none (7B shapes, 2 cores: 1.1 ms against 1.2). Outputs were first padded to tiles of 256,
// which cost the default model's 576-wide products a third more bytes and multiply-adds (768).
//
// Decode (one row) walks the groups; in each, for each tile of 256 outputs (the last of a thread's
// range a multiple of 64), it widens each active channel's codes and multiplies them by the channel's
// x into 16 vectors that stay in registers, then applies the group's scales and biases (2
// multiply-adds per output per active group) to sums in a per-thread scratch. A thread's outputs are
// a contiguous stretch of each run, and the stretch a few tiles ahead (or, at a group's end, the next
// active group's first) is prefetched. Several rows (prefill, multi-row steps) share each widened code
// between up to 6 rows, 64 outputs at a time; a channel is then skipped when no row of the tile of
// rows has it active, and the others see it as +0. Paths (chosen like qmatmul.cpp's, mf_set_isa forces
// them in tests): AVX-512 and AVX2 (channel_major_x86.cpp) and the portable loops here; threads split
// the outputs in steps of 64 (the kernels' pool, qmatmul.cpp). Plain-ops reference:
// kernels/channel_major_ref.py; tests/kernels/test_channel_major.py compares them.
#include <cmath>
#include <cstring>
#include <vector>

#include "channel_major.h"

namespace mf {
void run_parts(int parts, void (*fn)(void*, int), void* arg);  // qmatmul.cpp: the kernels' thread pool
int current_isa();                                              // qmatmul.cpp: 0 portable, 1 AVX2, 2 AVX-512

int cm_shape(int64_t N, int64_t K, int bits, int group, int scale_type, CmShape* s) {
  if (bits != 2 && bits != 4 && bits != 8) return -1;
  // groups of 32 .. 256 inputs in steps of 32: a group's codes fill whole 16-byte widenings of every
  // width, and a relayout's scratch (a group of codes for a tile) stays small
  if (group < 32 || group > 256 || group % 32 != 0) return -2;
  if (N < 1 || K < 1 || K % group != 0) return -3;
  if (scale_type < F16 || scale_type > F32) return -4;
  s->N = N;
  s->K = K;
  s->bits = bits;
  s->group = group;
  s->scale_type = scale_type;
  s->groups = K / group;
  s->padded = (N + CM_STEP - 1) / CM_STEP * CM_STEP;
  s->ssize = scale_type == F32 ? 4 : 2;
  s->run = s->padded * bits / 8;
  s->block = group * s->run + 2 * s->padded * s->ssize;
  return 0;
}

}  // namespace mf

using namespace mf;

namespace {

// ---- relayout --------------------------------------------------------------------------------------
struct RelayoutJob {
  const Problem* p;  // the stored matrix (its accessors find each row's codes and scales)
  const CmShape* s;
  uint8_t* out;
  int64_t tiles;  // of CM_TILE outputs, the last one narrower where padded is not a multiple of it
  int parts;
};

// Outputs n0 .. n0 + CM_TILE (or the padded end) of every group: each row's group of codes unpacked
// into a [group, CM_TILE] byte scratch (a channel's codes side by side), then each channel's packed in
// the layout's order; scales and biases copied as bytes.
void relayout_tile(const Problem& p, const CmShape& s, uint8_t* out, int64_t n0, uint8_t* codes) {
  const int bits = s.bits, per = 8 / bits, mask = (1 << bits) - 1;
  const int64_t span = 16 * per, width = s.padded - n0 < CM_TILE ? s.padded - n0 : CM_TILE;
  const int64_t rows = s.N - n0 < width ? s.N - n0 : width;
  for (int64_t g = 0; g < s.groups; g++) {
    uint8_t* blk = out + g * s.block + s.codes_at(n0);
    uint8_t* sc = const_cast<uint8_t*>(s.scales(out, g, n0));
    uint8_t* bi = sc + s.biases_after_scales();
    std::memset(codes, 0, (size_t)s.group * CM_TILE);
    std::memset(sc, 0, (size_t)(width * s.ssize));
    std::memset(bi, 0, (size_t)(width * s.ssize));
    for (int64_t o = 0; o < rows; o++) {
      const int64_t n = n0 + o;
      const uint8_t* src = group_codes(p, row_codes(p, n), g);
      for (int j = 0; j < s.group; j += per) {  // little-endian words: code j at bit j * bits of the group
        const int byte = src[j / per];
        for (int i = 0; i < per; i++) codes[(j + i) * CM_TILE + o] = (byte >> (bits * i)) & mask;
      }
      const int64_t so = scale_offset(p, n, g);
      std::memcpy(sc + o * s.ssize, static_cast<const uint8_t*>(p.scales) + so, s.ssize);
      std::memcpy(bi + o * s.ssize, static_cast<const uint8_t*>(p.biases) + so, s.ssize);
    }
    for (int c = 0; c < s.group; c++) {
      const uint8_t* q = codes + c * CM_TILE;
      uint8_t* dst = blk + c * s.run;
      for (int64_t b = 0; b < s.codes_at(width) / 16; b++)
        for (int i = 0; i < 16; i++) {
          int byte = 0;
          for (int k = 0; k < per; k++) byte |= q[b * span + 16 * k + i] << (bits * k);
          dst[b * 16 + i] = (uint8_t)byte;
        }
    }
  }
}

void relayout_part(void* arg, int part) {
  const RelayoutJob& j = *static_cast<const RelayoutJob*>(arg);
  const int64_t a = j.tiles * part / j.parts, b = j.tiles * (part + 1) / j.parts;
  std::vector<uint8_t> codes((size_t)j.s->group * CM_TILE);
  for (int64_t t = a; t < b; t++) relayout_tile(*j.p, *j.s, j.out, t * CM_TILE, codes.data());
}

// ---- the product -----------------------------------------------------------------------------------
void tiles(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
#if MF_X86
  const int isa = current_isa();
  if (isa == 2 && cm_tiles_avx512(s, w, r, y, n0, n1)) return;
  if (isa >= 1 && cm_tiles_avx2(s, w, r, y, n0, n1)) return;
#endif
  cm_tiles_portable(s, w, r, y, n0, n1);
}

// Rows a tile of rows holds on each path (its register tile), and rows a pass holds: what the
// masked copy of x (rows x K floats) is made for at once.
int rows_per_tile(int64_t T) {
  if (T == 1) return 1;
#if MF_X86
  const int isa = current_isa();
  return isa == 2 ? CM_MAX_ROWS : isa == 1 ? 2 : 4;
#else
  return 4;
#endif
}

// The activity of each tile of rows of a pass: lists, group sums, the masked copy, the counts.
struct Pass {
  std::vector<CmRows> tiles;
  std::vector<int32_t> gstart, col;
  std::vector<int64_t> off;
  std::vector<float> xs, masked;
};

// Sum of a group's active inputs (G floats from x, G a multiple of 32) in one fixed order on every path
// (16 lanes, then a tree): a row's sums, and so its outputs, depend neither on the instruction set nor
// on the rows beside it; the lanes also let the compiler vectorize what was a chain of dependent adds.
inline float group_sum(const float* x, int64_t G, float threshold, bool all) {
  float acc[16] = {0.f};
  if (all) {  // two loops without a branch in either: GCC made the one with `all ||` a branch per input
    for (int64_t c = 0; c < G; c += 16)
      for (int l = 0; l < 16; l++) acc[l] += x[c + l];
  } else {
    for (int64_t c = 0; c < G; c += 16)
      for (int l = 0; l < 16; l++) acc[l] += std::fabs(x[c + l]) > threshold ? x[c + l] : 0.f;
  }
  for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
  for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
  for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
  return acc[0] + acc[1];
}

// One row (decode): each group's active channels listed and its sum taken, counted into counts. Apart
// from the multi-row loop below, with its counts in locals: that loop's stores through int32 and int64
// pointers kept every count in memory, 3 ns a channel (12 us of a 4096-input product's call).
void list_row(const CmShape& s, const float* x, float threshold, bool all, int32_t* gstart, int32_t* col,
              int64_t* off, float* xs, int64_t* counts) {
  const int64_t G = s.group;
#if MF_X86
  if (current_isa() == 2) cm_list_avx512(s, x, threshold, all, gstart, col, off);  // 0.2 ns a channel
  else
#endif
  {
    int32_t n = 0;
    for (int64_t g = 0; g < s.groups; g++) {
      gstart[g] = n;
      for (int64_t c = g * G; c < (g + 1) * G; c++) {
        col[n] = (int32_t)c;  // written always, kept when active: no branch on the activity
        off[n] = g * s.block + (c - g * G) * s.run;
        n += all || std::fabs(x[c]) > threshold;
      }
    }
    gstart[s.groups] = n;
  }
  int64_t groups_on = 0;
  for (int64_t g = 0; g < s.groups; g++) {
    groups_on += gstart[g + 1] > gstart[g];
    xs[g] = group_sum(x + g * G, G, threshold, all);
  }
  counts[1] += gstart[s.groups];
  counts[2] += groups_on;
}

void build_pass(const CmShape& s, const float* x, int64_t rows, int R, float threshold, Pass& ps,
                int64_t* counts) {
  const int64_t K = s.K, G = s.group, groups = s.groups, tiles = (rows + R - 1) / R;
  const bool all = threshold < 0.f, mask = !all && rows > 1;
  ps.gstart.resize(tiles * (groups + 1));
  ps.col.resize(tiles * K + CM_LIST_SLACK);
  ps.off.resize(tiles * K + CM_LIST_SLACK);
  ps.xs.resize(rows * groups);
  ps.masked.resize(mask ? rows * K : 0);
  ps.tiles.clear();
  counts[0] += rows;
  if (rows == 1) {
    list_row(s, x, threshold, all, ps.gstart.data(), ps.col.data(), ps.off.data(), ps.xs.data(), counts);
    ps.tiles.push_back(CmRows{x, 1, K, ps.gstart.data(), ps.col.data(), ps.off.data(), ps.xs.data()});
    return;
  }
  int64_t active = 0, groups_on = 0;
  for (int64_t i = 0; i < tiles; i++) {
    const int64_t r0 = i * R, rn = rows - r0 < R ? rows - r0 : R;
    int32_t* gstart = ps.gstart.data() + i * (groups + 1);
    int32_t* col = ps.col.data() + i * K;
    int64_t* off = ps.off.data() + i * K;
    const float* xt = (mask ? ps.masked.data() : x) + r0 * K;  // the tile's rows as the loops read them
    int32_t n = 0;
    for (int64_t g = 0; g < groups; g++) {
      gstart[g] = n;
      int any_row[CM_MAX_ROWS] = {0};
      for (int64_t c = g * G; c < (g + 1) * G; c++) {
        int on = all;
        for (int64_t r = 0; r < rn; r++) {
          const float v = x[(r0 + r) * K + c];
          const int a = all || std::fabs(v) > threshold;
          any_row[r] |= a;
          active += a;
          on |= a;
          if (mask) ps.masked[(r0 + r) * K + c] = a ? v : 0.f;
        }
        col[n] = (int32_t)c;
        off[n] = g * s.block + (c - g * G) * s.run;
        n += on;
      }
      for (int64_t r = 0; r < rn; r++) {
        groups_on += any_row[r];
        ps.xs[(r0 + r) * groups + g] = group_sum(xt + r * K + g * G, G, threshold, all);
      }
    }
    gstart[groups] = n;
    ps.tiles.push_back(CmRows{xt, rn, K, gstart, col, off, ps.xs.data() + r0 * groups});
  }
  counts[1] += active;
  counts[2] += groups_on;
}

struct MatmulJob {
  const CmShape* s;
  const uint8_t* w;
  const Pass* pass;
  float* y;  // the pass's first row
  int parts;
};

// Part `part`'s outputs: an even share of the padded outputs in steps of CM_STEP (576 outputs on 2
// threads: 256 and 320).
void part_range(const CmShape& s, int parts, int part, int64_t* n0, int64_t* n1) {
  const int64_t steps = s.padded / CM_STEP;
  *n0 = steps * part / parts * CM_STEP;
  *n1 = steps * (part + 1) / parts * CM_STEP;
}

void matmul_part(void* arg, int part) {
  const MatmulJob& j = *static_cast<const MatmulJob*>(arg);
  int64_t a, b;
  part_range(*j.s, j.parts, part, &a, &b);
  const std::vector<CmRows>& rt = j.pass->tiles;
  if (rt.size() == 1) return tiles(*j.s, j.w, rt[0], j.y, a, b);
  // several tiles of rows: each tile of outputs passes them all while its codes are in cache
  for (int64_t n = a; n < b; n += CM_TILE)
    for (size_t i = 0; i < rt.size(); i++) {
      const int64_t r0 = (rt[i].x - rt[0].x) / j.s->K;  // rows are K floats apart in x and its copy
      tiles(*j.s, j.w, rt[i], j.y + r0 * j.s->N, n, n + CM_TILE < b ? n + CM_TILE : b);
    }
}

}  // namespace

namespace mf {

void cm_product(const CmShape& s, const uint8_t* w, const float* x, int64_t T, float threshold, float* y, int threads,
                int64_t* counts) {
  int parts = threads < 1 ? 1 : threads;
  if (parts > s.padded / CM_STEP) parts = (int)(s.padded / CM_STEP);
  while (parts > 1 && s.K * s.N / parts < 65536) parts--;  // small products do not pay for waking threads
  const int R = rows_per_tile(T);
  const int64_t pass_rows = 8 * R;  // the masked copy is made for this many rows at a time
  // the calling thread's lists, kept between calls: a decode step's products allocate nothing
  thread_local Pass pass;
  for (int64_t t0 = 0; t0 < T; t0 += pass_rows) {
    const int64_t rows = T - t0 < pass_rows ? T - t0 : pass_rows;
    build_pass(s, x + t0 * s.K, rows, R, threshold, pass, counts);
    MatmulJob job{&s, w, &pass, y + t0 * s.N, parts};
    run_parts(parts, matmul_part, &job);
  }
}

// ---- the portable loops --------------------------------------------------------------------------
void cm_tiles_portable(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  std::vector<float> acc(r.rows * width, 0.f), dot(r.rows * CM_TILE), q(CM_TILE);
  for (int64_t g = 0; g < s.groups; g++) {
    if (r.gstart[g] == r.gstart[g + 1]) continue;
    for (int64_t n = n0; n < n1; n += CM_TILE) {
      const int64_t tw = n1 - n < CM_TILE ? n1 - n : CM_TILE;
      std::fill(dot.begin(), dot.end(), 0.f);
      for (int32_t k = r.gstart[g]; k < r.gstart[g + 1]; k++) {
        for (int64_t o = 0; o < tw; o++) q[o] = (float)cm_code(w + r.off[k] + s.codes_at(n), s.bits, o);
        for (int64_t row = 0; row < r.rows; row++) {
          const float xv = r.x[row * r.K + r.col[k]];
          float* d = dot.data() + row * CM_TILE;
          for (int64_t o = 0; o < tw; o++) d[o] += xv * q[o];
        }
      }
      const uint8_t* sc = s.scales(w, g, n);
      const uint8_t* bi = sc + s.biases_after_scales();
      for (int64_t row = 0; row < r.rows; row++) {
        const float xs = r.xs[row * s.groups + g];
        float* a = acc.data() + row * width + n - n0;
        for (int64_t o = 0; o < tw; o++)
          a[o] += load_scale(sc, s.scale_type, o) * dot[row * CM_TILE + o] + load_scale(bi, s.scale_type, o) * xs;
      }
    }
  }
  const int64_t n = (s.N < n1 ? s.N : n1) - n0;
  for (int64_t row = 0; row < r.rows; row++)
    std::memcpy(y + row * s.N + n0, acc.data() + row * width, n * sizeof(float));
}

}  // namespace mf

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// Bytes of the channel-major layout of an N x K matrix, or a negative code for arguments the product
// refuses (bits 2, 4, 8; groups of 32 .. 256 in steps of 32 dividing K; scale type 0 f16, 1 bf16, 2 f32).
MF_EXPORT int64_t mf_cm_bytes(int64_t N, int64_t K, int bits, int group, int scale_type) {
  CmShape s;
  const int rc = cm_shape(N, K, bits, group, scale_type, &s);
  return rc != 0 ? rc : s.groups * s.block;
}

// A stored matrix (rows are outputs; `layout`: Problem's rpb, wb, wr, wg, sb, sr, sg as mf_qmatmul
// takes it, or null for a plain [N, K / (32 / bits)] matrix) written into `out` (mf_cm_bytes bytes)
// in the channel-major layout, tiles split between `threads`. Returns 0 or a negative code.
MF_EXPORT int mf_cm_relayout(const uint32_t* w, const void* scales, const void* biases, int scale_type, int64_t N,
                             int64_t K, int bits, int group, const int64_t* layout, uint8_t* out, int threads) {
  CmShape s;
  const int rc = cm_shape(N, K, bits, group, scale_type, &s);
  if (rc != 0) return rc;
  if (w == nullptr || scales == nullptr || biases == nullptr || out == nullptr) return -6;
  int64_t lay[7] = {N, 0, K * bits / 8, group * bits / 8, 0, s.groups * s.ssize, s.ssize};
  if (layout != nullptr) {
    if (layout[0] < 1) return -5;
    std::memcpy(lay, layout, sizeof(lay));
  }
  const Problem p{nullptr, w, scales, biases, scale_type, 1, K, N, bits, group, nullptr, nullptr, nullptr,
                  lay[0], lay[1], lay[2], lay[3], lay[4], lay[5], lay[6], nullptr, nullptr};
  const int64_t tiles = (s.padded + CM_TILE - 1) / CM_TILE;
  int parts = threads < 1 ? 1 : threads;
  if (parts > tiles) parts = (int)tiles;
  RelayoutJob job{&p, &s, out, tiles, parts};
  run_parts(parts, relayout_part, &job);
  return 0;
}

// y [T, N] = x [T, K] times the channel-major matrix `cm` (mf_cm_relayout) with every channel of a
// row whose |x| is not above `threshold` taken as zero (threshold < 0: every channel), outputs split
// between `threads`. counters (null: none): 3 int64 the call adds to: rows computed, active channels
// and active groups (both summed over rows). Returns 0 or a negative code.
MF_EXPORT int mf_cm_matmul(const uint8_t* cm, int64_t N, int64_t K, int bits, int group, int scale_type,
                           const float* x, int64_t T, float threshold, float* y, int threads, int64_t* counters) {
  CmShape s;
  const int rc = cm_shape(N, K, bits, group, scale_type, &s);
  if (rc != 0) return rc;
  if (cm == nullptr || ((x == nullptr || y == nullptr) && T > 0)) return -6;
  if (T < 0) return -7;
  if (std::isnan(threshold)) return -8;
  int64_t counts[3] = {0, 0, 0};
  cm_product(s, cm, x, T, threshold, y, threads, counts);
  if (counters != nullptr)
    for (int i = 0; i < 3; i++) counters[i] += counts[i];
  return 0;
}

}  // extern "C"
