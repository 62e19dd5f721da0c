// Attention on the CPU: softmax(scale * q k^T, masked) v for every query row, over keys and values
// wherever a KV layout keeps them, in one pass over the keys (online softmax, as flash attention:
// no [T, S] score matrix is ever held). Float32 queries, keys and values (float16 keys and values
// are widened as they are read), float32 accumulation.
//
// What each query sees. Row b of a batch holds kv_len[b] keys; its first query sits at position
// q_pos[b] and query t at q_pos[b] + t; query t sees key j when j <= max(q_pos[b] + t, 0) and j <
// kv_len[b] (one sequence's causal prompt: q_pos = S - T, kv_len = S; a decode step: T = 1; a query
// before position 0, a left-padded step's padding column, sees key 0 rather than nothing). With a
// window w > 0 (Gemma 3's sliding layers) it also sees only j > q_pos[b] + t - w: its last w keys,
// its own included; the key blocks before the first query's window are not read. Grouped-query
// attention: query head h reads key head h / (Hq / Hkv).
//
// Where keys lie. Key j of row b, head h is at
//   k + block * ksb + h * ksh + (j % block_tokens) * kst   (elements),
//   block = table ? table[b * max_blocks + j / block_tokens] : b   (and j % block_tokens -> j)
// so one buffer per row (a plain cache: no table) and a pool of fixed-size chunks named by a slot
// table (the service's chunked contexts) are read where they lie; values alike with their strides.
//
// Work: one unit is a row, a key head and a tile of up to TQ queries of every query head sharing it,
// so each key block is read once for G * TQ query rows. Keys come in blocks of KB, transposed into a
// small tile so scores are computed KB at a time along the lanes; probabilities times values along
// the head dimension. Units are dealt round-robin to the pool's threads (late query tiles of a causal
// prompt see more keys). Plain-ops reference: kernels/attention_ref.py.
//
// Compressed KV (mf_attention_coded). Each row's first coded[b] keys (and, counted apart, values)
// are affine codes described by an mf_kv_codes (kv_codes.h), dequantized one block at a time as
// the block is gathered, in float32 as models/kv_quant.py's dequantize (code * scale, then + bias):
// no float copy of the context is made, and the result equals this kernel over the dequantized
// floats bit for bit. With a slot table the codes' blocks are named by it; the float keys after
// them (a residual not yet quantized) are read at token j - coded[b] of row b, without the table.
//
// Chunks of mixed widths (mf_attention_mixed). A slot table names every block of every row, and a
// class table of the same shape says what the block is: 0, a float chunk of the pool k, v (read as
// mf_attention reads a table's blocks); c > 0, coded keys through kc[c - 1] and values through
// vc[c - 1], the table's entry being the block index those layouts take (the service's chunks at
// 8, 4 and 2 bits in one arena, block index = byte offset / the layouts' block stride). A layout of
// 32 bits is raw float32 (strides in floats, no scales): a chunk kept exact in the same arena.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_codes.h"
#include "qmatmul.h"
// after qmatmul.h, which says whether this is x86 (MF_X86)
#include "attention_avx512.h"

namespace mf {
void run_parts(int parts, void (*fn)(void*, int), void* arg);
int current_isa();
}  // namespace mf

using namespace mf;

namespace {

constexpr int KB = 64;  // keys per block
constexpr int TQ = 16;  // queries per tile
constexpr int L = 16;   // lanes of the partial sums and maxima
constexpr int RB = 4;   // query rows computed together

struct Attn {
  const float* q;
  int64_t B, Hq, T, hd, qsb, qsh, qst;
  const uint8_t* k;
  const uint8_t* v;
  int kv_type;  // 0 float32, 1 float16
  int64_t Hkv, ksb, ksh, kst, vsb, vsh, vst;
  const int32_t* table;
  int64_t max_blocks, block_tokens;
  const int32_t* kv_len;
  const int32_t* q_pos;
  float scale;
  float* out;
  int64_t osb, osh, ost;
  // compressed KV: both null, or both given with the per-row counts of coded keys and values
  const mf_kv_codes* kc = nullptr;
  const mf_kv_codes* vc = nullptr;
  const int32_t* k_coded = nullptr;
  const int32_t* v_coded = nullptr;
  // chunks of mixed widths: each block's class (0 float, c > 0 layouts kcs[c - 1], vcs[c - 1]), or null
  const int32_t* cls = nullptr;
  const mf_kv_codes* kcs = nullptr;
  const mf_kv_codes* vcs = nullptr;
  int64_t window = 0;  // keys a query sees back from its own position (0: all)
};

#define MF_INLINE inline __attribute__((always_inline))

MF_INLINE float kv_at(const uint8_t* base, int type, int64_t i) {
  if (type == 0) return reinterpret_cast<const float*>(base)[i];
  return half_to_float(reinterpret_cast<const uint16_t*>(base)[i]);
}

// Where key (or value) j of row b, head h starts, in elements.
MF_INLINE int64_t kv_index(const Attn& p, int64_t b, int64_t h, int64_t j, int64_t sb, int64_t sh, int64_t st) {
  if (p.table == nullptr) return b * sb + h * sh + j * st;
  const int64_t blk = p.table[b * p.max_blocks + j / p.block_tokens];
  return blk * sb + h * sh + (j % p.block_tokens) * st;
}

// Coded element (token t of block or row blk, head h, channel d), dequantized as models/kv_quant.py does.
MF_INLINE float coded_elem(const mf_kv_codes& c, int64_t blk, int64_t h, int64_t t, int64_t d) {
  if (c.bits == 32) {  // raw float32: the strides count floats, no scale or bias
    float x;
    std::memcpy(&x, c.base + c.codes + 4 * (blk * c.cs[0] + h * c.cs[1] + t * c.cs[2] + d * c.cs[3]), 4);
    return x;
  }
  const int64_t bit = (blk * c.cs[0] + h * c.cs[1] + t * c.cs[2] + d * c.cs[3]) * c.bits;
  const uint32_t code = (c.base[c.codes + (bit >> 3)] >> (bit & 7)) & ((1u << c.bits) - 1u);
  const int64_t si = blk * c.ss[0] + h * c.ss[1] + (t / c.group_tokens) * c.ss[2] + (d / c.group_channels) * c.ss[3];
  uint16_t sh, bh;
  std::memcpy(&sh, c.base + c.scales + 2 * si, 2);
  std::memcpy(&bh, c.base + c.biases + 2 * si, 2);
  const float scaled = static_cast<float>(code) * half_to_float(sh);  // rounded, then the bias added
  return scaled + half_to_float(bh);
}

MF_INLINE float coded_at(const Attn& p, const mf_kv_codes& c, int64_t b, int64_t h, int64_t j, int64_t d) {
  if (p.table == nullptr) return coded_elem(c, b, h, j, d);
  return coded_elem(c, p.table[b * p.max_blocks + j / c.block_tokens], h, j % c.block_tokens, d);
}

// Key (or value) j of row b, head h into dst[d * step], d < hd: codes, the float residual after them,
// or (no codes) the float buffer where its layout keeps it.
MF_INLINE void load_row(const Attn& p, const uint8_t* base, const mf_kv_codes* c, const int32_t* coded, int64_t sb,
                        int64_t sh, int64_t st, int64_t b, int64_t h, int64_t j, float* dst, int64_t step) {
  if (c != nullptr && j < coded[b]) {
    for (int64_t d = 0; d < p.hd; d++) dst[d * step] = coded_at(p, *c, b, h, j, d);
    return;
  }
  const int64_t i = c != nullptr ? b * sb + h * sh + (j - coded[b]) * st : kv_index(p, b, h, j, sb, sh, st);
  if (p.kv_type == 0) {  // float32: a copy (values) or a strided store (keys, transposed), no per-element dtype test
    const float* src = reinterpret_cast<const float*>(base) + i;
    if (step == 1) {
      std::memcpy(dst, src, static_cast<size_t>(p.hd) * sizeof(float));
      return;
    }
    for (int64_t d = 0; d < p.hd; d++) dst[d * step] = src[d];
    return;
  }
  for (int64_t d = 0; d < p.hd; d++) dst[d * step] = kv_at(base, p.kv_type, i + d);
}

// Keys (or values) j0 .. j0 + nk - 1 of row b, head h, every one coded and in one block (or row),
// into dst[d * dstep + j * jstep]: the scales and biases of the groups they span turned to float
// once, then each code times its scale, plus its bias (two roundings, as load_row's coded_at), the
// loops ordered along the packed axis. False where that does not hold (the caller loads row by row).
constexpr int64_t MAX_GROUPS = 1024, MAX_HD = 512;
// Tokens t0 .. t0 + nk - 1 of block (or row) blk, head h, through layout c, as load_coded_run says.
MF_INLINE bool decode_run(const mf_kv_codes& c, int64_t hd, int64_t blk, int64_t h, int64_t t0, int64_t nk, float* dst,
                          int64_t jstep, int64_t dstep) {
  if (hd > MAX_HD || nk > KB) return false;
  if (c.bits == 32) {  // raw float32 (a chunk kept exact beside codes): copied, a row at a time where it can be
    const int64_t base = blk * c.cs[0] + h * c.cs[1] + t0 * c.cs[2];
    for (int64_t j = 0; j < nk; j++) {
      const uint8_t* src = c.base + c.codes + 4 * (base + j * c.cs[2]);
      if (c.cs[3] == 1 && dstep == 1) {
        std::memcpy(dst + j * jstep, src, static_cast<size_t>(hd) * 4);
        continue;
      }
      for (int64_t d = 0; d < hd; d++) std::memcpy(dst + d * dstep + j * jstep, src + 4 * d * c.cs[3], 4);
    }
    return true;
  }
  const int64_t gt = c.group_tokens, gc = c.group_channels;
  const int64_t tg0 = t0 / gt, ntg = (t0 + nk - 1) / gt - tg0 + 1, ncg = (hd + gc - 1) / gc;
  if (ntg * ncg > MAX_GROUPS) return false;
  float sc[MAX_GROUPS], bi[MAX_GROUPS];
  for (int64_t tg = 0; tg < ntg; tg++)
    for (int64_t cg = 0; cg < ncg; cg++) {
      const int64_t si = blk * c.ss[0] + h * c.ss[1] + (tg0 + tg) * c.ss[2] + cg * c.ss[3];
      uint16_t sh, bh;
      std::memcpy(&sh, c.base + c.scales + 2 * si, 2);
      std::memcpy(&bh, c.base + c.biases + 2 * si, 2);
      sc[tg * ncg + cg] = half_to_float(sh);
      bi[tg * ncg + cg] = half_to_float(bh);
    }
  int32_t tgj[KB], cgd[MAX_HD];
  for (int64_t j = 0; j < nk; j++) tgj[j] = (int32_t)(((t0 + j) / gt - tg0) * ncg);
  for (int64_t d = 0; d < hd; d++) cgd[d] = (int32_t)(d / gc);
  const uint8_t* codes = c.base + c.codes;
  const int64_t base = blk * c.cs[0] + h * c.cs[1] + t0 * c.cs[2], bits = c.bits;
  const uint32_t mask = (1u << bits) - 1u;
  auto one = [&](int64_t j, int64_t d) {
    const int64_t bit = (base + j * c.cs[2] + d * c.cs[3]) * bits;
    const uint32_t code = (codes[bit >> 3] >> (bit & 7)) & mask;
    const int32_t g = tgj[j] + cgd[d];
    const float scaled = static_cast<float>(code) * sc[g];
    dst[d * dstep + j * jstep] = scaled + bi[g];
  };
  // Along the packed axis (the inner loop) a run of codes starts on a byte: unpacked a byte at a
  // time, then scaled, so the compiler vectorizes both. Keys: a channel's nk tokens into a row of
  // the transposed tile; values: a token's hd channels into its row.
  const bool tokens_inner = c.cs[2] == 1 && c.cs[3] != 1;
  const int64_t outer = tokens_inner ? hd : nk, inner = tokens_inner ? nk : hd;
  const int64_t ostride = tokens_inner ? c.cs[3] : c.cs[2];
  const bool packed = (tokens_inner || c.cs[3] == 1) && (inner * bits) % 8 == 0 && (base * bits) % 8 == 0 &&
                      (ostride * bits) % 8 == 0 && (tokens_inner ? jstep : dstep) == 1;
  if (!packed) {
    if (tokens_inner) {
      for (int64_t d = 0; d < hd; d++)
        for (int64_t j = 0; j < nk; j++) one(j, d);
    } else {
      for (int64_t j = 0; j < nk; j++)
        for (int64_t d = 0; d < hd; d++) one(j, d);
    }
    return true;
  }
  alignas(64) float cf[MAX_HD > KB ? MAX_HD : KB];
  for (int64_t o = 0; o < outer; o++) {
    const uint8_t* src = codes + ((base + o * ostride) * bits >> 3);
    if (bits == 8) {
      for (int64_t i = 0; i < inner; i++) cf[i] = static_cast<float>(src[i]);
    } else if (bits == 4) {
      for (int64_t i = 0; i < inner / 2; i++) {
        cf[2 * i] = static_cast<float>(src[i] & 15u);
        cf[2 * i + 1] = static_cast<float>(src[i] >> 4);
      }
    } else {
      for (int64_t i = 0; i < inner / 4; i++)
        for (int k = 0; k < 4; k++) cf[4 * i + k] = static_cast<float>((src[i] >> (2 * k)) & 3u);
    }
    float* out = dst + o * (tokens_inner ? dstep : jstep);
    const int32_t* gi = tokens_inner ? tgj : cgd;  // the inner index's group part
    const int32_t go = tokens_inner ? cgd[o] : tgj[o];
    const int64_t seg = tokens_inner ? gt : gc, first = tokens_inner ? t0 % gt : 0;  // inner elements a scale covers
    for (int64_t i = 0; i < inner;) {
      const int64_t e = std::min(inner, i + seg - (i + first) % seg);
      const float sg = sc[go + gi[i]], bg = bi[go + gi[i]];
      for (int64_t k = i; k < e; k++) {
        const float scaled = cf[k] * sg;
        out[k] = scaled + bg;
      }
      i = e;
    }
  }
  return true;
}

MF_INLINE bool load_coded_run(const Attn& p, const mf_kv_codes& c, const int32_t* coded, int64_t b, int64_t h,
                              int64_t j0, int64_t nk, float* dst, int64_t jstep, int64_t dstep) {
  if (j0 + nk > coded[b]) return false;
  int64_t blk = b, t0 = j0;
  if (p.table != nullptr) {
    if (j0 / c.block_tokens != (j0 + nk - 1) / c.block_tokens) return false;
    blk = p.table[b * p.max_blocks + j0 / c.block_tokens];
    t0 = j0 % c.block_tokens;
  }
  return decode_run(c, p.hd, blk, h, t0, nk, dst, jstep, dstep);
}

// Float32 keys (or values) j0 .. j0 + nk - 1 of row b, head h, not coded, into dst[d * dstep + j *
// jstep]: a chunk's run at a time from one base (no table lookup and division per key: a 16-row
// decode step's attention 7-10% faster, interleaved A/B), values copied whole, keys into the
// transposed tile 16 at a time in registers where AVX-512 is (attention_avx512.h).
template <bool AVX512>
MF_INLINE void load_float_run(const Attn& p, const uint8_t* base, int64_t sb, int64_t sh, int64_t st, int64_t b,
                              int64_t h, int64_t j0, int64_t nk, float* dst, int64_t jstep, int64_t dstep) {
  const float* src0 = reinterpret_cast<const float*>(base);
  const int64_t bt = p.table != nullptr ? p.block_tokens : nk;
  for (int64_t j = j0; j < j0 + nk;) {
    const int64_t e = p.table != nullptr ? std::min(j0 + nk, (j / bt + 1) * bt) : j0 + nk;
    const float* src = src0 + kv_index(p, b, h, j, sb, sh, st);
    float* out = dst + (j - j0) * jstep;
    const int64_t n = e - j;
    if (dstep == 1) {
      for (int64_t i = 0; i < n; i++) std::memcpy(out + i * jstep, src + i * st, static_cast<size_t>(p.hd) * 4);
    } else {
      int64_t i = 0;
      if constexpr (AVX512)
        if (jstep == 1 && p.hd % 16 == 0)
          for (; i + 16 <= n; i += 16) transpose_keys16(src + i * st, st, p.hd, out + i, dstep);
      for (; i < n; i++)
        for (int64_t d = 0; d < p.hd; d++) out[d * dstep + i * jstep] = src[i * st + d];
    }
    j = e;
  }
}

// Keys and values j0 .. j0 + nk - 1 of row b, head h, of chunks of mixed widths (p.cls): the keys
// transposed into kt[d * KB + j], the values as rows vb[j * hdp + d]; a run of one chunk at a time.
template <bool AVX512>
MF_INLINE void load_mixed(const Attn& p, int64_t b, int64_t h, int64_t j0, int64_t nk, float* kt, float* vb,
                          int64_t hdp) {
  const int64_t bt = p.block_tokens;
  for (int64_t j = j0; j < j0 + nk;) {
    const int64_t i = j / bt, e = std::min(j0 + nk, (i + 1) * bt);
    const int32_t c = p.cls[b * p.max_blocks + i];
    if (c > 0) {
      const mf_kv_codes &kc = p.kcs[c - 1], &vc = p.vcs[c - 1];
      const int64_t blk = p.table[b * p.max_blocks + i], t0 = j % bt;
      if (!decode_run(kc, p.hd, blk, h, t0, e - j, kt + (j - j0), 1, KB))
        for (int64_t jj = j; jj < e; jj++)
          for (int64_t d = 0; d < p.hd; d++) kt[d * KB + (jj - j0)] = coded_elem(kc, blk, h, jj - i * bt, d);
      if (!decode_run(vc, p.hd, blk, h, t0, e - j, vb + (j - j0) * hdp, hdp, 1))
        for (int64_t jj = j; jj < e; jj++)
          for (int64_t d = 0; d < p.hd; d++) vb[(jj - j0) * hdp + d] = coded_elem(vc, blk, h, jj - i * bt, d);
    } else if (p.kv_type == 0) {
      load_float_run<AVX512>(p, p.k, p.ksb, p.ksh, p.kst, b, h, j, e - j, kt + (j - j0), 1, KB);
      load_float_run<AVX512>(p, p.v, p.vsb, p.vsh, p.vst, b, h, j, e - j, vb + (j - j0) * hdp, hdp, 1);
    } else {
      for (int64_t jj = j; jj < e; jj++) {
        load_row(p, p.k, nullptr, nullptr, p.ksb, p.ksh, p.kst, b, h, jj, kt + (jj - j0), KB);
        load_row(p, p.v, nullptr, nullptr, p.vsb, p.vsh, p.vst, b, h, jj, vb + (jj - j0) * hdp, 1);
      }
    }
    j = e;
  }
}

// exp(x) for x <= 0 to about 2 ulp, written so compilers vectorize it (no libm call, no rounding
// function): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n through the exponent
// bits; n is rounded by adding and taking away 1.5 * 2^23. Inputs are clamped to [-87, 0] (below,
// about 1.6e-38 rather than underflow): masked keys are zeroed by the caller, never by this.
MF_INLINE float exp_neg(float x) {
  x = x < -87.f ? -87.f : (x > 0.f ? 0.f : x);
  const float shifted = x * 1.44269504088896341f + 12582912.f;
  const float n = shifted - 12582912.f;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float e = 1.f / 720.f;
  e = e * r + 1.f / 120.f;
  e = e * r + 1.f / 24.f;
  e = e * r + 1.f / 6.f;
  e = e * r + 0.5f;
  e = e * r + 1.f;
  e = e * r + 1.f;
  const int32_t ni = __builtin_bit_cast(int32_t, shifted) - __builtin_bit_cast(int32_t, 12582912.f);
  return e * __builtin_bit_cast(float, (ni + 127) << 23);
}

struct Scratch {
  std::vector<float> q, acc, kt, vb, m, l;
  int64_t hdp;
  Scratch(int64_t rows, int64_t hd) : hdp((hd + L - 1) / L * L) {
    q.assign(rows * hdp, 0.f);
    acc.assign(rows * hdp, 0.f);
    kt.assign(hdp * KB, 0.f);
    vb.assign(KB * hdp, 0.f);
    m.assign(rows, 0.f);
    l.assign(rows * L, 0.f);
  }
};

// One unit: row b, key head kvh, queries t0..t1 of its G query heads.
template <bool AVX512>
MF_INLINE void unit_body(const Attn& p, int64_t b, int64_t kvh, int64_t t0, int64_t t1, Scratch& s) {
  const int64_t G = p.Hq / p.Hkv, nt = t1 - t0, R = G * nt, hd = p.hd, hdp = s.hdp;
  const int64_t len = p.kv_len[b], pos = p.q_pos[b];
  float* q = s.q.data();
  float* acc = s.acc.data();
  float* kt = s.kt.data();
  float* vb = s.vb.data();
  for (int64_t g = 0; g < G; g++)
    for (int64_t t = 0; t < nt; t++) {
      const float* src = p.q + b * p.qsb + (kvh * G + g) * p.qsh + (t0 + t) * p.qst;
      float* dst = q + (g * nt + t) * hdp;
      for (int64_t d = 0; d < hd; d++) dst[d] = src[d] * p.scale;
    }
  for (int64_t i = 0; i < R * hdp; i++) acc[i] = 0.f;
  for (int64_t r = 0; r < R; r++) s.m[r] = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < R * L; i++) s.l[i] = 0.f;
  const int64_t kend = std::min(len, std::max<int64_t>(pos + t1, 1));  // keys the last query sees
  // The first key the first query sees, in whole blocks: earlier blocks would be masked for every row.
  const int64_t kbegin = p.window > 0 ? std::max<int64_t>(pos + t0 - p.window + 1, 0) / KB * KB : 0;
  alignas(64) float sc[RB][KB];
  for (int64_t j0 = kbegin; j0 < kend; j0 += KB) {
    const int64_t nk = std::min<int64_t>(KB, kend - j0);
    // the block's keys transposed, its values as rows: a coded block at once where it can be
    if (p.cls != nullptr) {
      load_mixed<AVX512>(p, b, kvh, j0, nk, kt, vb, hdp);
    } else if (p.kc == nullptr && p.kv_type == 0) {
      load_float_run<AVX512>(p, p.k, p.ksb, p.ksh, p.kst, b, kvh, j0, nk, kt, 1, KB);
      load_float_run<AVX512>(p, p.v, p.vsb, p.vsh, p.vst, b, kvh, j0, nk, vb, hdp, 1);
    } else {
      if (p.kc == nullptr || !load_coded_run(p, *p.kc, p.k_coded, b, kvh, j0, nk, kt, 1, KB))
        for (int64_t j = 0; j < nk; j++)
          load_row(p, p.k, p.kc, p.k_coded, p.ksb, p.ksh, p.kst, b, kvh, j0 + j, kt + j, KB);
      if (p.vc == nullptr || !load_coded_run(p, *p.vc, p.v_coded, b, kvh, j0, nk, vb, hdp, 1))
        for (int64_t j = 0; j < nk; j++)
          load_row(p, p.v, p.vc, p.v_coded, p.vsb, p.vsh, p.vst, b, kvh, j0 + j, vb + j * hdp, 1);
    }
    // Scores and probabilities are computed for the block's keys in whole lanes only (a 129-key
    // context's third block holds one key): the keys past nk in them are zeros, masked below.
    const int64_t n16 = (nk + L - 1) / L * L;
    for (int64_t j = nk; j < n16; j++)
      for (int64_t d = 0; d < hd; d++) kt[d * KB + j] = 0.f;
    // RB query rows at a time: each key (and value) vector loaded once for all of them, their
    // partial sums held in registers across the head dimension (scores) or the block (outputs).
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const int nr = (int)std::min<int64_t>(RB, R - r0);
      int64_t lo[RB], lim[RB];
      for (int rr = 0; rr < RB; rr++) {  // keys of this block row r0 + rr sees: [lo, lim)
        const int64_t t = t0 + (r0 + std::min(rr, nr - 1)) % nt;
        lim[rr] = rr < nr ? std::min(len, std::max<int64_t>(pos + t + 1, 1)) - j0 : 0;
        lo[rr] = p.window > 0 ? std::max<int64_t>(pos + t - p.window + 1, 0) - j0 : 0;
      }
      if constexpr (AVX512) {
        const float* qr[RB];
        for (int rr = 0; rr < RB; rr++) qr[rr] = q + (r0 + std::min(rr, nr - 1)) * hdp;
        tile_scores(qr, kt, KB, hd, n16, &sc[0][0], KB);
      } else {
        for (int jc = 0; jc < n16; jc += L) {
          float a[RB][L];
          for (int rr = 0; rr < RB; rr++)
            for (int i = 0; i < L; i++) a[rr][i] = 0.f;
          for (int64_t d = 0; d < hd; d++) {
            const float* kd = kt + d * KB + jc;
            for (int rr = 0; rr < RB; rr++) {
              const float qd = q[(r0 + std::min(rr, nr - 1)) * hdp + d];
              for (int i = 0; i < L; i++) a[rr][i] += qd * kd[i];
            }
          }
          for (int rr = 0; rr < RB; rr++)
            for (int i = 0; i < L; i++) sc[rr][jc + i] = a[rr][i];
        }
      }
      float c[RB];
      for (int rr = 0; rr < RB; rr++) {
        const int64_t r = r0 + rr;
        c[rr] = 1.f;
        if (lim[rr] <= 0 || lim[rr] <= lo[rr]) {  // a row that sees no key of this block: its sums stay
          for (int j = 0; j < n16; j++) sc[rr][j] = 0.f;
          continue;
        }
        float mx[L];
        for (int i = 0; i < L; i++) mx[i] = -std::numeric_limits<float>::infinity();
        if constexpr (AVX512) {
          masked_max(sc[rr], n16, lo[rr], lim[rr], mx);
        } else {
          for (int j0l = 0; j0l < n16; j0l += L)
            for (int i = 0; i < L; i++) {
              const bool in = j0l + i >= lo[rr] && j0l + i < lim[rr];
              const float v = in ? sc[rr][j0l + i] : -std::numeric_limits<float>::infinity();
              mx[i] = v > mx[i] ? v : mx[i];
            }
        }
        float mb = mx[0];
        for (int i = 1; i < L; i++) mb = mx[i] > mb ? mx[i] : mb;
        const float m_old = s.m[r], m_new = mb > m_old ? mb : m_old;
        c[rr] = m_old == -std::numeric_limits<float>::infinity() ? 0.f : exp_neg(m_old - m_new);
        float* lr = s.l.data() + r * L;
        for (int i = 0; i < L; i++) lr[i] *= c[rr];
        if constexpr (AVX512) {
          masked_exp(sc[rr], n16, lo[rr], lim[rr], m_new, lr);
        } else {
          for (int j0l = 0; j0l < n16; j0l += L)
            for (int i = 0; i < L; i++) {
              const float e = exp_neg(sc[rr][j0l + i] - m_new);
              const float pj = j0l + i >= lo[rr] && j0l + i < lim[rr] ? e : 0.f;
              sc[rr][j0l + i] = pj;
              lr[i] += pj;
            }
        }
        s.m[r] = m_new;
      }
      int64_t last = 0;
      for (int rr = 0; rr < nr; rr++) last = std::max(last, std::min<int64_t>(nk, lim[rr]));
      if constexpr (AVX512) {
        float* ar[RB];
        for (int rr = 0; rr < RB; rr++) ar[rr] = acc + (r0 + std::min(rr, nr - 1)) * hdp;
        tile_values(ar, c, &sc[0][0], KB, vb, hdp, last, nr);
        continue;
      }
      for (int64_t dc = 0; dc < hdp; dc += L) {
        float a[RB][L];
        for (int rr = 0; rr < RB; rr++) {
          const float* ar = acc + (r0 + std::min(rr, nr - 1)) * hdp + dc;
          for (int i = 0; i < L; i++) a[rr][i] = ar[i] * c[rr];
        }
        for (int64_t j = 0; j < last; j++) {
          const float* vj = vb + j * hdp + dc;
          for (int rr = 0; rr < RB; rr++) {
            const float pj = sc[rr][j];
            for (int i = 0; i < L; i++) a[rr][i] += pj * vj[i];
          }
        }
        for (int rr = 0; rr < nr; rr++) {
          float* ar = acc + (r0 + rr) * hdp + dc;
          for (int i = 0; i < L; i++) ar[i] = a[rr][i];
        }
      }
    }
  }
  for (int64_t g = 0; g < G; g++)
    for (int64_t t = 0; t < nt; t++) {
      const int64_t r = g * nt + t;
      const float* lr = s.l.data() + r * L;
      float l8[8];
      for (int i = 0; i < 8; i++) l8[i] = lr[i] + lr[i + 8];
      const float lsum = ((l8[0] + l8[4]) + (l8[2] + l8[6])) + ((l8[1] + l8[5]) + (l8[3] + l8[7]));
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;  // a query that sees no key: zeros
      float* dst = p.out + b * p.osb + (kvh * G + g) * p.osh + (t0 + t) * p.ost;
      const float* ar = acc + r * hdp;
      for (int64_t d = 0; d < hd; d++) dst[d] = ar[d] * inv;
    }
}

#if MF_X86
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void unit_avx512(const Attn& p, int64_t b, int64_t kvh,
                                                                          int64_t t0, int64_t t1, Scratch& s) {
  unit_body<true>(p, b, kvh, t0, t1, s);
}
__attribute__((target("avx2,fma,f16c"))) void unit_avx2(const Attn& p, int64_t b, int64_t kvh, int64_t t0,
                                                        int64_t t1, Scratch& s) {
  unit_body<false>(p, b, kvh, t0, t1, s);
}
#endif
void unit_portable(const Attn& p, int64_t b, int64_t kvh, int64_t t0, int64_t t1, Scratch& s) {
  unit_body<false>(p, b, kvh, t0, t1, s);
}

struct Job {
  const Attn* p;
  int64_t tiles, units;
  int parts;
};

void run_part(void* arg, int part) {
  const Job& j = *static_cast<const Job*>(arg);
  const Attn& p = *j.p;
  const int64_t G = p.Hq / p.Hkv;
  Scratch s(G * TQ, p.hd);
  const int isa = current_isa();
  for (int64_t u = part; u < j.units; u += j.parts) {
    const int64_t tile = u % j.tiles, bh = u / j.tiles;
    const int64_t b = bh / p.Hkv, kvh = bh % p.Hkv;
    const int64_t t0 = tile * TQ, t1 = std::min(p.T, t0 + TQ);
#if MF_X86
    if (isa == 2) {
      unit_avx512(p, b, kvh, t0, t1, s);
      continue;
    }
    if (isa == 1) {
      unit_avx2(p, b, kvh, t0, t1, s);
      continue;
    }
#endif
    (void)isa;
    unit_portable(p, b, kvh, t0, t1, s);
  }
}

// Whether a layout's furthest code, scale and bias for `blocks` blocks (or rows) of `tokens` tokens
// lie inside its buffer: 0, or a negative code.
int check_codes(const mf_kv_codes& c, int64_t blocks, int64_t heads, int64_t tokens, int64_t hd) {
  if (c.bits != 2 && c.bits != 4 && c.bits != 8 && c.bits != 32) return -4;
  if (c.base == nullptr || c.group_tokens < 1 || c.group_channels < 1 || c.codes < 0 || c.scales < 0 || c.biases < 0)
    return -5;
  for (int i = 0; i < 4; i++)
    if (c.cs[i] < 0 || c.ss[i] < 0) return -5;
  if (blocks == 0 || tokens == 0) return 0;
  const int64_t ci = (blocks - 1) * c.cs[0] + (heads - 1) * c.cs[1] + (tokens - 1) * c.cs[2] + (hd - 1) * c.cs[3];
  const int64_t si = (blocks - 1) * c.ss[0] + (heads - 1) * c.ss[1] + (tokens - 1) / c.group_tokens * c.ss[2] +
                     (hd - 1) / c.group_channels * c.ss[3];
  if (c.codes + ci * c.bits / 8 >= c.nbytes) return -6;
  if (c.scales + 2 * si + 2 > c.nbytes || c.biases + 2 * si + 2 > c.nbytes) return -6;
  return 0;
}

// The blocks (or rows) and tokens per block a row's coded part spans; -7 for a count outside
// 0..kv_len or a residual longer than its buffer, -8 for a table entry below 0.
int coded_extent(const Attn& p, const int32_t* coded, int64_t residual_tokens, int64_t block_tokens, int64_t* blocks,
                 int64_t* tokens) {
  *blocks = p.table == nullptr ? p.B : 0;
  *tokens = p.table == nullptr ? 0 : block_tokens;
  for (int64_t b = 0; b < p.B; b++) {
    if (coded[b] < 0 || coded[b] > p.kv_len[b] || p.kv_len[b] - coded[b] > residual_tokens) return -7;
    if (p.table == nullptr) {
      *tokens = std::max<int64_t>(*tokens, coded[b]);
      continue;
    }
    if ((coded[b] + block_tokens - 1) / block_tokens > p.max_blocks) return -7;
    for (int64_t i = 0; i < (coded[b] + block_tokens - 1) / block_tokens; i++) {
      const int32_t blk = p.table[b * p.max_blocks + i];
      if (blk < 0) return -8;
      *blocks = std::max<int64_t>(*blocks, blk + 1);
    }
  }
  return 0;
}

int run(const Attn& p, int threads) {
  const int64_t tiles = (p.T + TQ - 1) / TQ, units = p.B * p.Hkv * tiles;
  int parts = threads < 1 ? 1 : threads;
  if (parts > units) parts = (int)units;
  // Small problems do not pay for waking threads: ~32K multiply-adds per part at least.
  int64_t work = 0;
  for (int64_t b = 0; b < p.B; b++) work += (int64_t)p.kv_len[b] * p.T * p.Hq * p.hd;
  while (parts > 1 && work / parts < 32768) parts--;
  Job job{&p, tiles, units, parts};
  run_parts(parts, run_part, &job);
  return 0;
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// out[b, h, t, :] = attention of query (b, h, t), see the top of this file. q: [B, Hq, T, hd] with
// strides qs (3 int64: batch, head, token; elements, the head dimension contiguous); k, v: bases
// with strides ks, vs (3 int64 each: block or row, head, token); table: int32 [B, max_blocks] or
// null (then block_tokens is unused and row b is block b); kv_len, q_pos: int32 [B]; out: float32
// with strides os (3 int64); window: 0, or the keys a query sees back from its own position. Returns 0,
// or a negative code for bad arguments.
MF_EXPORT int mf_attention(const float* q, int64_t B, int64_t Hq, int64_t T, int64_t hd, const int64_t* qs,
                           const void* k, const void* v, int kv_type, int64_t Hkv, const int64_t* ks,
                           const int64_t* vs, const int32_t* table, int64_t max_blocks, int64_t block_tokens,
                           const int32_t* kv_len, const int32_t* q_pos, float scale, float* out, const int64_t* os,
                           int threads, int64_t window) {
  if (B < 0 || T < 0 || hd < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0) return -1;
  if (kv_type != 0 && kv_type != 1) return -2;
  if (table != nullptr && (max_blocks < 1 || block_tokens < 1)) return -3;
  if (B == 0 || T == 0) return 0;
  if (window < 0) return -1;
  Attn p{q, B, Hq, T, hd, qs[0], qs[1], qs[2], static_cast<const uint8_t*>(k), static_cast<const uint8_t*>(v),
         kv_type, Hkv, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], table, max_blocks, block_tokens, kv_len,
         q_pos, scale, out, os[0], os[1], os[2]};
  p.window = window;
  return run(p, threads);
}

// As mf_attention over compressed KV: row b's keys [0, k_coded[b]) are read through kc and its values
// [0, v_coded[b]) through vc (their blocks named by `table` when given, kc->block_tokens tokens
// each); the rest of its kv_len[b] keys and values are float (kv_type) at token j - coded[b] of row b
// in k, v (strides ks, vs; residual_tokens of room). Codes: -4 bits not 8, 4, 2 or 32 (raw
// float32); -5 a layout's negative stride or offset; -6 a layout reaching past its buffer; -7 a
// count outside 0..kv_len[b] or a residual past its room; -8 a negative table entry.
MF_EXPORT int mf_attention_coded(const float* q, int64_t B, int64_t Hq, int64_t T, int64_t hd, const int64_t* qs,
                                 const void* k, const void* v, int kv_type, int64_t Hkv, const int64_t* ks,
                                 const int64_t* vs, int64_t residual_tokens, const int32_t* table, int64_t max_blocks,
                                 const int32_t* kv_len, const int32_t* q_pos, float scale, float* out,
                                 const int64_t* os, int threads, const mf_kv_codes* kc, const int32_t* k_coded,
                                 const mf_kv_codes* vc, const int32_t* v_coded) {
  if (B < 0 || T < 0 || hd < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0) return -1;
  if (kv_type != 0 && kv_type != 1) return -2;
  if (kc == nullptr || vc == nullptr || k_coded == nullptr || v_coded == nullptr || kv_len == nullptr ||
      q_pos == nullptr)
    return -3;
  if (table != nullptr && (max_blocks < 1 || kc->block_tokens < 1 || vc->block_tokens < 1)) return -3;
  if (B == 0 || T == 0) return 0;
  Attn p{q, B, Hq, T, hd, qs[0], qs[1], qs[2], static_cast<const uint8_t*>(k), static_cast<const uint8_t*>(v),
         kv_type, Hkv, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], table, max_blocks, 0, kv_len,
         q_pos, scale, out, os[0], os[1], os[2]};
  p.kc = kc;
  p.vc = vc;
  p.k_coded = k_coded;
  p.v_coded = v_coded;
  for (const auto& [c, n] : {std::make_pair(kc, k_coded), std::make_pair(vc, v_coded)}) {
    int64_t blocks = 0, tokens = 0;
    int rc = coded_extent(p, n, residual_tokens, c->block_tokens, &blocks, &tokens);
    if (rc == 0) rc = check_codes(*c, blocks, Hkv, tokens, hd);
    if (rc < 0) return rc;
  }
  return run(p, threads);
}


// As mf_attention through a slot table, each block either a float chunk of k, v (class 0) or coded
// (class c in 1..n_codes: keys through kc[c - 1], values through vc[c - 1], the table's entry the
// layouts' block index); classes: int32 [B, max_blocks] as table. Codes as mf_attention_coded's, and
// -7 for a class outside 0..n_codes or a row of more keys than its blocks.
MF_EXPORT int mf_attention_mixed(const float* q, int64_t B, int64_t Hq, int64_t T, int64_t hd, const int64_t* qs,
                                 const void* k, const void* v, int kv_type, int64_t Hkv, const int64_t* ks,
                                 const int64_t* vs, const int32_t* table, const int32_t* classes, int64_t max_blocks,
                                 int64_t block_tokens, const int32_t* kv_len, const int32_t* q_pos, float scale,
                                 float* out, const int64_t* os, int threads, int n_codes, const mf_kv_codes* kc,
                                 const mf_kv_codes* vc) {
  if (B < 0 || T < 0 || hd < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0) return -1;
  if (kv_type != 0 && kv_type != 1) return -2;
  if (table == nullptr || classes == nullptr || kv_len == nullptr || q_pos == nullptr || max_blocks < 1 ||
      block_tokens < 1 || n_codes < 0 || (n_codes > 0 && (kc == nullptr || vc == nullptr)))
    return -3;
  if (B == 0 || T == 0) return 0;
  Attn p{q, B, Hq, T, hd, qs[0], qs[1], qs[2], static_cast<const uint8_t*>(k), static_cast<const uint8_t*>(v),
         kv_type, Hkv, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], table, max_blocks, block_tokens, kv_len,
         q_pos, scale, out, os[0], os[1], os[2]};
  p.cls = classes;
  p.kcs = kc;
  p.vcs = vc;
  std::vector<int64_t> blocks(static_cast<size_t>(n_codes), 0);  // per class: its furthest block + 1
  for (int64_t b = 0; b < B; b++) {
    if (kv_len[b] < 0 || (kv_len[b] + block_tokens - 1) / block_tokens > max_blocks) return -7;
    for (int64_t i = 0; i < (kv_len[b] + block_tokens - 1) / block_tokens; i++) {
      const int32_t c = classes[b * max_blocks + i], blk = table[b * max_blocks + i];
      if (c < 0 || c > n_codes) return -7;
      if (blk < 0) return -8;
      if (c > 0) blocks[c - 1] = std::max<int64_t>(blocks[c - 1], blk + 1);
    }
  }
  for (int c = 0; c < n_codes; c++) {
    if (blocks[c] == 0) continue;
    int rc = check_codes(kc[c], blocks[c], Hkv, block_tokens, hd);
    if (rc == 0) rc = check_codes(vc[c], blocks[c], Hkv, block_tokens, hd);
    if (rc < 0) return rc;
  }
  return run(p, threads);
}

}  // extern "C"
