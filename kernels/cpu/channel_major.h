// Shared by the channel-major product's translation units (channel_major.cpp: what it computes, the
// layout, entry points and dispatch; channel_major_x86.cpp: the AVX-512 and AVX2 loops;
// channel_major_ffn.cpp: a gated FFN layer of two or three such products). Each x86 function carries
// target attributes; channel_major.cpp calls them only after the CPU said it has the instructions (the
// level qmatmul.cpp chose, forced by mf_set_isa in tests).
#pragma once

#include <cstdint>

#include "qmatmul.h"

namespace mf {

// The layout (see channel_major.cpp): outputs padded to a multiple of CM_STEP; per group of `group`
// inputs a block: each channel's codes for every output (a run of padded * bits / 8 bytes, output n's
// code in the 16-byte block of n * bits / 128), then the group's scales, then its biases (padded each,
// in the stored type). CM_STEP is 64 outputs: a 16-byte block of 2-bit codes, one 4-vector step of the
// AVX-512 loops, so the padding (at most 63 outputs) keeps every loop in whole steps; every width of
// the default model and the 7B is a multiple of it, so none is computed for nothing.
constexpr int64_t CM_STEP = 64;
// Outputs a decode pass keeps in registers per group (16 AVX-512 vectors): the loops walk a thread's
// outputs in tiles of CM_TILE, the last one of its range possibly narrower (a multiple of CM_STEP).
constexpr int64_t CM_TILE = 256;
// Rows a multi-row pass shares each widened code between, at most (the register tile of AVX-512:
// 6 rows x 64 outputs is 24 accumulators); the portable and AVX2 paths take fewer.
constexpr int CM_MAX_ROWS = 6;
// Entries the lists of active channels hold past K: cm_list_avx512 stores 16 lanes at a time.
constexpr int64_t CM_LIST_SLACK = 16;

struct CmShape {
  int64_t N, K;
  int bits, group, scale_type;
  int64_t groups;
  int64_t padded;  // N rounded up to CM_STEP: outputs the layout holds
  int64_t ssize;   // bytes of one scale
  int64_t run;     // bytes of one channel's codes for every output: padded * bits / 8
  int64_t block;   // bytes of one group: its channels' runs, scales, biases
  // Bytes from a run's start to output n's codes (n a multiple of CM_STEP).
  int64_t codes_at(int64_t n) const { return n * bits / 8; }
  // Group g's scales from output n (its biases lie padded * ssize bytes further).
  const uint8_t* scales(const uint8_t* w, int64_t g, int64_t n) const { return w + g * block + group * run + n * ssize; }
  int64_t biases_after_scales() const { return padded * ssize; }
};

// The shape of an N x K matrix in the layout, or a negative code for what the product refuses (bits
// 2, 4, 8; groups of 32 .. 256 in steps of 32 dividing K; scale type 0 f16, 1 bf16, 2 f32).
int cm_shape(int64_t N, int64_t K, int bits, int group, int scale_type, CmShape* s);

// y [T, N] = x [T, K] times the layout at `w` (arguments checked by the caller), counts added to
// counts[3] (rows, active channels, active groups); what mf_cm_matmul computes.
void cm_product(const CmShape& s, const uint8_t* w, const float* x, int64_t T, float threshold, float* y, int threads,
                int64_t* counts);

// The active channels of a tile of rows (`rows` rows of x, each K floats apart), in ascending order:
// group g's are entries gstart[g] .. gstart[g + 1] of `col` (the channel) and `off` (where its run of
// codes starts, in bytes from the layout's start). x: the rows' inputs; where rows > 1 and channels
// are zeroed, a copy with every inactive entry set to +0 (so a channel active in one row only adds
// nothing to the others). xs [rows, groups]: each row's sum of its active inputs per group.
struct CmRows {
  const float* x;
  int64_t rows, K;
  const int32_t* gstart;
  const int32_t* col;
  const int64_t* off;
  const float* xs;
};

// Outputs n0..n1 (multiples of CM_STEP, n1 <= padded) for one tile of rows: y row r at y + r * N. Each
// writes every output of its range below N and reads no code of an inactive channel and no scale of
// a group without an active one. Groups are walked one after another, each over the range in tiles
// of CM_TILE (so a thread reads each active channel's codes as one stretch of its run), the sums kept
// in per-thread scratch. The x86 ones return false when they have no loop for the problem.
void cm_tiles_portable(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1);
#if MF_X86
// A row's lists of active channels (CmRows' gstart, col, off), 16 channels at a time.
void cm_list_avx512(const CmShape& s, const float* x, float threshold, bool all, int32_t* gstart, int32_t* col,
                    int64_t* off);
bool cm_tiles_avx512(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1);
bool cm_tiles_avx2(const CmShape& s, const uint8_t* w, const CmRows& r, float* y, int64_t n0, int64_t n1);
#endif

// Code o of a channel's codes from output n (a multiple of CM_STEP): 16-byte blocks of 16 * (8 / bits)
// outputs; output j of a block sits in byte j % 16 at bits * (j / 16) (a 4-bit block: its first 16
// outputs in the low nibbles, the next 16 in the high ones), so widening 16 bytes to 16 dwords and
// shifting them gives 16 consecutive outputs.
inline int cm_code(const uint8_t* codes, int bits, int64_t o) {
  const int64_t span = 16 * (8 / bits), r = o % span;
  return (codes[(o / span) * 16 + r % 16] >> (bits * (r / 16))) & ((1 << bits) - 1);
}

}  // namespace mf
