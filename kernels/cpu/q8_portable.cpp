// The q8 arithmetic (q8.h) in plain scalar C++: every kind, every layout, the canonical order of float
// operations written out as it reads. The path of CPUs without an x86 integer path (ARM included),
// and the reference the vector paths equal to the bit (tests/kernels/test_q8.py).
#include <cmath>

#include "q8.h"

namespace mf {

namespace q8 {

// The 32 codes of 32-block b of a row, in natural order (0 .. 63).
void block_codes(const QMatrix& m, const uint8_t* row, int64_t b, uint8_t* c) {
  const uint8_t* p = qblock(m, row, b);
  switch (m.kind) {
    case QK_AFF2:
    case QK_AFF4:
    case QK_AFF8: {
      const int bits = m.kind == QK_AFF2 ? 2 : m.kind == QK_AFF4 ? 4 : 8;
      for (int j = 0; j < 32; j++) c[j] = (p[j * bits / 8] >> (bits * j % 8)) & ((1 << bits) - 1);
      return;
    }
    case QK_Q5_0:
    case QK_Q5_1: {
      const uint8_t* after = p + (m.kind == QK_Q5_1 ? 4 : 2);
      const uint32_t qh = u32_at(after);
      const uint8_t* qs = after + 4;
      for (int j = 0; j < 16; j++) {
        c[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
        c[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      return;
    }
    case QK_Q4_K:
    case QK_Q5_K: {
      const int64_t e0 = 32 * (b % 8);  // first element in the 256-block
      const uint8_t* qs = p + (m.kind == QK_Q5_K ? 48 : 16);
      const uint8_t* qh = p + 16;
      const int ch = (int)(e0 / 64), high = (int)((e0 % 64) / 32);  // 64-run, and its upper 32
      for (int l = 0; l < 32; l++) {
        const uint8_t byte = qs[32 * ch + l];
        int v = high ? byte >> 4 : byte & 0xF;
        if (m.kind == QK_Q5_K) v |= ((qh[l] >> (2 * ch + high)) & 1) << 4;
        c[l] = (uint8_t)v;
      }
      return;
    }
    case QK_Q6_K: {
      const int64_t e0 = 32 * (b % 8);
      const int h = (int)(e0 / 128), r = (int)((e0 % 128) / 32);
      const uint8_t* ql = p + 64 * h + (r & 1) * 32;
      const uint8_t* qh = p + 128 + 32 * h;
      for (int l = 0; l < 32; l++) {
        const int lo = r < 2 ? ql[l] & 0xF : ql[l] >> 4;
        c[l] = (uint8_t)(lo | (((qh[l] >> (2 * r)) & 3) << 4));
      }
      return;
    }
  }
}

// scale(b, u) of block b's halves (sc[0], sc[1]: equal except in Q6_K) and offset(b) (0 where none).
void block_factors(const QMatrix& m, int64_t n, const uint8_t* row, int64_t b, float* sc, float* off) {
  *off = 0.f;
  if (m.kind == QK_AFF2 || m.kind == QK_AFF4 || m.kind == QK_AFF8) {
    const int64_t so = qscale_row(m, n) + m.soff[b];
    sc[0] = sc[1] = load_scale(m.scales + so, m.scale_type, 0);
    *off = load_scale(m.biases + so, m.scale_type, 0);
    return;
  }
  const uint8_t* p = qblock(m, row, b);
  switch (m.kind) {
    case QK_Q5_0: sc[0] = sc[1] = f16_at(p); return;
    case QK_Q5_1: sc[0] = sc[1] = f16_at(p); *off = f16_at(p + 2); return;
    case QK_Q4_K:
    case QK_Q5_K: {
      int s, mn;
      scale_min_k4((int)(b % 8), p + 4, &s, &mn);
      sc[0] = sc[1] = f16_at(p) * (float)s;
      *off = -(f16_at(p + 2) * (float)mn);
      return;
    }
    case QK_Q6_K: {
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = f16_at(p + 208);
      sc[0] = d * (float)scales[2 * (b % 8)];
      sc[1] = d * (float)scales[2 * (b % 8) + 1];
      return;
    }
  }
}

// Position of natural input e of a 32-block among the block's 32 activation codes (q8.h's orders).
int act_position(int order, int e) {
  const int c = e % 8, quarter = 8 * (e / 8);
  if (order == ORDER_NIBBLES) return quarter + (c & 1) * 4 + c / 2;
  if (order == ORDER_CRUMBS) return quarter + 4 * ((c % 4) / 2) + 2 * (c % 2) + c / 4;
  return e;
}

}  // namespace q8

void q8_portable(const Q8Job& job, int64_t n0, int64_t n1) {
  const QMatrix& m = *job.m;
  const ActRows& x = *job.rows;
  const int64_t nb = m.K / 32, zero = zero_point(m.kind);
  const bool offset = has_offset(m.kind);
  uint8_t c[32];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = qrow(m, n);
    for (int64_t t = 0; t < x.T; t++) {
      const int8_t* q = x.q + t * m.K;
      const float* d = x.d + t * QUARTERS * nb;
      float p[16] = {0.f};
      for (int64_t b = 0; b < nb; b++) {
        float& a = p[b % 16];
        q8::block_codes(m, row, b, c);
        float sc[2], off;
        q8::block_factors(m, n, row, b, sc, &off);
        int32_t I[QUARTERS];
        for (int u = 0; u < QUARTERS; u++) {
          int32_t dot = 0, sum = 0;
          for (int e = 8 * u; e < 8 * u + 8; e++) {
            const int32_t xq = q[32 * b + q8::act_position(x.order, e)];
            dot += (int32_t)c[e] * xq;
            sum += xq;
          }
          I[u] = dot - (int32_t)zero * sum;
        }
        for (int h = 0; h < 2; h++) {
          float g = (float)I[2 * h] * d[2 * h * nb + b];
          g = std::fma((float)I[2 * h + 1], d[(2 * h + 1) * nb + b], g);
          a = std::fma(g, sc[h], a);
        }
        if (offset) a = std::fma(off, x.s[t * nb + b], a);
      }
      for (int w = 8; w >= 2; w /= 2)
        for (int i = 0; i < w; i++) p[i] += p[i + w];
      job.y[t * m.N + n] = p[0] + p[1];
    }
  }
}

}  // namespace mf
