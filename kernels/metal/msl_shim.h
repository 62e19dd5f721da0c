// msl_shim.h: the Metal Shading Language built-ins that the kernel bodies in this folder use, as
// C++17, plus a small runtime that runs a body's grid on the CPU. metal_cpu.py wraps a body in a
// function with the signature mx.fast.metal_kernel would generate, compiles it with this header
// and calls mf_launch through ctypes; nothing else includes it.
//
// Execution model. Threadgroups run one after another. The threads of a threadgroup are fibers
// (ucontext) on the calling OS thread: a fiber runs until it reaches a rendezvous (a barrier or a
// simd_* op) or returns, then the scheduler picks the next runnable fiber, in an order shuffled
// again every round, so a body missing a barrier reads stale (poisoned) data under some order.
// When no fiber can run:
//   - a SIMD group whose waiting lanes all wait at the same simd_* call is released: the op
//     combines exactly those lanes (lanes that returned or wait elsewhere are inactive, as on
//     hardware); lanes waiting at simd_* calls on different lines are an error (not emulated);
//   - a threadgroup_barrier is released once every thread of the group waits at the same one;
//     threads that returned before it, or that wait at another barrier, are an error (MSL
//     requires every thread of the group to reach each barrier).
// Fibers (not one OS thread per GPU thread) keep barrier semantics real and cheap: a CPU with two
// cores would otherwise pay dozens of kernel context switches for every barrier of a 256-thread
// group. Threadgroup memory: metal_cpu.py turns `threadgroup T name[N];` declarations into
// function-scope statics, shared by the fibers of the one threadgroup that runs at a time, and
// registers them so the runtime fills them with 0xFF bytes (NaN) before every threadgroup.
// Faults: buffers come from mf_alloc (inputs read-only, a PROT_NONE page right after each
// buffer's last byte, one below every fiber stack); a SIGSEGV/SIGBUS during a launch jumps back
// to mf_launch, which returns the address so Python can name the buffer.
#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

// ---------------------------------------------------------------------------------------------
// Runtime
// ---------------------------------------------------------------------------------------------
namespace mf {

constexpr int kSimdWidth = 32;
constexpr size_t kStack = 256 * 1024;  // per fiber; bodies keep small register arrays only

struct U3 {
  unsigned x, y, z;
};

// Every attribute a body may name, for one thread (metal_cpu.py passes the ones it names).
struct Ids {
  U3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  U3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threads_per_grid, threadgroups_per_grid;
  unsigned thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup;
  unsigned thread_execution_width, thread_index_in_quadgroup, quadgroup_index_in_threadgroup;
  unsigned quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

enum State { kReady, kAtBarrier, kAtSimd, kDone };

// A call site in the body (file and line as the #line directives name them), which the macros
// at the end of this file pass to each rendezvous: two calls on one line count as one site.
struct Site {
  const char* file;
  int line;
};
#define MF_HERE (mf::Site{__FILE__, __LINE__})

struct Lane {
  ucontext_t ctx;
  State state;
  Site site;  // of the rendezvous it waits at
  uint64_t deposit;  // its value for the simd op it waits at
  Ids ids;
};

typedef void (*BodyFn)(void* closure, const Ids& ids);

struct Runtime {
  Lane* lanes = nullptr;
  int n = 0, cur = -1;
  char* stacks = nullptr;
  size_t stacks_bytes = 0;
  int stacks_lanes = 0;
  ucontext_t sched;
  BodyFn body = nullptr;
  void* closure = nullptr;
  uint64_t snap[1024];  // lanes' deposits at the last release of their SIMD group's op
  bool active[1024];    // which lanes took part in it
  void* regions[64];    // threadgroup arrays, poisoned before each threadgroup
  size_t region_bytes[64];
  int n_regions = 0;
  char err[512];
  bool failed = false;
  sigjmp_buf fault_jmp;
  volatile uintptr_t fault_addr = 0;
};

static Runtime rt;

static void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (!rt.failed) vsnprintf(rt.err, sizeof rt.err, fmt, ap);
  va_end(ap);
  rt.failed = true;
}

static Lane& me() { return rt.lanes[rt.cur]; }

static void yield_to_scheduler() { swapcontext(&me().ctx, &rt.sched); }

// A simd_* op: deposit the lane's value, wait for the group's release, return the group's deposits.
static const uint64_t* simd_exchange(uint64_t v, Site site) {
  Lane& l = me();
  l.deposit = v, l.site = site, l.state = kAtSimd;
  yield_to_scheduler();
  return rt.snap + (rt.cur / kSimdWidth) * kSimdWidth;
}

static bool lane_active(unsigned lane) {
  unsigned idx = (rt.cur / kSimdWidth) * kSimdWidth + lane;
  return lane < (unsigned)kSimdWidth && (int)idx < rt.n && rt.active[idx];
}

static void barrier(Site site) {
  Lane& l = me();
  l.site = site, l.state = kAtBarrier;
  yield_to_scheduler();
}

static void register_region(void* p, size_t bytes) {
  for (int i = 0; i < rt.n_regions; i++)
    if (rt.regions[i] == p) return;
  if (rt.n_regions == 64) return fail("more than 64 threadgroup arrays");
  rt.regions[rt.n_regions] = p, rt.region_bytes[rt.n_regions++] = bytes;
  memset(p, 0xFF, bytes);  // first sight: no thread has written it yet
}

static void lane_main() {
  Lane& l = me();
  rt.body(rt.closure, l.ids);
  rt.lanes[rt.cur].state = kDone;  // uc_link returns to the scheduler
}

static uint64_t rng_state = 1;
static unsigned rnd(unsigned n) {
  rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (unsigned)((rng_state >> 33) % n);
}

static bool same_site(const Lane& a, const Lane& b) {
  return a.site.line == b.site.line && strcmp(a.site.file, b.site.file) == 0;
}

// Runs one threadgroup of n threads to completion; false (rt.err set) on a synchronization error.
static bool run_group(int n) {
  int order[1024];
  for (int i = 0; i < n; i++) {
    Lane& l = rt.lanes[i];
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = rt.stacks + (size_t)i * (kStack + 4096) + 4096;  // above its guard page
    l.ctx.uc_stack.ss_size = kStack;
    l.ctx.uc_link = &rt.sched;
    makecontext(&l.ctx, lane_main, 0);
    l.state = kReady, order[i] = i;
  }
  for (int r = 0; r < rt.n_regions; r++) memset(rt.regions[r], 0xFF, rt.region_bytes[r]);
  for (;;) {
    for (int i = n - 1; i > 0; i--) {  // a new order every round
      int j = (int)rnd(i + 1), t = order[i];
      order[i] = order[j], order[j] = t;
    }
    for (int k = 0; k < n; k++) {
      int i = order[k];
      if (rt.lanes[i].state != kReady) continue;
      rt.cur = i;
      swapcontext(&rt.sched, &rt.lanes[i].ctx);
      if (rt.failed) return false;
    }
    // No fiber can run. Release the SIMD ops whose waiting lanes agree on the call.
    bool released = false;
    for (int s0 = 0; s0 < n; s0 += kSimdWidth) {
      int first = -1, end = s0 + kSimdWidth < n ? s0 + kSimdWidth : n;
      for (int i = s0; i < end; i++) {
        if (rt.lanes[i].state != kAtSimd) continue;
        if (first < 0) first = i;
        else if (!same_site(rt.lanes[i], rt.lanes[first])) {
          const Site &a = rt.lanes[first].site, &b = rt.lanes[i].site;
          fail("lanes %d and %d of SIMD group %d wait at different simd ops (%s:%d and %s:%d): divergent SIMD "
               "ops are not emulated", first - s0, i - s0, s0 / kSimdWidth, a.file, a.line, b.file, b.line);
          return false;
        }
      }
      if (first < 0) continue;
      for (int i = s0; i < end; i++) {
        rt.active[i] = rt.lanes[i].state == kAtSimd;
        if (rt.active[i]) rt.snap[i] = rt.lanes[i].deposit, rt.lanes[i].state = kReady;
      }
      released = true;
    }
    if (released) continue;
    int at_barrier = 0, done = 0, first = -1;
    for (int i = 0; i < n; i++) {
      if (rt.lanes[i].state == kDone) done++;
      if (rt.lanes[i].state != kAtBarrier) continue;
      at_barrier++;
      if (first < 0) first = i;
      else if (!same_site(rt.lanes[i], rt.lanes[first])) {
        const Site &a = rt.lanes[first].site, &b = rt.lanes[i].site;
        fail("threads %d and %d wait at different threadgroup_barrier calls (%s:%d and %s:%d)", first, i, a.file,
             a.line, b.file, b.line);
        return false;
      }
    }
    if (done == n) return true;
    if (done > 0) {
      const Site& a = rt.lanes[first].site;
      fail("threadgroup_barrier (%s:%d) reached by %d of %d threads: the others returned before it", a.file, a.line,
           at_barrier, n);
      return false;
    }
    for (int i = 0; i < n; i++) rt.lanes[i].state = kReady;
  }
}

static void on_fault(int, siginfo_t* info, void*) {
  rt.fault_addr = (uintptr_t)info->si_addr;
  siglongjmp(rt.fault_jmp, 1);
}

static bool ensure_stacks(int lanes) {
  if (lanes <= rt.stacks_lanes) return true;
  if (rt.stacks) munmap(rt.stacks, rt.stacks_bytes);
  rt.stacks_bytes = (size_t)lanes * (kStack + 4096);
  void* p = mmap(nullptr, rt.stacks_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return rt.stacks = nullptr, rt.stacks_lanes = 0, false;
  rt.stacks = (char*)p, rt.stacks_lanes = lanes;
  for (int i = 0; i < lanes; i++) mprotect(rt.stacks + (size_t)i * (kStack + 4096), 4096, PROT_NONE);
  if (!rt.lanes) rt.lanes = (Lane*)calloc(1024, sizeof(Lane));
  return rt.lanes != nullptr;
}

static unsigned ceil_div(unsigned a, unsigned b) { return (a + b - 1) / b; }

// Runs the grid (in threads, as mx.fast.metal_kernel takes it; threadgroups clipped at the grid's
// edge as dispatchThreads does). Returns 0, 1 with rt.err set, or 2 with *fault the faulting address.
static int launch(const unsigned* grid, const unsigned* tg_req, uint64_t seed, BodyFn body, void* closure,
                  char* err, int errlen, uintptr_t* fault) {
  unsigned tg[3];
  for (int a = 0; a < 3; a++) tg[a] = tg_req[a] < grid[a] ? tg_req[a] : grid[a];
  unsigned tg_threads = tg[0] * tg[1] * tg[2];
  if (tg_threads == 0 || tg_threads > 1024) {
    snprintf(err, errlen, "threadgroup of %u threads (Metal allows 1 to 1024)", tg_threads);
    return 1;
  }
  if (!ensure_stacks((int)tg_threads)) {
    snprintf(err, errlen, "cannot allocate fiber stacks");
    return 1;
  }
  rt.body = body, rt.closure = closure, rt.failed = false, rt.err[0] = 0;
  rng_state = seed * 2654435761ULL + 12345;
  unsigned groups[3] = {ceil_div(grid[0], tg[0]), ceil_div(grid[1], tg[1]), ceil_div(grid[2], tg[2])};

  static char alt_stack[64 * 1024];
  stack_t ss = {}, old_ss;
  ss.ss_sp = alt_stack, ss.ss_size = sizeof alt_stack;
  struct sigaction sa = {}, old_segv, old_bus;
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaltstack(&ss, &old_ss);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  int status = 0;
  if (sigsetjmp(rt.fault_jmp, 1) == 0) {
    for (unsigned gz = 0; gz < groups[2] && !status; gz++)
      for (unsigned gy = 0; gy < groups[1] && !status; gy++)
        for (unsigned gx = 0; gx < groups[0] && !status; gx++) {
          unsigned g[3] = {gx, gy, gz}, sz[3];
          for (int a = 0; a < 3; a++) sz[a] = grid[a] - g[a] * tg[a] < tg[a] ? grid[a] - g[a] * tg[a] : tg[a];
          int n = (int)(sz[0] * sz[1] * sz[2]);
          for (int i = 0; i < n; i++) {
            Ids& d = rt.lanes[i].ids;
            unsigned lx = i % sz[0], ly = (i / sz[0]) % sz[1], lz = i / (sz[0] * sz[1]);
            d.thread_position_in_threadgroup = {lx, ly, lz};
            d.threadgroup_position_in_grid = {gx, gy, gz};
            d.thread_position_in_grid = {gx * tg[0] + lx, gy * tg[1] + ly, gz * tg[2] + lz};
            d.threads_per_threadgroup = {sz[0], sz[1], sz[2]};
            d.dispatch_threads_per_threadgroup = {tg[0], tg[1], tg[2]};
            d.threads_per_grid = {grid[0], grid[1], grid[2]};
            d.threadgroups_per_grid = {groups[0], groups[1], groups[2]};
            d.thread_index_in_threadgroup = (unsigned)i;
            d.thread_index_in_simdgroup = (unsigned)i % kSimdWidth;
            d.simdgroup_index_in_threadgroup = (unsigned)i / kSimdWidth;
            d.simdgroups_per_threadgroup = ceil_div((unsigned)n, kSimdWidth);
            d.dispatch_simdgroups_per_threadgroup = ceil_div(tg_threads, kSimdWidth);
            d.threads_per_simdgroup = d.thread_execution_width = kSimdWidth;
            d.thread_index_in_quadgroup = (unsigned)i % 4;
            d.quadgroup_index_in_threadgroup = (unsigned)i / 4;
            d.quadgroups_per_threadgroup = ceil_div((unsigned)n, 4);
            d.dispatch_quadgroups_per_threadgroup = ceil_div(tg_threads, 4);
          }
          rt.n = n;
          if (!run_group(n)) {
            snprintf(err, errlen, "threadgroup (%u, %u, %u): %s", gx, gy, gz, rt.err);
            status = 1;
          }
        }
  } else {
    *fault = rt.fault_addr;
    snprintf(err, errlen, "memory fault at %p", (void*)rt.fault_addr);
    status = 2;
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaltstack(&old_ss, nullptr);
  return status;
}

}  // namespace mf

// Buffers for a launch: `bytes` of data ending right at a PROT_NONE page (an access one element
// past the end faults), inside pages that belong to this buffer alone.
extern "C" void* mf_alloc(size_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (bytes + page - 1) / page;
  char* base = (char*)mmap(nullptr, (pages + 1) * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  mprotect(base + pages * page, page, PROT_NONE);
  return base + pages * page - bytes;
}

// Makes a buffer read-only (an input: a store into it faults) or frees it.
extern "C" void mf_protect(void* data, size_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (bytes + page - 1) / page;
  char* end = (char*)data + bytes;
  mprotect(end - pages * page, pages * page, PROT_READ);
}

extern "C" void mf_free(void* data, size_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (bytes + page - 1) / page;
  munmap((char*)data + bytes - pages * page, (pages + 1) * page);
}

// ---------------------------------------------------------------------------------------------
// MSL surface (only what the bodies here use)
// ---------------------------------------------------------------------------------------------
// Address spaces: one address space on the CPU. `threadgroup` declarations are rewritten by
// metal_cpu.py before the macro below sees them; what is left (pointer qualifiers) vanishes.
#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;

struct uint3 {
  uint x, y, z;
  uint3(mf::U3 v = {0, 0, 0}) : x(v.x), y(v.y), z(v.z) {}
};

// IEEE binary16 storage: read as float (scales, float16 activations), and written from a float with
// static_cast (float16 outputs), rounded to nearest even as the GPU converts.
struct half {
  uint16_t bits;
  half() = default;
  explicit half(float f) : bits(from_float(f)) {}
  static uint16_t from_float(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);  // NaN
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // infinity, or rounds to it (>= 65520)
    if (a < 0x38800000u) {  // below 2^-14: a subnormal (or 0), in units of 2^-24; the scaling is exact
      float m;
      memcpy(&m, &a, 4);
      return (uint16_t)(sign | (uint32_t)std::nearbyint(m * 16777216.0f));
    }
    // normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even (a carry
    // into the exponent is the right result)
    return (uint16_t)(sign | ((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13));
  }
  operator float() const {
    uint32_t sign = (uint32_t)(bits & 0x8000u) << 16, e = (bits >> 10) & 0x1F, m = bits & 0x3FFu, u;
    if (e == 0x1F) u = sign | 0x7F800000u | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else {  // subnormal
      e = 113;
      while (!(m & 0x400u)) m <<= 1, e--;
      u = sign | (e << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};
typedef half float16_t;

// as_type<T>(v): reinterpret the bits (an MSL operator, written unqualified).
template <class T, class U>
inline T as_type(U v) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes");
  T t;
  memcpy(&t, &v, sizeof(T));
  return t;
}

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline float exp(float v) { return std::exp(v); }
template <class T> inline T min(T a, T b) { return b < a ? b : a; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }

// The rendezvous take the call site first (the macros below pass it): which barrier or simd op a
// thread waits at.
inline void mf_threadgroup_barrier(mf::Site site, mem_flags) {
  mf::barrier(site);
}

template <class T> inline uint64_t mf_pack(T v) {
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T> inline T mf_unpack(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}

// Sum over the active lanes of the SIMD group (each lane gets the same value).
template <class T>
inline T mf_simd_sum(mf::Site site, T v) {
  const uint64_t* s = mf::simd_exchange(mf_pack(v), site);
  T acc = T(0);
  for (uint l = 0; l < (uint)mf::kSimdWidth; l++)
    if (mf::lane_active(l)) acc += mf_unpack<T>(s[l]);
  return acc;
}

// The value of lane (own + delta); the upper `delta` lanes keep their own value (as do lanes whose
// source is inactive: undefined in MSL).
template <class T>
inline T mf_simd_shuffle_down(mf::Site site, T v, ushort delta) {
  const uint64_t* s = mf::simd_exchange(mf_pack(v), site);
  uint src = mf::me().ids.thread_index_in_simdgroup + delta;
  return mf::lane_active(src) ? mf_unpack<T>(s[src]) : v;
}
}  // namespace metal

using namespace metal;

// metal::simd_sum(v) and simd_sum(v) both become (metal::)mf_simd_sum(<call site>, v).
#define threadgroup_barrier(...) mf_threadgroup_barrier(MF_HERE, __VA_ARGS__)
#define simd_sum(...) mf_simd_sum(MF_HERE, __VA_ARGS__)
#define simd_shuffle_down(...) mf_simd_shuffle_down(MF_HERE, __VA_ARGS__)
