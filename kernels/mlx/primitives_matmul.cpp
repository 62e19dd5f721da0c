// Products and rows of stored matrices as MLX primitives: StoredMatmul (x times a quantized or GGUF
// block matrix, dense or sparse over listed rows or groups; kernels/cpu/qmatmul.cpp, blockmatmul.cpp)
// and StoredRows (an embedding's rows; kernels/cpu/rows.cpp). Both read the weights where the reader
// put them in a uint8 buffer input, at the byte offsets their MatrixSpec names: no copy of a weight.
#include "primitives.h"

#include "primitives_common.h"

namespace mlx_flash {

// ---- StoredMatmul ----------------------------------------------------------------------------------

std::vector<mx::Shape> StoredMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.back() = static_cast<int>(spec_.n_out);
  return {s};
}

bool StoredMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const StoredMatmul&>(other);
  return spec_ == o.spec_ && listed_ == o.listed_ && threads_ == o.threads_;
}

void StoredMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& buf = inputs[1];
  mx::array& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  const uint8_t* base = buf.data<uint8_t>();
  record(name(), base + spec_.w_off);
  const int32_t* ids = inputs.size() > 2 ? inputs[2].data<int32_t>() : nullptr;
  const int64_t K = x.shape().back(), T = K ? static_cast<int64_t>(x.size()) / K : 0;
  enc.dispatch([spec = spec_, listed = listed_, threads = threads_, xbase = x.data<float>(), xshape = x.shape(),
                xstrides = x.strides(), xrow = x.flags().row_contiguous, yp = y.data<float>(), base, ids, T, K]() {
    const Gathered xg(xbase, xshape, xstrides, xrow);
    const float* xp = xg.data;
    const int32_t* rows = listed == Listed::Rows ? ids : nullptr;
    const int32_t* groups = listed == Listed::Groups ? ids : nullptr;
    const int64_t* lay = spec.layout.empty() ? nullptr : spec.layout.data();
    if (spec.kind == 0) {
      check(kernels().qmatmul(xp, T, K, reinterpret_cast<const uint32_t*>(base + spec.w_off), base + spec.s_off,
                              base + spec.b_off, spec.scale_type, spec.n_out, spec.bits, spec.group,
                              spec.transposed ? 1 : 0, yp, threads, lay, rows, groups, spec.arith),
            "StoredMatmul");
    } else {
      check(kernels().blockmatmul(xp, T, K, base + spec.w_off, spec.kind, spec.n_out, yp, threads, lay, rows, groups,
                                  spec.arith),
            "StoredMatmul");
    }
  });
}

mx::array stored_matmul(const mx::array& x, const mx::array& buffer, MatrixSpec spec, int threads,
                        const std::optional<mx::array>& ids, Listed listed) {
  need(buffer.dtype() == mx::uint8, "stored_matmul: the buffer must be uint8");
  need(x.ndim() >= 1, "stored_matmul: x needs a last axis");
  need(spec.layout.empty() || spec.layout.size() == (spec.kind == 0 ? 7u : 4u),
       "stored_matmul: a layout is 7 ints (affine) or 4 (block types)");
  need(ids.has_value() == (listed != Listed::None), "stored_matmul: ids go with a listed axis (rows or groups)");
  auto s = cpu_stream();
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(spec.n_out);
  std::vector<mx::array> inputs{float_rows(x, s), buffer};
  if (ids) inputs.push_back(mx::contiguous(mx::astype(*ids, mx::int32, s), false, s));
  return mx::array(shape, mx::float32, std::make_shared<StoredMatmul>(s, std::move(spec), listed, threads),
                   std::move(inputs));
}

// ---- StoredRows ----------------------------------------------------------------------------------

std::vector<mx::Shape> StoredRows::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.push_back(static_cast<int>(k_));
  return {s};
}

bool StoredRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const StoredRows&>(other);
  return spec_ == o.spec_ && rows_ == o.rows_ && k_ == o.k_ && wr_ == o.wr_ && sr_ == o.sr_;
}

void StoredRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& ids = inputs[0];
  const mx::array& buf = inputs[1];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(ids);
  enc.set_input_array(buf);
  enc.set_output_array(out);
  const uint8_t* base = buf.data<uint8_t>();
  record(name(), base + spec_.w_off);
  enc.dispatch([spec = spec_, rows = rows_, k = k_, wr = wr_, sr = sr_, ip = ids.data<int32_t>(), n = ids.size(),
                op = out.data<float>(), base]() {
    check(kernels().rows(ip, static_cast<int64_t>(n), rows, base + spec.w_off, base + spec.s_off, base + spec.b_off,
                         spec.kind, spec.bits, spec.group, spec.scale_type, k, wr, sr, op),
          "StoredRows");
  });
}

mx::array stored_rows(const mx::array& ids, const mx::array& buffer, MatrixSpec spec, int64_t rows, int64_t k,
                      int64_t row_bytes, int64_t scale_row_bytes) {
  need(buffer.dtype() == mx::uint8, "stored_rows: the buffer must be uint8");
  auto s = cpu_stream();
  mx::Shape shape = ids.shape();
  shape.push_back(static_cast<int>(k));
  return mx::array(shape, mx::float32,
                   std::make_shared<StoredRows>(s, std::move(spec), rows, k, row_bytes, scale_row_bytes),
                   {mx::contiguous(mx::astype(ids, mx::int32, s), false, s), buffer});
}

}  // namespace mlx_flash
