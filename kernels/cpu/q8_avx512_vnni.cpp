// The q8 kernels (q8.h, q8_x86_512.inc) with AVX-512 VNNI: vpdpbusd multiplies 64 u8 codes by 64 s8
// codes and adds each 4 products into an int32 lane, in one instruction and without saturation.
#include <cstring>
#include <vector>

#include "q8.h"

#if MF_X86
namespace mf {
namespace {

#define MF_Q8_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"
#define MF_Q8 __attribute__((target(MF_Q8_TARGET), always_inline)) inline
#define MF_Q8_FN __attribute__((target(MF_Q8_TARGET)))

MF_Q8 __m512i dot(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
MF_Q8 __m512i dot8(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }

#include "q8_x86_512.inc"

}  // namespace

MF_Q8_FN bool q8_avx512_vnni(
    const Q8Job& job, int64_t n0, int64_t n1) {
  return run_512(job, n0, n1);
}

}  // namespace mf
#endif
