// The torch operator stored_matmul (schema in kernels/torch/ops.cpp, defined by the CPU build, which
// mlx_flash.kernels.cuda_ops loads first) for CUDA tensors: the affine product of qmatmul.cu on the
// bytes of a uint8 device buffer, on the current stream. Plain matrices only, as the torch backend
// holds them on a GPU; GGUF block kinds, laid-out rows and sparse products have no CUDA kernel and
// are refused by name. Built at first use by mlx_flash.kernels.cuda_ops.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "check_text.h"
#include "qmatmul.cuh"

namespace {

// GGUF block types by number (cpu/gguf_blocks.h's GgufType), for refusals that name them.
const char* block_kind(int64_t kind) {
  switch (kind) {
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    default: return "this GGUF block type";
  }
}

// One part of the matrix inside the buffer: `bytes` from `offset`, aligned for its element size.
void part_ok(const at::Tensor& buffer, int64_t offset, int64_t bytes, int64_t align, const char* what) {
  TORCH_CHECK(offset >= 0 && offset + bytes <= buffer.numel(), "stored_matmul: the ", what, " lie past their buffer (",
              mf::text(offset + bytes), " > ", mf::text(buffer.numel()), " bytes)");
  const auto at = reinterpret_cast<uintptr_t>(buffer.data_ptr<uint8_t>() + offset);
  TORCH_CHECK(at % align == 0, "stored_matmul: the ", what, " are not ", mf::text(align), "-byte aligned on the device");
}

at::Tensor stored_matmul(const at::Tensor& x, const at::Tensor& buffer, int64_t kind, int64_t w_off, int64_t s_off,
                         int64_t b_off, int64_t scale_type, int64_t bits, int64_t group, int64_t n_out,
                         bool transposed, at::IntArrayRef layout, int64_t /*threads*/,
                         const c10::optional<at::Tensor>& ids, int64_t /*listed*/) {
  TORCH_CHECK(kind == 0, "stored_matmul: ", block_kind(kind), " has no CUDA kernel; GGUF block weights run on the "
              "CPU kernel (the torch backend on device 'cpu')");
  TORCH_CHECK(layout.empty() && !ids.has_value(), "stored_matmul on CUDA multiplies plain matrices only (laid-out "
              "rows and sparse products run on the CPU kernel or the CUDA sparse FFN)");
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat, "stored_matmul: x must be a float32 CUDA tensor");
  TORCH_CHECK(buffer.is_cuda() && buffer.scalar_type() == at::kByte && buffer.is_contiguous() &&
                  buffer.device() == x.device(),
              "stored_matmul: the weights buffer must be a contiguous uint8 tensor on x's device");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "stored_matmul on CUDA reads 2, 4 or 8-bit codes (got ", mf::text(bits), ")");
  TORCH_CHECK(scale_type >= 0 && scale_type <= 2, "stored_matmul: unknown scale type ", mf::text(scale_type));
  const at::Tensor xc = x.contiguous();
  const int64_t K = xc.size(-1), T = K ? xc.numel() / K : 0;
  // transposed: rows are outputs, W [n_out, K]; else rows are inputs, W [K, n_out]; groups run along a row
  const int64_t rows = transposed ? n_out : K, codes = transposed ? K : n_out;
  TORCH_CHECK(group > 0 && group % 32 == 0 && codes % group == 0, "stored_matmul on CUDA needs groups of a multiple ",
              "of 32 codes that divide a row (group ", mf::text(group), ", ", mf::text(codes), " codes a row)");
  const int64_t ssize = scale_type == 2 ? 4 : 2, scale_bytes = rows * (codes / group) * ssize;
  part_ok(buffer, w_off, rows * codes * bits / 8, 4, "codes");
  part_ok(buffer, s_off, scale_bytes, ssize, "scales");
  part_ok(buffer, b_off, scale_bytes, ssize, "biases");
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = n_out;
  at::Tensor y = at::empty(shape, xc.options());
  if (T == 0 || n_out == 0) return y;
  const uint8_t* base = buffer.data_ptr<uint8_t>();
  const mf::AffineMatrix m{reinterpret_cast<const uint32_t*>(base + w_off), base + s_off, base + b_off, rows, codes,
                           (int)bits, (int)group, (int)scale_type};
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor scratch = at::empty({std::max<int64_t>(mf::affine_scratch_floats(m, T, transposed), 1)}, xc.options());
  const cudaError_t err = mf::affine_matmul(xc.data_ptr<float>(), T, m, transposed, y.data_ptr<float>(),
                                            scratch.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "stored_matmul: ", cudaGetErrorString(err));
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(mlx_flash, CUDA, m) { m.impl("stored_matmul", &stored_matmul); }
