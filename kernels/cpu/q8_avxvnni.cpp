// The q8 kernels (q8.h, q8_x86_256.inc) with AVX-VNNI: the VEX-encoded vpdpbusd of CPUs with 256-bit
// VNNI and no AVX-512 (Alder Lake and later cores), 32 u8 x s8 products added 4 at a time into int32
// lanes in one instruction, without saturation.
#include <cstring>
#include <vector>

#include "q8.h"

#if MF_X86
namespace mf {
namespace {

#define MF_Q8_TARGET "avx2,fma,f16c,avxvnni"
#define MF_Q8 __attribute__((target(MF_Q8_TARGET), always_inline)) inline
#define MF_Q8_FN __attribute__((target(MF_Q8_TARGET)))

MF_Q8 __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
MF_Q8 __m256i dot8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }

#include "q8_x86_256.inc"

}  // namespace

MF_Q8_FN bool q8_avxvnni(const Q8Job& job, int64_t n0, int64_t n1) { return run_256(job, n0, n1); }

}  // namespace mf
#endif
