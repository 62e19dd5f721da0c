// Attention's gathering of keys and values, for attention.cpp, which alone includes it (what is here
// is that file's own, in an unnamed namespace): the parameters of a call (Attn) and, for one block of
// up to KB keys of one row and key head, the keys transposed into the unit's tile and the values as
// rows, from wherever the call's layout keeps them: a float32 or float16 buffer per row or a pool's
// blocks named by a slot table (kv_index, load_float_run), affine codes dequantized a run at a time
// (decode_run, load_coded_run) or one element at a time (coded_elem, load_row), and chunks of mixed
// widths (load_mixed). The layouts, and why codes are dequantized as they are, are described at the top
// of attention.cpp. Apart from the unit's arithmetic there, which reads better without the layouts'
// detail; everything here is inlined into that one unit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kv_codes.h"
#include "qmatmul.h"
// after qmatmul.h, which says whether this is x86 (MF_X86)
#include "attention_avx512.h"

using namespace mf;

namespace {

constexpr int KB = 64;  // keys per block

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

}  // namespace
