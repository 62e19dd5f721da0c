// The AVX-VNNI path of the q8 kernels (q8_avxvnni.cpp) in AVX-512's encoding of the same 256-bit
// instruction: the path a CPU with AVX-512 VNNI runs when level 3 is forced (tests, so that the
// 256-bit VNNI loops run on a machine without AVX-VNNI), computing what the VEX form computes.
#include <cstring>
#include <vector>

#include "q8.h"

#if MF_X86
namespace mf {
namespace {

#define MF_Q8_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define MF_Q8 __attribute__((target(MF_Q8_TARGET), always_inline)) inline
#define MF_Q8_FN __attribute__((target(MF_Q8_TARGET)))

MF_Q8 __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
MF_Q8 __m256i dot8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }

#include "q8_x86_256.inc"

}  // namespace

MF_Q8_FN bool q8_avxvnni_evex(const Q8Job& job, int64_t n0, int64_t n1) { return run_256(job, n0, n1); }

}  // namespace mf
#endif
