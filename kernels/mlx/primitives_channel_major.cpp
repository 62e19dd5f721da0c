// The channel-major product as MLX primitives: ChannelMajorMatmul (x times a stored matrix rewritten
// into the channel-major layout, skipping the channels of zeroed inputs; kernels/cpu/channel_major.cpp)
// and ChannelMajorFFN (a gated FFN layer of such products in one node; channel_major_ffn.cpp). They
// read each layout where it lies in a uint8 buffer input, and add what each product counted (rows,
// active channels, active groups) to the CmCounters object it was given.
#include <algorithm>
#include <cmath>

#include "primitives.h"

#include "primitives_common.h"

namespace mlx_flash {

std::vector<mx::Shape> ChannelMajorMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.back() = static_cast<int>(spec_.n_out);
  return {s};
}

bool ChannelMajorMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ChannelMajorMatmul&>(other);
  return spec_ == o.spec_ && threshold_ == o.threshold_ && threads_ == o.threads_ && counters_ == o.counters_;
}

void ChannelMajorMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& buf = inputs[1];
  mx::array& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  const uint8_t* base = buf.data<uint8_t>() + spec_.offset;
  record(name(), base);
  const int64_t K = x.shape().back(), T = K ? static_cast<int64_t>(x.size()) / K : 0;
  enc.dispatch([spec = spec_, threshold = threshold_, threads = threads_, counters = counters_, xbase = x.data<float>(),
                xshape = x.shape(), xstrides = x.strides(), xrow = x.flags().row_contiguous, yp = y.data<float>(), base,
                T]() {
    const Gathered xg(xbase, xshape, xstrides, xrow);
    int64_t counts[3] = {0, 0, 0};
    check(kernels().cm_matmul(base, spec.n_out, spec.k_in, spec.bits, spec.group, spec.scale_type, xg.data, T,
                              threshold, yp, threads, counts),
          "ChannelMajorMatmul");
    if (counters) counters->add(counts);
  });
}

namespace {

// The size of spec's layout, checked to lie inside `buffer` (what = the call, for the message).
void check_layout(const mx::array& buffer, const CmSpec& spec, const std::string& what) {
  need(buffer.dtype() == mx::uint8, what + ": the buffer must be uint8");
  const int64_t size = kernels().cm_bytes(spec.n_out, spec.k_in, spec.bits, spec.group, spec.scale_type);
  need(size >= 0, what + ": the channel-major layout refuses this matrix (code " + std::to_string(size) +
                      "): bits 2, 4 or 8, groups of 32 .. 256 dividing K, scale type 0, 1 or 2");
  need(spec.offset >= 0 && spec.offset + size <= static_cast<int64_t>(buffer.size()),
       what + ": the layout lies past its buffer (" + std::to_string(spec.offset + size) + " > " +
           std::to_string(buffer.size()) + " bytes)");
}

void check_x(const mx::array& x, int64_t k_in, const std::string& what) {
  need(x.ndim() >= 1 && x.shape().back() == k_in,
       what + ": x must be [.., " + std::to_string(k_in) + "] (got " + shape_str(x.shape()) + ")");
}

mf_cm_matrix cm_at(const CmSpec& s, const uint8_t* base) {
  return mf_cm_matrix{base + s.offset, s.n_out, s.k_in, s.bits, s.group, s.scale_type};
}

}  // namespace

mx::array cm_matmul(const mx::array& x, const mx::array& buffer, CmSpec spec, float threshold, int threads,
                    std::shared_ptr<CmCounters> counters) {
  check_layout(buffer, spec, "cm_matmul");
  check_x(x, spec.k_in, "cm_matmul");
  need(!std::isnan(threshold), "cm_matmul: the threshold must be a number (got NaN)");
  auto s = cpu_stream();
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(spec.n_out);
  return mx::array(shape, mx::float32,
                   std::make_shared<ChannelMajorMatmul>(s, spec, threshold, threads < 1 ? 1 : threads,
                                                        std::move(counters)),
                   {float_rows(x, s), buffer});
}

// ---- ChannelMajorFFN -----------------------------------------------------------------------------

std::vector<mx::Shape> ChannelMajorFFN::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.back() = static_cast<int>(down_.n_out);
  return {s};
}

bool ChannelMajorFFN::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ChannelMajorFFN&>(other);
  return gate_ == o.gate_ && up_ == o.up_ && down_ == o.down_ && t_gu_ == o.t_gu_ && t_down_ == o.t_down_ &&
         act_ == o.act_ && threads_ == o.threads_ && counters_ == o.counters_;
}

void ChannelMajorFFN::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  const mf_cm_matrix g = cm_at(gate_, inputs[1].data<uint8_t>()), dn = cm_at(down_, inputs[3].data<uint8_t>());
  const mf_cm_matrix u = up_ ? cm_at(*up_, inputs[2].data<uint8_t>()) : mf_cm_matrix{};
  record(name(), g.w);
  if (up_) record(name(), u.w);
  record(name(), dn.w);
  const int64_t K = x.shape().back(), T = K ? static_cast<int64_t>(x.size()) / K : 0;
  const int64_t hidden_floats = std::max<int64_t>(2 * T * down_.k_in, 1);
  enc.dispatch([g, u, dn, with_up = up_.has_value(), t_gu = t_gu_, t_down = t_down_, act = act_, threads = threads_,
                counters = counters_, xbase = x.data<float>(), xshape = x.shape(), xstrides = x.strides(),
                xrow = x.flags().row_contiguous, yp = y.data<float>(), T, hidden_floats]() {
    const Gathered xg(xbase, xshape, xstrides, xrow);
    // the activations' scratch from MLX's allocator (freed on leaving): memory counted as MLX's
    const mx::allocator::Data hidden = mx::allocator::malloc(static_cast<size_t>(hidden_floats) * sizeof(float));
    int64_t counts[3][3] = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
    check(kernels().cm_gated_ffn(xg.data, T, &g, with_up ? &u : nullptr, &dn, t_gu, t_down, act,
                                 static_cast<float*>(hidden.buffer().raw_ptr()), yp, threads, counts[0], counts[1],
                                 counts[2]),
          "ChannelMajorFFN");
    for (int m = 0; m < 3; m++)
      if (counters[m]) counters[m]->add(counts[m]);
  });
}

mx::array cm_gated_ffn(const mx::array& x, const mx::array& gate_buffer, CmSpec gate, const mx::array& up_buffer,
                       std::optional<CmSpec> up, const mx::array& down_buffer, CmSpec down, float t_gu, float t_down,
                       int act, int threads, ChannelMajorFFN::Counters counters) {
  check_layout(gate_buffer, gate, "cm_gated_ffn gate");
  if (up) check_layout(up_buffer, *up, "cm_gated_ffn up");
  check_layout(down_buffer, down, "cm_gated_ffn down");
  check_x(x, gate.k_in, "cm_gated_ffn");
  need(up ? up->n_out == gate.n_out && up->k_in == gate.k_in : gate.n_out % 2 == 0,
       "cm_gated_ffn: gate and up differ in shape, or gate|up has an odd number of outputs (" +
           std::to_string(gate.n_out) + ")");
  const int64_t F = up ? gate.n_out : gate.n_out / 2;
  need(down.k_in == F, "cm_gated_ffn: down takes " + std::to_string(down.k_in) + " inputs, the activations are " +
                           std::to_string(F));
  need(!std::isnan(t_gu) && !std::isnan(t_down), "cm_gated_ffn: the thresholds must be numbers (got NaN)");
  need(act == 0 || act == 1, "cm_gated_ffn: act is 0 (silu) or 1 (gelu, tanh approximation)");
  auto s = cpu_stream();
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(down.n_out);
  return mx::array(shape, mx::float32,
                   std::make_shared<ChannelMajorFFN>(s, gate, up, down, t_gu, t_down, act, threads < 1 ? 1 : threads,
                                                     std::move(counters)),
                   {float_rows(x, s), gate_buffer, up_buffer, down_buffer});
}

}  // namespace mlx_flash
