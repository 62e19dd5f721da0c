#include "kernel_library.h"

#include <stdexcept>

namespace mlx_flash {

namespace {

KernelLibrary& table() {
  static KernelLibrary lib;
  return lib;
}

}  // namespace

void load_kernel_library(const std::string& path) { table() = kernel_table(path); }

const KernelLibrary& kernels() {
  const KernelLibrary& lib = table();
  if (lib.qmatmul == nullptr) throw std::runtime_error("the CPU kernel library was not loaded (load_kernel_library)");
  return lib;
}

}  // namespace mlx_flash
