// What every primitives_*.cpp file shares, and only they include: the check a kernel's return code
// gets, the argument checks of the graph-building functions, the CPU stream every primitive runs on,
// the float32 rows its inputs are made, and the gathering of an input laid out otherwise. They are
// inline: the CMake target compiles the primitive families' files as one translation unit (see
// CMakeLists.txt), and each file also compiles alone, so each helper is defined once either way.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_library.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/utils.h"
#include "primitives.h"

namespace mlx_flash {

// While record_inputs is on, note (primitive, address) of a weight or buffer it reads (primitives.cpp).
void record(const char* primitive, const void* address);

// A kernel refused its arguments: the graph cannot raise where Python sees it, so say it in the
// exception MLX carries out of eval (the builders check arguments first; this is the last line).
inline void check(int64_t rc, const char* what) {
  if (rc < 0) throw std::runtime_error(std::string(what) + ": the CPU kernel refused its arguments (code " +
                                       std::to_string(rc) + ")");
}

inline void need(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// Every primitive here runs on the CPU, whatever the default device: on Apple silicon the GPU's graph
// takes their results from unified memory (MLX orders the two streams).
inline mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

// Without iostreams: a number streamed into an ostringstream crashed the extension built on a Linux
// machine with GCC 13 (the stream's number formatter, as the torch operators' check_text.h says).
inline std::string shape_str(const mx::Shape& s) {
  std::string o = "(";
  for (size_t i = 0; i < s.size(); i++) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + ")";
}

inline mx::array float_rows(const mx::array& x, mx::Stream s) {
  // float32 (a no-op for the usual activation); a layout other than row-contiguous is gathered by
  // the primitive itself (Gathered), since a Contiguous node costs ~7 us even when it copies nothing.
  return mx::astype(x, mx::float32, s);
}

// An input as row-contiguous float32 memory inside a dispatched task: the array's own memory when
// it is so laid out, else a copy gathered through its strides (kept alive by the object).
struct Gathered {
  std::vector<float> copy;
  const float* data;
  Gathered(const float* base, const mx::Shape& shape, const mx::Strides& strides, bool row_contiguous)
      : data(base) {
    if (row_contiguous) return;
    size_t n = 1;
    for (auto d : shape) n *= d;
    copy.resize(n);
    std::vector<int64_t> idx(shape.size(), 0);
    for (size_t i = 0; i < n; i++) {
      int64_t off = 0;
      for (size_t k = 0; k < shape.size(); k++) off += idx[k] * strides[k];
      copy[i] = base[off];
      for (int k = (int)shape.size() - 1; k >= 0; k--) {
        if (++idx[k] < shape[k]) break;
        idx[k] = 0;
      }
    }
    data = copy.data();
  }
};

}  // namespace mlx_flash
