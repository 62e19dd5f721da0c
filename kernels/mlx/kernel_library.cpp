#include "kernel_library.h"

#include <dlfcn.h>

#include <stdexcept>

namespace mlx_flash {

namespace {

KernelLibrary& table() {
  static KernelLibrary lib;
  return lib;
}

template <class F>
void find(void* handle, const char* name, const std::string& path, F& out) {
  void* sym = dlsym(handle, name);
  if (sym == nullptr) throw std::runtime_error(path + ": the CPU kernel library has no " + name + " (stale build)");
  out = reinterpret_cast<F>(sym);
}

}  // namespace

void load_kernel_library(const std::string& path) {
  // RTLD_NOLOAD: only the copy Python loaded (a second copy would bring a second thread pool).
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) throw std::runtime_error(path + ": the CPU kernel library is not loaded in this process");
  KernelLibrary lib;
  find(handle, "mf_qmatmul", path, lib.qmatmul);
  find(handle, "mf_blockmatmul", path, lib.blockmatmul);
  find(handle, "mf_rows", path, lib.rows);
  find(handle, "mf_attention", path, lib.attention);
  find(handle, "mf_rms_norm", path, lib.rms_norm);
  find(handle, "mf_rope", path, lib.rope);
  find(handle, "mf_silu_mul", path, lib.silu_mul);
  find(handle, "mf_write_tokens", path, lib.write_tokens);
  table() = lib;
}

const KernelLibrary& kernels() {
  const KernelLibrary& lib = table();
  if (lib.qmatmul == nullptr) throw std::runtime_error("the CPU kernel library was not loaded (load_kernel_library)");
  return lib;
}

}  // namespace mlx_flash
