// torch binding of the CUDA sparse FFN kernels (sparse_ffn.cu): checks the tensors, runs the
// launchers on the stream the caller names (torch.cuda.current_stream().cuda_stream: passed in, so
// this file needs torch's core headers only). Built at first use by mlx_flash.kernels.cuda_sparse.
#include <torch/extension.h>

#include <vector>

#include "check_text.h"
#include "sparse_ffn.cuh"

namespace {

// spec: d_model, block, row_bytes, then w, s, b, bits, group of gate, up and down, then down_layout,
// scale_type (mlx_flash.kernels.cuda_sparse.spec_ints).
mf::SlabLayout layout_of(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == 20, "sparse FFN spec: 20 ints expected, got ", mf::text(v.size()));
  auto m = [&](int i) { return mf::SlabMatrix{(int)v[i], (int)v[i + 1], (int)v[i + 2], (int)v[i + 3], (int)v[i + 4]}; };
  return mf::SlabLayout{(int)v[0], (int)v[1], (int)v[2], m(3), m(8), m(13), (int)v[18], (int)v[19]};
}

void check_common(const torch::Tensor& slab, const torch::Tensor& idx, const torch::Tensor& count,
                  const mf::SlabLayout& lay) {
  TORCH_CHECK(slab.is_cuda() && slab.scalar_type() == torch::kUInt8 && slab.dim() == 2 && slab.is_contiguous() &&
                  slab.size(1) == lay.row_bytes,
              "slab must be a contiguous CUDA uint8 tensor [slots, ", mf::text(lay.row_bytes), "]");
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == torch::kInt32 && idx.dim() == 1 && idx.is_contiguous() &&
                  idx.size(0) >= slab.size(0),
              "idx must be a contiguous CUDA int32 tensor of at least the slab's ", mf::text(slab.size(0)), " slots");
  TORCH_CHECK(count.is_cuda() && count.scalar_type() == torch::kInt32 && count.numel() == 1,
              "count must be a CUDA int32 tensor of one element");
  TORCH_CHECK(slab.device() == idx.device() && slab.device() == count.device(), "tensors on different devices");
}

torch::Tensor gate_up(torch::Tensor x, torch::Tensor slab, torch::Tensor idx, torch::Tensor count,
                      std::vector<int64_t> spec, int64_t stream) {
  const mf::SlabLayout lay = layout_of(spec);
  check_common(slab, idx, count, lay);
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == lay.d_model && x.size(0) >= 1 && x.size(0) <= mf::kMaxTokens,
              "x must be a contiguous CUDA float32 tensor [T <= ", mf::text(mf::kMaxTokens), ", ", mf::text(lay.d_model), "]");
  const int slots = (int)slab.size(0), T = (int)x.size(0);
  auto h = torch::empty({T, (int64_t)slots * lay.block}, x.options());
  const cudaError_t err = mf::sparse_gate_up(x.data_ptr<float>(), T, slab.data_ptr<uint8_t>(), slots,
                                             idx.data_ptr<int32_t>(), count.data_ptr<int32_t>(), lay,
                                             h.data_ptr<float>(), reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "sparse_gate_up: ", cudaGetErrorString(err));
  return h;
}

torch::Tensor down(torch::Tensor h, torch::Tensor slab, torch::Tensor idx, torch::Tensor count,
                   std::vector<int64_t> spec, int64_t stream) {
  const mf::SlabLayout lay = layout_of(spec);
  check_common(slab, idx, count, lay);
  const int slots = (int)slab.size(0);
  TORCH_CHECK(h.is_cuda() && h.scalar_type() == torch::kFloat32 && h.dim() == 2 && h.stride(1) == 1 &&
                  h.size(1) >= (int64_t)slots * lay.block && h.size(0) >= 1 && h.size(0) <= mf::kMaxTokens,
              "h must be a CUDA float32 tensor [T <= ", mf::text(mf::kMaxTokens), ", >= ", mf::text((int64_t)slots * lay.block), "]");
  const int T = (int)h.size(0);
  auto y = torch::empty({T, (int64_t)lay.d_model}, h.options());
  auto scratch = torch::empty({(int64_t)mf::kDownChunks * T * lay.d_model}, h.options());
  const cudaError_t err = mf::sparse_down(h.data_ptr<float>(), T, (int)h.stride(0), slab.data_ptr<uint8_t>(), slots,
                                          idx.data_ptr<int32_t>(), count.data_ptr<int32_t>(), lay,
                                          scratch.data_ptr<float>(), y.data_ptr<float>(),
                                          reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "sparse_down: ", cudaGetErrorString(err));
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gate_up", &gate_up, "h = silu(x·gate) * (x·up) over the bundles idx[0:count] (count on the device)");
  m.def("down", &down, "y = sum over j < count of down(idx[j]) · h[:, j*block:(j+1)*block]");
  m.attr("max_tokens") = mf::kMaxTokens;
}
