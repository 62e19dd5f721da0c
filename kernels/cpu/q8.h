// The 8-bit activation arithmetic ("q8"): each row of x is quantized to int8 codes with a float scale
// per 8 inputs (a quarter of a 32-block: d = max|x| / 127 over the 8, codes round(x / d) in [-127,
// 127]), and every product multiplies the stored codes by those codes as integers, the scales applied
// in float once per quarter. llama.cpp's arithmetic has a scale per 32 inputs (Q8_1) or 256 (Q8_K);
// on the default model that costs +0.21% of perplexity on Wikipedia, per 16 +0.14%, per 8 within
// +0.05% (docs/earlier-results/kernels.md). One canonical order of the float operations makes a product's
// outputs the same to the bit on every instruction set (AVX-512 VNNI, AVX-512 BW, AVX-VNNI, AVX2,
// portable), for any split between threads and whether a row of x is multiplied alone or in a tile of
// many:
//
//   for each output y[t, n]: 16 partial sums p[0..15], 32-block b of the row adding into p[b % 16]:
//     for each half h of b (16 inputs, quarters u = 2h and 2h + 1):
//       I_u  = sum over quarter u of code * xq          (integers: exact on every path)
//       I_u -= zero * (sum over quarter u of xq)        (kinds whose codes carry an offset: Q5_0 16, Q6_K 32)
//       g = float(I_2h) * d(b, 2h);  g = fma(float(I_2h+1), d(b, 2h+1), g)
//       p[b % 16] = fma(g, scale(b, h), p[b % 16])
//     p[b % 16] = fma(offset(b), S(b), p[b % 16])       (kinds with a per-block offset)
//   then y = tree(p): p[i] += p[i + 8], p[i] += p[i + 4], p[i] += p[i + 2] (i below each), y = p[0] + p[1]
//
// where S(b) = ((a0 + a1) + a2) + a3 with a_u = d(b, u) * float(sum of quarter u's xq), each step
// rounded: what the quantizer computes once. scale(b, h) and offset(b) are exact float32 values of the
// stored block (fp16 times a small integer; a block's halves share a scale except in Q6_K, whose
// scales are per 16), so they too are the same on every path. The 16 partial sums are what makes
// both kernels cheap: a row alone puts 16 consecutive blocks in the 16 lanes of a vector (its scales
// lie side by side), and a tile of rows of x puts the rows in the lanes and keeps the 16 sums in
// memory. Plain-ops reference: kernels/q8_ref.py; the portable loop (q8_portable.cpp) is this formula
// in scalar C++.
#pragma once

#include <cstdint>

#include "gguf_blocks.h"

namespace mf {

// Where a kind's stored codes land in the vectors a decode kernel unpacks a pair of 32-blocks (A, B)
// into, and so the order an activation row's codes must have for that kind. Each 8 bytes hold one
// quarter of a block (A's four, then B's), so a quarter's sum is that of two int32 lanes; within a
// quarter:
//   NATURAL  its 8 codes in order (8-bit affine, and every GGUF kind)
//   NIBBLES  its 4 even codes, then its 4 odd ones (4-bit affine: a byte holds codes 2i and 2i + 1)
//   CRUMBS   codes 0, 4, 1, 5, 2, 6, 3, 7 (2-bit affine: a byte holds codes 4i .. 4i + 3; each 16-bit
//            word of two bytes is shifted by 0, 2, 4, 6)
// A single trailing block (an odd number of blocks) is its four quarters alone.
enum ActOrder { ORDER_NATURAL = 0, ORDER_NIBBLES = 1, ORDER_CRUMBS = 2 };

// The kinds the q8 kernels multiply: affine groups (2, 4, 8 bits) and GGUF blocks.
enum QKind { QK_AFF2 = 100, QK_AFF4 = 101, QK_AFF8 = 102, QK_Q5_0 = Q5_0, QK_Q5_1 = Q5_1, QK_Q4_K = Q4_K,
             QK_Q5_K = Q5_K, QK_Q6_K = Q6_K };

constexpr int act_order(int kind) {
  return kind == QK_AFF4 ? ORDER_NIBBLES : kind == QK_AFF2 ? ORDER_CRUMBS : ORDER_NATURAL;
}
constexpr int QUARTERS = 4;  // activation scales per 32-block
constexpr bool has_offset(int kind) { return kind != QK_Q5_0 && kind != QK_Q6_K; }
constexpr int zero_point(int kind) { return kind == QK_Q5_0 ? 16 : kind == QK_Q6_K ? 32 : 0; }
constexpr int64_t super_block(int kind) {  // weights per stored block (a GGUF block; affine: 32)
  return kind == QK_Q4_K || kind == QK_Q5_K || kind == QK_Q6_K ? 256 : 32;
}

// A stored matrix whose rows are outputs, as the q8 kernels read it: affine groups (Problem's layout)
// or GGUF blocks (BlockProblem's; scales and biases unused). boff and soff are filled by q8_matmul:
// where each 32-block's bytes and (affine) its group's scale lie, from the row's start and from the
// row's first scale, so that no kernel divides per block.
struct QMatrix {
  int kind;
  int scale_type, group;  // affine
  const uint8_t* w;
  const char* scales;
  const char* biases;
  int64_t N, K;  // outputs and inputs of this product
  int64_t rpb, wb, wr, wg, sb, sr, sg;
  const int32_t* row_ids;
  const int32_t* group_ids;
  const int64_t* boff = nullptr;  // [K / 32]: bytes from the row's start to block b (GGUF: to the stored block holding it)
  const int64_t* soff = nullptr;  // [K / 32]: bytes from the row's first scale to block b's scale (affine)
  bool one_block = false;         // every row in the first block of rows (no row ids): row n at n * wr
  bool adjacent = false;          // block b + 1 follows block b (of a pair) in every row
  bool in_order = false;          // every block follows the one before it (a row's bytes are its codes in order)
  bool side_by_side = false;      // rows lie side by side inside each block, the blocks far apart (a block
                                  // store's down matrix: block b of every row in bundle b)
};

inline const uint8_t* qrow(const QMatrix& m, int64_t n) {
  if (m.one_block) return m.w + n * m.wr;  // (a division per row costs as much as a short row's products)
  const int64_t blk = m.row_ids ? m.row_ids[n / m.rpb] : n / m.rpb;
  return m.w + blk * m.wb + (n % m.rpb) * m.wr;
}

inline const uint8_t* qblock(const QMatrix& m, const uint8_t* row, int64_t b) { return row + m.boff[b]; }

// Rows n0, n0 + 1, ... of a matrix in order, with no division per row: where each row's bytes and
// (affine) scales start.
struct RowCursor {
  const QMatrix& m;
  int64_t blk, r;
  RowCursor(const QMatrix& matrix, int64_t n0) : m(matrix), blk(n0 / matrix.rpb), r(n0 % matrix.rpb) {}
  int64_t id() const { return m.row_ids ? m.row_ids[blk] : blk; }
  const uint8_t* row() const { return m.w + id() * m.wb + r * m.wr; }
  int64_t scales() const { return id() * m.sb + r * m.sr; }  // bytes from the scales' start
  void next() {
    if (++r == m.rpb) r = 0, blk++;
  }
};

// Byte offset of row n's scales (and biases) for affine kinds; block b's at that plus soff[b].
inline int64_t qscale_row(const QMatrix& m, int64_t n) {
  if (m.one_block) return n * m.sr;
  const int64_t blk = m.row_ids ? m.row_ids[n / m.rpb] : n / m.rpb;
  return blk * m.sb + (n % m.rpb) * m.sr;
}

// T rows of x quantized for one code order (q8_quantize.cpp): row t's codes at q + t * K; with nb = K /
// 32 blocks, the scale and code sum of quarter u of block b at d, s8 + (t * 4 + u) * nb + b (each
// quarter's row of blocks side by side), S(b) at s + t * nb + b.
struct ActRows {
  int64_t T, K;
  int order;
  int8_t* q;
  float* d;     // d(b, u)
  float* s;     // S(b)
  int32_t* s8;  // the sum of quarter u's codes
};

// L rows of x (a tile; rows past T are zeros) with the rows in lanes, for the tile kernels: the codes
// of inputs 4c .. 4c + 3 of rows 0 .. L-1 at q + c * 4L (natural order); d and s8 of quarter u of
// block b of every row at d, s8 + (b * 4 + u) * L, and S(b) at s + b * L.
struct ActTile {
  int64_t K;
  int lanes;
  int8_t* q;
  float* d;
  float* s;
  int32_t* s8;
};

// q8_quantize.cpp: rows t0 .. t0 + T of x [*, K] into `out` (arrays sized for T rows), in `order`;
// and a tile of `lanes` rows from t0 (rows at or past t_end are zeros).
void quantize_rows(const float* x, int64_t K, int64_t T, int order, ActRows& out);
void quantize_tile(const float* x, int64_t K, int64_t t0, int64_t t_end, int lanes, ActTile& out);

// Every path computes outputs n0 .. n1 (all T rows of x) and returns false when it has no loop for the
// problem. `rows` holds x in the kind's order (act_order); `tiles` (may be null when T < TILE_ROWS)
// the tiles of `lanes` rows, tile i at tiles[i]. y [T, N].
struct Q8Job {
  const QMatrix* m;
  const ActRows* rows;
  const ActTile* tiles;
  int64_t n_tiles;
  float* y;
};
constexpr int64_t TILE_ROWS = 8;  // rows of x from which a product runs the tile kernels

void q8_portable(const Q8Job& job, int64_t n0, int64_t n1);

// y [T, N] = x [T, K] times m in the q8 arithmetic, on `threads` threads of the pool (q8_matmul.cpp).
// Returns 0, or a negative code for a matrix the q8 kernels do not read (q8_reads says which do).
int q8_matmul(const QMatrix& m, const float* x, int64_t T, float* y, int threads);

// Whether the q8 kernels read a matrix: rows are outputs, and affine codes are 2, 4 or 8 bits in
// groups of a multiple of 32 (every GGUF block kind qualifies). Others run the float arithmetic.
constexpr bool q8_reads(int kind, int bits, int group, bool transposed) {
  return transposed && (kind != 0 || ((bits == 2 || bits == 4 || bits == 8) && group % 32 == 0));
}

namespace q8 {  // the portable path's pieces, which the vector paths use for rare layouts and tails
void block_codes(const QMatrix& m, const uint8_t* row, int64_t b, uint8_t* codes);  // natural order
void block_factors(const QMatrix& m, int64_t n, const uint8_t* row, int64_t b, float* sc, float* off);  // sc[2]: halves
int act_position(int order, int e);  // natural input e's place among its block's 32 activation codes
}  // namespace q8
#if MF_X86
bool q8_avx512_vnni(const Q8Job& job, int64_t n0, int64_t n1);
bool q8_avx512_bw(const Q8Job& job, int64_t n0, int64_t n1);
bool q8_avx2(const Q8Job& job, int64_t n0, int64_t n1);
bool q8_avxvnni(const Q8Job& job, int64_t n0, int64_t n1);
bool q8_avxvnni_evex(const Q8Job& job, int64_t n0, int64_t n1);
#endif

}  // namespace mf
