// Portable loops of the CPU kernel (any CPU, any bits that divide 32): the path of last resort and
// the only one for 2-bit codes. Compilers vectorize what they can for the target they build for.
#include "qmatmul.h"

namespace mf {

// ---- portable kernels ----------------------------------------------------------------------------
void rows_generic(const Problem& p, int64_t n0, int64_t n1) {  // transposed: outputs n0..n1
  const int64_t groups = p.K / p.group;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = row_codes(p, n);
    for (int64_t t = 0; t < p.T; t++) {
      const float* x = p.x + t * p.K;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; g++) {
        const uint32_t* codes = reinterpret_cast<const uint32_t*>(group_codes(p, row, g));
        float dot = 0.f;
        for (int64_t j = 0; j < p.group; j++) dot += (float)code_at(codes, p.bits, j) * x[g * p.group + j];
        const int64_t so = scale_offset(p, n, g);
        acc += scale_at(p.scales, p.scale_type, so) * dot + scale_at(p.biases, p.scale_type, so) * p.xsum[t * groups + g];
      }
      p.y[t * p.N + n] = acc;
    }
  }
}

void cols_generic(const Problem& p, int64_t n0, int64_t n1) {  // not transposed: outputs n0..n1
  for (int64_t t = 0; t < p.T; t++)
    for (int64_t n = n0; n < n1; n++) p.y[t * p.N + n] = 0.f;
  for (int64_t k = 0; k < p.K; k++) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(input_row(p, k));
    for (int64_t g = n0 / p.group; g < n1 / p.group; g++) {
      const float s = scale_at(p.scales, p.scale_type, input_scale(p, k, g));
      const float b = scale_at(p.biases, p.scale_type, input_scale(p, k, g));
      for (int64_t t = 0; t < p.T; t++) {
        const float xs = p.x[t * p.K + k] * s, xb = p.x[t * p.K + k] * b;
        float* y = p.y + t * p.N;
        for (int64_t j = g * p.group; j < (g + 1) * p.group; j++) y[j] += xs * (float)code_at(row, p.bits, j) + xb;
      }
    }
  }
}

void run_portable(const Problem& p, int transposed, int64_t n0, int64_t n1) {
  transposed ? rows_generic(p, n0, n1) : cols_generic(p, n0, n1);
}

}  // namespace mf
