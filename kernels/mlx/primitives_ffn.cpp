// Whole FFN layers as MLX primitives: GatedFFN (gate, up and down of a dense or sparse layer in one
// node; kernels/cpu/gated_ffn.cpp) and MoEExperts (a MoE layer's routed experts in one node;
// kernels/cpu/moe_experts.cpp). The same products and activation as separate nodes, to the bit: what
// one node saves is the dispatch of several and their intermediate arrays (the activations' scratch is
// taken from MLX's allocator, so MLX counts it).
#include "primitives.h"

#include <algorithm>

#include "primitives_common.h"

namespace mlx_flash {

// ---- GatedFFN ------------------------------------------------------------------------------------

namespace {
mf_matrix matrix_at(const MatrixSpec& m, const uint8_t* base, Listed listed, const int32_t* ids) {
  return mf_matrix{m.kind, base + m.w_off, base + m.s_off, base + m.b_off, m.scale_type, m.bits, m.group, m.n_out,
                   m.transposed ? 1 : 0, m.layout.empty() ? nullptr : m.layout.data(),
                   listed == Listed::Rows ? ids : nullptr, listed == Listed::Groups ? ids : nullptr, m.arith};
}
}  // namespace

std::vector<mx::Shape> GatedFFN::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.back() = static_cast<int>(down_.n_out);
  return {s};
}

bool GatedFFN::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedFFN&>(other);
  return gate_ == o.gate_ && up_ == o.up_ && down_ == o.down_ && listed_ == o.listed_ && threads_ == o.threads_;
}

void GatedFFN::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  const uint8_t* g_base = inputs[1].data<uint8_t>();
  const uint8_t* u_base = inputs[2].data<uint8_t>();
  const uint8_t* d_base = inputs[3].data<uint8_t>();
  record(name(), g_base + gate_.w_off);
  if (up_) record(name(), u_base + up_->w_off);
  record(name(), d_base + down_.w_off);
  const int64_t K = x.shape().back(), T = K ? static_cast<int64_t>(x.size()) / K : 0;
  const int64_t hidden_floats = T * (up_ ? 2 * gate_.n_out : gate_.n_out);
  // The specs travel by value: the task may run after this primitive is gone (the graph is detached
  // once evaluated), and mf_matrix points into their layouts.
  const int32_t* ids = inputs.size() > 4 ? inputs[4].data<int32_t>() : nullptr;
  enc.dispatch([gate = gate_, up = up_, down = down_, listed = listed_, ids, g_base, u_base, d_base, threads = threads_,
                xbase = x.data<float>(), xshape = x.shape(), xstrides = x.strides(), xrow = x.flags().row_contiguous,
                yp = y.data<float>(), T, K, hidden_floats]() {
    const Gathered xg(xbase, xshape, xstrides, xrow);
    auto on = [&](size_t i) { return listed.empty() ? Listed::None : listed[i]; };
    const mf_matrix g = matrix_at(gate, g_base, on(0), ids), dn = matrix_at(down, d_base, on(2), ids);
    const mf_matrix u = up ? matrix_at(*up, u_base, on(1), ids) : mf_matrix{};
    // the activations' scratch from MLX's allocator (freed on leaving): memory counted as MLX's
    const mx::allocator::Data hidden = mx::allocator::malloc(static_cast<size_t>(hidden_floats) * sizeof(float));
    check(kernels().gated_ffn(xg.data, T, K, &g, up ? &u : nullptr, &dn, static_cast<float*>(hidden.buffer().raw_ptr()),
                              yp, threads),
          "GatedFFN");
  });
}

mx::array gated_ffn(const mx::array& x, const mx::array& gate_buffer, MatrixSpec gate, const mx::array& up_buffer,
                    std::optional<MatrixSpec> up, const mx::array& down_buffer, MatrixSpec down, int threads,
                    const std::optional<mx::array>& ids, std::vector<Listed> listed) {
  need(listed.empty() || listed.size() == 3, "gated_ffn: listed is empty (dense) or one value per matrix");
  need(listed.empty() == !ids.has_value(), "gated_ffn: ids go with what each matrix lists");
  for (const mx::array* b : {&gate_buffer, &up_buffer, &down_buffer})
    need(b->dtype() == mx::uint8, "gated_ffn: the buffers must be uint8");
  need(x.ndim() >= 1, "gated_ffn: x needs a last axis");
  need(up ? up->n_out == gate.n_out : gate.n_out % 2 == 0,
       "gated_ffn: gate and up differ in outputs, or gate|up has an odd number");
  for (const MatrixSpec* m : {&gate, up ? &*up : &gate, &down})
    need(m->layout.empty() || m->layout.size() == (m->kind == 0 ? 7u : 4u),
         "gated_ffn: a layout is 7 ints (affine) or 4 (block types)");
  auto s = cpu_stream();
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(down.n_out);
  std::vector<mx::array> inputs{float_rows(x, s), gate_buffer, up_buffer, down_buffer};
  if (ids) inputs.push_back(mx::contiguous(mx::astype(*ids, mx::int32, s), false, s));
  return mx::array(shape, mx::float32,
                   std::make_shared<GatedFFN>(s, std::move(gate), std::move(up), std::move(down), std::move(listed),
                                              threads),
                   std::move(inputs));
}

// ---- MoEExperts ----------------------------------------------------------------------------------

bool MoEExperts::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const MoEExperts&>(other);
  return experts_ == o.experts_ && scratch_ == o.scratch_ && threads_ == o.threads_;
}

void MoEExperts::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &x = inputs[0], &ids = inputs[1], &wts = inputs[2], &sum = inputs[3];
  mx::array& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  std::vector<const uint8_t*> bases;
  for (size_t i = 4; i < inputs.size(); i++) bases.push_back(inputs[i].data<uint8_t>());
  for (const ExpertSpec& e : experts_)
    if (e.present()) record(name(), bases[e.buffer[0]] + e.gate.w_off);
  const int64_t N = x.shape(0), D = x.shape(1), K = ids.shape(1), Dout = sum.shape(1);
  enc.dispatch([experts = experts_, bases, threads = threads_, scratch_floats = scratch_, xp = x.data<float>(),
                ip = ids.data<int32_t>(), wp = wts.data<float>(), sp = sum.data<float>(), yp = y.data<float>(), N, D, K,
                Dout]() {
    std::copy(sp, sp + N * Dout, yp);
    const int64_t E = static_cast<int64_t>(experts.size());
    std::vector<mf_matrix> mats(3 * E);
    std::vector<const mf_matrix*> table(3 * E, nullptr);
    for (int64_t e = 0; e < E; e++) {
      const ExpertSpec& s = experts[e];
      if (!s.present()) continue;
      const MatrixSpec* specs[3] = {&s.gate, &s.up, &s.down};
      for (int m = 0; m < 3; m++) {
        if (s.buffer[m] < 0) continue;
        mats[3 * e + m] = matrix_at(*specs[m], bases[s.buffer[m]], Listed::None, nullptr);
        table[3 * e + m] = &mats[3 * e + m];
      }
    }
    // the experts' scratch from MLX's allocator (freed on leaving): memory counted as MLX's
    const mx::allocator::Data scratch = mx::allocator::malloc(static_cast<size_t>(std::max<int64_t>(scratch_floats, 1)) *
                                                              sizeof(float));
    check(kernels().moe_experts(xp, N, D, ip, wp, K, E, table.data(), Dout,
                                static_cast<float*>(scratch.buffer().raw_ptr()), yp, threads),
          "MoEExperts");
  });
}

mx::array moe_experts(const mx::array& x, const mx::array& ids, const mx::array& weights, const mx::array& sum,
                      const std::vector<mx::array>& buffers, std::vector<ExpertSpec> experts, int threads) {
  need(x.ndim() == 2 && ids.ndim() == 2 && weights.shape() == ids.shape() && ids.shape(0) == x.shape(0),
       "moe_experts: x [N, D], ids and weights [N, K]");
  need(sum.ndim() == 2 && sum.shape(0) == x.shape(0), "moe_experts: the sum so far is [N, Dout]");
  need(!experts.empty(), "moe_experts: no experts");
  int64_t f_max = 0;
  for (const ExpertSpec& e : experts) {
    if (!e.present()) continue;
    for (int b : e.buffer)
      need(b < static_cast<int>(buffers.size()), "moe_experts: an expert's buffer index is past the buffers");
    need(e.buffer[2] >= 0 && e.down.n_out == sum.shape(1),
         "moe_experts: an expert's down matrix is missing or does not give the sum's width");
    const bool with_up = e.buffer[1] >= 0;
    need(with_up ? e.up.n_out == e.gate.n_out : e.gate.n_out % 2 == 0,
         "moe_experts: gate and up differ in outputs, or gate|up has an odd number");
    f_max = std::max<int64_t>(f_max, with_up ? e.gate.n_out : e.gate.n_out / 2);
  }
  for (const mx::array& b : buffers) need(b.dtype() == mx::uint8, "moe_experts: the buffers must be uint8");
  auto s = cpu_stream();
  const int64_t N = x.shape(0), D = x.shape(1), Dout = sum.shape(1);
  std::vector<mx::array> inputs{mx::contiguous(float_rows(x, s), false, s),
                                mx::contiguous(mx::astype(ids, mx::int32, s), false, s),
                                mx::contiguous(mx::astype(weights, mx::float32, s), false, s),
                                mx::contiguous(mx::astype(sum, mx::float32, s), false, s)};
  inputs.insert(inputs.end(), buffers.begin(), buffers.end());
  return mx::array(sum.shape(), mx::float32,
                   std::make_shared<MoEExperts>(s, std::move(experts), N * (D + 2 * f_max + Dout), threads),
                   std::move(inputs));
}

}  // namespace mlx_flash
