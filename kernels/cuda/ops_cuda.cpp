// The torch operators stored_matmul and moe_experts (schemas in kernels/torch/ops.cpp, defined by the
// CPU build, which mlx_flash.kernels.cuda_ops loads first) for CUDA tensors: the affine product of
// qmatmul.cu on the bytes of a uint8 device buffer, on the current stream, and a MoE layer's routed
// experts in one call over such products. Plain matrices only, as the torch backend holds them on a
// GPU; GGUF block kinds, laid-out rows and sparse products have no CUDA kernel and are refused by
// name. Built at first use by mlx_flash.kernels.cuda_ops.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "check_text.h"
#include "moe_table.h"
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

// The product y [.., n_out] = x [.., K] times matrix m (rows_are_outputs: W [n_out, K], else W [K, n_out]).
at::Tensor affine_product(const at::Tensor& x, const mf::AffineMatrix& m, bool rows_are_outputs, int64_t n_out) {
  const at::Tensor xc = x.contiguous();
  const int64_t K = xc.size(-1), T = K ? xc.numel() / K : 0;
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = n_out;
  at::Tensor y = at::empty(shape, xc.options());
  if (T == 0 || n_out == 0) return y;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor scratch =
      at::empty({std::max<int64_t>(mf::affine_scratch_floats(m, T, rows_are_outputs), 1)}, xc.options());
  const cudaError_t err = mf::affine_matmul(xc.data_ptr<float>(), T, m, rows_are_outputs, y.data_ptr<float>(),
                                            scratch.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "stored_matmul: ", cudaGetErrorString(err));
  return y;
}

// A plain affine matrix in `buffer` as stored_matmul's arguments describe it, checked: one line naming
// what is wrong (`op`: the operator speaking).
mf::AffineMatrix affine_matrix(const char* op, const at::Tensor& buffer, const at::Tensor& x, int64_t kind,
                               int64_t w_off, int64_t s_off, int64_t b_off, int64_t scale_type, int64_t bits,
                               int64_t group, int64_t n_out, bool transposed, bool laid_out) {
  TORCH_CHECK(kind == 0, op, ": ", block_kind(kind), " has no CUDA kernel; GGUF block weights run on the "
              "CPU kernel (the torch backend on device 'cpu')");
  TORCH_CHECK(!laid_out, op, " on CUDA multiplies plain matrices only (laid-out rows and sparse products run on "
              "the CPU kernel or the CUDA sparse FFN)");
  TORCH_CHECK(buffer.is_cuda() && buffer.scalar_type() == at::kByte && buffer.is_contiguous() &&
                  buffer.device() == x.device(),
              op, ": the weights buffer must be a contiguous uint8 tensor on x's device");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, op, " on CUDA reads 2, 4 or 8-bit codes (got ", mf::text(bits), ")");
  TORCH_CHECK(scale_type >= 0 && scale_type <= 2, op, ": unknown scale type ", mf::text(scale_type));
  const int64_t K = x.size(-1);
  // transposed: rows are outputs, W [n_out, K]; else rows are inputs, W [K, n_out]; groups run along a row
  const int64_t rows = transposed ? n_out : K, codes = transposed ? K : n_out;
  TORCH_CHECK(group > 0 && group % 32 == 0 && codes % group == 0, op, " on CUDA needs groups of a multiple ",
              "of 32 codes that divide a row (group ", mf::text(group), ", ", mf::text(codes), " codes a row)");
  const int64_t ssize = scale_type == 2 ? 4 : 2, scale_bytes = rows * (codes / group) * ssize;
  part_ok(buffer, w_off, rows * codes * bits / 8, 4, "codes");
  part_ok(buffer, s_off, scale_bytes, ssize, "scales");
  part_ok(buffer, b_off, scale_bytes, ssize, "biases");
  const uint8_t* base = buffer.data_ptr<uint8_t>();
  return mf::AffineMatrix{reinterpret_cast<const uint32_t*>(base + w_off), base + s_off, base + b_off, rows, codes,
                          (int)bits, (int)group, (int)scale_type};
}

at::Tensor stored_matmul(const at::Tensor& x, const at::Tensor& buffer, int64_t kind, int64_t w_off, int64_t s_off,
                         int64_t b_off, int64_t scale_type, int64_t bits, int64_t group, int64_t n_out,
                         bool transposed, at::IntArrayRef layout, int64_t /*threads*/,
                         const c10::optional<at::Tensor>& ids, int64_t /*listed*/, int64_t /*arith: float here*/) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat, "stored_matmul: x must be a float32 CUDA tensor");
  const mf::AffineMatrix m = affine_matrix("stored_matmul", buffer, x, kind, w_off, s_off, b_off, scale_type, bits,
                                           group, n_out, transposed, !layout.empty() || ids.has_value());
  return affine_product(x, m, transposed, n_out);
}

// One expert matrix of a moe_experts table: [kind, w_off, s_off, b_off, scale type, bits, group, n_out,
// transposed, arith, layout...] (stored_operands.Operands.spec) over `buffer`, for inputs of width k. The
// GPU multiplies in the float arithmetic whatever arith says.
struct ExpertMatrix {
  mf::AffineMatrix m;
  int64_t n_out;
  bool transposed;
};

ExpertMatrix expert_matrix(const at::Tensor& buffer, at::IntArrayRef spec, const at::Tensor& x, int64_t k) {
  TORCH_CHECK(spec.size() >= 10, "moe_experts: a matrix is at least 10 ints (got ", mf::text(spec.size()), ")");
  const at::Tensor probe = x.new_empty({0, k});  // only its width and device are read
  const bool transposed = spec[8] != 0;
  return {affine_matrix("moe_experts", buffer, probe, spec[0], spec[1], spec[2], spec[3], spec[4], spec[5], spec[6],
                        spec[7], transposed, spec.size() > 10),
          spec[7], transposed};
}

// A MoE layer's routed experts in one call on CUDA (the CPU operator's schema and table, ops.cpp):
// the sum plus, for each expert of the table any token routes to, ascending, its tokens gathered
// (ascending), gate and up (one gate|up matrix or two), silu(gate) * up, down, the rows times their
// router weights and added at their tokens. The same torch operations and products in the same order
// as the graph's call set per expert on CUDA (models/moe.py routed_experts), so equal to it bit for
// bit; the routing comes to the host once (one transfer of the ids), never per expert.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& sum,
                       at::TensorList buffers, at::IntArrayRef table, int64_t /*threads*/) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && weights.device() == x.device() &&
                  weights.scalar_type() == at::kFloat && sum.device() == x.device() && sum.scalar_type() == at::kFloat,
              "moe_experts: x, weights and the sum must be float32 tensors on one CUDA device");
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "moe_experts: x [N, D], ids and weights [N, K]");
  TORCH_CHECK(sum.dim() == 2 && sum.size(0) == x.size(0), "moe_experts: the sum so far is [N, Dout]");
  const int64_t N = x.size(0), D = x.size(1), K = ids.size(1), Dout = sum.size(1);
  struct Expert {
    ExpertMatrix gate, up, down;
    bool has_up;
  };
  std::vector<c10::optional<Expert>> experts;
  for (const mf::TableExpert& te : mf::read_moe_table(table, buffers.size())) {
    if (!te.present) {
      experts.emplace_back();
      continue;
    }
    TORCH_CHECK(te.gate.buffer >= 0 && te.down.buffer >= 0, "moe_experts: an expert needs gate and down");
    Expert e{expert_matrix(buffers[te.gate.buffer], te.gate.spec, x, D), {}, {}, te.up.buffer >= 0};
    if (e.has_up) e.up = expert_matrix(buffers[te.up.buffer], te.up.spec, x, D);
    const int64_t F = e.has_up ? e.gate.n_out : e.gate.n_out / 2;
    TORCH_CHECK(e.has_up ? e.up.n_out == e.gate.n_out : e.gate.n_out % 2 == 0,
                "moe_experts: gate and up differ in outputs, or gate|up has an odd number");
    e.down = expert_matrix(buffers[te.down.buffer], te.down.spec, x, F);
    TORCH_CHECK(e.down.n_out == Dout, "moe_experts: an expert's down does not give the sum's width");
    experts.push_back(e);
  }
  const int64_t E = (int64_t)experts.size();
  TORCH_CHECK(E > 0, "moe_experts: no experts");
  // The routing on the host, once: each expert's tokens (ascending) and where their weights lie.
  const at::Tensor host_ids = ids.to(at::kCPU, at::kInt).contiguous();
  const int32_t* id = host_ids.data_ptr<int32_t>();
  std::vector<std::vector<int64_t>> picks(E);  // expert -> token * K + slot
  for (int64_t t = 0; t < N; t++)
    for (int64_t j = 0; j < K; j++) {
      const int32_t e = id[t * K + j];
      TORCH_CHECK(e >= 0 && e < E, "moe_experts: a routed expert id is outside the table (", mf::text(e), " of ",
                  mf::text(E), ")");
      picks[e].push_back(t * K + j);
    }
  std::vector<int64_t> tokens, flat, starts;  // every called expert's tokens and weight positions, in order
  std::vector<int64_t> order;
  for (int64_t e = 0; e < E; e++) {
    if (picks[e].empty() || !experts[e]) continue;
    order.push_back(e);
    starts.push_back((int64_t)tokens.size());
    for (int64_t p : picks[e]) {
      tokens.push_back(p / K);
      flat.push_back(p);
    }
  }
  at::Tensor out = sum;
  if (order.empty()) return out.clone();
  const auto dev = at::TensorOptions().dtype(at::kLong).device(x.device());
  const at::Tensor rows = at::tensor(tokens, at::kLong).to(dev), where = at::tensor(flat, at::kLong).to(dev);
  const at::Tensor w_all = weights.reshape({-1}).index_select(0, where);
  for (size_t i = 0; i < order.size(); i++) {
    const Expert& e = *experts[order[i]];
    const int64_t n = (int64_t)picks[order[i]].size();
    const at::Tensor r = rows.narrow(0, starts[i], n);
    const at::Tensor xe = at::index_select(x, 0, r);
    at::Tensor hidden;
    if (e.has_up) {
      hidden = at::silu(affine_product(xe, e.gate.m, e.gate.transposed, e.gate.n_out)) *
               affine_product(xe, e.up.m, e.up.transposed, e.up.n_out);
    } else {
      const at::Tensor both = affine_product(xe, e.gate.m, e.gate.transposed, e.gate.n_out);
      const int64_t F = e.gate.n_out / 2;
      hidden = at::silu(both.narrow(-1, 0, F)) * both.narrow(-1, F, F);
    }
    const at::Tensor y = affine_product(hidden, e.down.m, e.down.transposed, e.down.n_out);
    out = out.index_add(0, r, y * w_all.narrow(0, starts[i], n).reshape({-1, 1}));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mlx_flash, CUDA, m) {
  m.impl("stored_matmul", &stored_matmul);
  m.impl("moe_experts", &moe_experts);
}
