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

#include "attention_kv.h"  // Attn and the gathering of keys and values

namespace {

constexpr int TQ = 16;  // queries per tile
constexpr int L = 16;   // lanes of the partial sums and maxima
constexpr int RB = 4;   // query rows computed together

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
