// The small per-token steps around the products as MLX primitives (kernels/cpu/pointwise.cpp):
// RmsNorm, Rope, SiluMul and WriteTokens (a KV cache's append in place). MLX's CPU build composes
// rms_norm and rope from several elementwise passes (tens of microseconds a decode token); here each is
// one pass of the CPU kernel, taking a strided input (a slice of a fused gate|up product) as it lies.
#include "primitives.h"

#include "primitives_common.h"

namespace mlx_flash {

// ---- RmsNorm, Rope, SiluMul, WriteTokens ----------------------------------------------------------

namespace {

// Rows of `cols` values along the last axis with one row stride (the leading axes collapse into one),
// as a slice of a row-contiguous array along its last axis is; 0 when the array is not so.
int64_t row_stride(const mx::array& a, int64_t cols) {
  if (a.ndim() == 0 || a.strides().back() != 1 && a.shape().back() > 1) return 0;
  if (a.ndim() == 1) return cols;
  const auto& st = a.strides();
  const auto& sh = a.shape();
  for (size_t i = 0; i + 2 < st.size(); i++)
    if (sh[i] > 1 && st[i] != st[i + 1] * sh[i + 1]) return 0;
  return st[st.size() - 2];
}

mx::array fresh(const mx::array& x, mx::Stream s) {
  return mx::astype(x, mx::float32, s);  // laid out by the primitive (Gathered)
}

}  // namespace

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &x = inputs[0], &w = inputs[1];
  mx::array& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_output_array(y);
  const int64_t D = x.shape().back(), rows = D ? static_cast<int64_t>(x.size()) / D : 0;
  enc.dispatch([xb = x.data<float>(), xs = x.shape(), xst = x.strides(), xr = x.flags().row_contiguous,
                wb = w.data<float>(), ws = w.shape(), wst = w.strides(), wr = w.flags().row_contiguous,
                yp = y.data<float>(), eps = eps_, rows, D]() {
    const Gathered xg(xb, xs, xst, xr), wg(wb, ws, wst, wr);
    check(kernels().rms_norm(xg.data, wg.data, eps, rows, D, yp), "RmsNorm");
  });
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  need(w.ndim() == 1 && x.ndim() >= 1 && x.shape().back() == w.shape(0), "rms_norm: w must be [D] for x [.., D]");
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps), {fresh(x, s), fresh(w, s)});
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &x = inputs[0], &f = inputs[1], &pos = inputs[2];
  mx::array& y = outputs[0];
  if (x.strides().back() != 1 && x.shape().back() > 1) throw std::runtime_error("Rope: the head dimension must be contiguous");
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  const auto& st = x.strides();
  enc.dispatch([xp = x.data<float>(), fp = f.data<float>(), pp = pos.data<int32_t>(), yp = y.data<float>(),
                B = x.shape(0), H = x.shape(1), T = x.shape(2), hd = x.shape(3), xs0 = st[0], xs1 = st[1], xs2 = st[2],
                dims = dims_, trad = traditional_, scale = scale_]() {
    const int64_t xs[3] = {xs0, xs1, xs2};
    check(kernels().rope(xp, B, H, T, hd, xs, fp, dims, trad ? 1 : 0, pp, scale, yp), "Rope");
  });
}

mx::array rope(const mx::array& x, const mx::array& inv_freq, const mx::array& pos, int dims, bool traditional,
               float scale) {
  need(x.ndim() == 4, "rope: x must be [B, H, T, hd]");
  need(dims >= 2 && dims % 2 == 0 && dims <= x.shape(3), "rope: dims must be even and at most the head dimension");
  need(inv_freq.ndim() == 1 && inv_freq.shape(0) == dims / 2, "rope: inv_freq must be [dims / 2]");
  need(pos.ndim() == 1 && pos.shape(0) == x.shape(0), "rope: pos must be [B]");
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, dims, traditional, scale),
                   {mx::astype(x, mx::float32, s), fresh(inv_freq, s),
                    mx::contiguous(mx::astype(pos, mx::int32, s), false, s)});
}

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &g = inputs[0], &u = inputs[1];
  mx::array& y = outputs[0];
  const int64_t F = g.ndim() ? g.shape().back() : 1, rows = F ? static_cast<int64_t>(g.size()) / F : 0;
  const int64_t gs = row_stride(g, F), us = row_stride(u, F);
  if (rows > 1 && (gs == 0 || us == 0)) throw std::runtime_error("SiluMul: inputs must be rows along the last axis");
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(g);
  enc.set_input_array(u);
  enc.set_output_array(y);
  enc.dispatch([gp = g.data<float>(), up = u.data<float>(), yp = y.data<float>(), F, rows, gs, us]() {
    for (int64_t r = 0; r < rows; r++) check(kernels().silu_mul(gp + r * gs, up + r * us, F, yp + r * F), "SiluMul");
  });
}

mx::array silu_mul(const mx::array& g, const mx::array& u) {
  need(g.shape() == u.shape(), "silu_mul: g and u differ in shape");
  auto s = cpu_stream();
  return mx::array(g.shape(), mx::float32, std::make_shared<SiluMul>(s),
                   {mx::astype(g, mx::float32, s), mx::astype(u, mx::float32, s)});
}

void WriteTokens::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &buf = inputs[0], &x = inputs[1];
  mx::array& out = outputs[0];
  const int64_t B = buf.shape(0), H = buf.shape(1), cap = buf.shape(2), hd = buf.shape(3), T = x.shape(2);
  if (x.strides().back() != 1 && hd > 1) throw std::runtime_error("WriteTokens: the head dimension must be contiguous");
  const bool own = buf.flags().row_contiguous && buf.data_size() == buf.size();
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(buf);
  enc.set_input_array(x);
  enc.set_output_array(out);
  const float* src = nullptr;
  mx::Strides bst;
  if (own) {
    out.copy_shared_buffer(buf);
  } else {  // a broadcast (zeros) or strided buffer: into memory of its own first
    out.set_data(mx::allocator::malloc(out.nbytes()));
    src = buf.data<float>();
    bst = buf.strides();
  }
  const auto& xst = x.strides();
  enc.dispatch([op = out.data<float>(), xp = x.data<float>(), B, H, cap, hd, T, xs0 = xst[0], xs1 = xst[1],
                xs2 = xst[2], offset = offset_, src, bst]() {
    if (src != nullptr)
      for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
          for (int64_t t = 0; t < cap; t++)
            for (int64_t d = 0; d < hd; d++)
              op[((b * H + h) * cap + t) * hd + d] = src[b * bst[0] + h * bst[1] + t * bst[2] + d * bst[3]];
    const int64_t xs[3] = {xs0, xs1, xs2};
    check(kernels().write_tokens(op, B, H, cap, hd, xp, xs, T, offset), "WriteTokens");
  });
}

mx::array write_tokens(const mx::array& buffer, const mx::array& x, int64_t offset) {
  need(buffer.ndim() == 4 && x.ndim() == 4, "write_tokens: buffer and x must be [B, H, tokens, hd]");
  need(buffer.dtype() == mx::float32, "write_tokens: the buffer must be float32");
  need(x.shape(0) == buffer.shape(0) && x.shape(1) == buffer.shape(1) && x.shape(3) == buffer.shape(3),
       "write_tokens: x does not fit the buffer");
  need(offset >= 0 && offset + x.shape(2) <= buffer.shape(2), "write_tokens: the tokens run past the buffer");
  auto s = cpu_stream();
  return mx::array(buffer.shape(), mx::float32, std::make_shared<WriteTokens>(s, offset),
                   {buffer, mx::astype(x, mx::float32, s)});
}

}  // namespace mlx_flash
