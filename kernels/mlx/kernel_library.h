// The CPU kernel library as the MLX primitives call it (kernels/cpu/kernel_table.h), loaded once.
#pragma once

#include <string>

#include "kernel_table.h"

namespace mlx_flash {

// Look the functions up in the already loaded library at `path` (throws naming what is missing).
void load_kernel_library(const std::string& path);

// The functions (throws when load_kernel_library has not succeeded).
const KernelLibrary& kernels();

}  // namespace mlx_flash
