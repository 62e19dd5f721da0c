// The q8 kernels (q8.h, q8_x86_512.inc) with AVX-512 BW and no VNNI: vpmaddubsw multiplies u8 codes by
// s8 codes and adds pairs into int16 lanes, saturating, then vpmaddwd adds pairs of those into int32.
// Codes below 64 cannot saturate (2 * 63 * 127 < 32767); 8-bit codes are split into their low 7 bits
// and their top bit, each product then below the int16 limit.
#include <cstring>
#include <vector>

#include "q8.h"

#if MF_X86
namespace mf {
namespace {

#define MF_Q8_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#define MF_Q8 __attribute__((target(MF_Q8_TARGET), always_inline)) inline
#define MF_Q8_FN __attribute__((target(MF_Q8_TARGET)))

MF_Q8 __m512i dot(__m512i acc, __m512i u, __m512i s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
MF_Q8 __m512i dot8(__m512i acc, __m512i u, __m512i s) {
  const __m512i low = _mm512_and_si512(u, _mm512_set1_epi8(0x7F));
  const __m512i top = _mm512_and_si512(_mm512_srli_epi16(u, 7), _mm512_set1_epi8(1));
  const __m512i one = _mm512_set1_epi16(1);
  const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(low, s), one);
  const __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16(top, s), one);
  return _mm512_add_epi32(acc, _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 7)));
}

#include "q8_x86_512.inc"

}  // namespace

MF_Q8_FN bool q8_avx512_bw(const Q8Job& job,
                                                                                              int64_t n0, int64_t n1) {
  return run_512(job, n0, n1);
}

}  // namespace mf
#endif
