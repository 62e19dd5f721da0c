// The q8 kernels (q8.h, q8_x86_256.inc) with AVX2: vpmaddubsw multiplies u8 codes by s8 codes and adds
// pairs into int16 lanes, saturating, then vpmaddwd adds pairs of those into int32. Codes below 64
// cannot saturate (2 * 63 * 127 < 32767); 8-bit codes are split into their low 7 bits and their top
// bit, each product then below the int16 limit.
#include <cstring>
#include <vector>

#include "q8.h"

#if MF_X86
namespace mf {
namespace {

#define MF_Q8_TARGET "avx2,fma,f16c"
#define MF_Q8 __attribute__((target(MF_Q8_TARGET), always_inline)) inline
#define MF_Q8_FN __attribute__((target(MF_Q8_TARGET)))

MF_Q8 __m256i dot(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
MF_Q8 __m256i dot8(__m256i acc, __m256i u, __m256i s) {
  const __m256i low = _mm256_and_si256(u, _mm256_set1_epi8(0x7F));
  const __m256i top = _mm256_and_si256(_mm256_srli_epi16(u, 7), _mm256_set1_epi8(1));
  const __m256i one = _mm256_set1_epi16(1);
  const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(low, s), one);
  const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(top, s), one);
  return _mm256_add_epi32(acc, _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 7)));
}

#include "q8_x86_256.inc"

}  // namespace

MF_Q8_FN bool q8_avx2(const Q8Job& job, int64_t n0, int64_t n1) { return run_256(job, n0, n1); }

}  // namespace mf
#endif
