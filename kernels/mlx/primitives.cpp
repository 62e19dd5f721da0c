#include "primitives.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>

#include "kernel_library.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/utils.h"

namespace mlx_flash {

namespace {

std::atomic<bool> g_recording{false};
std::mutex g_record_mu;
std::vector<InputRecord> g_records;

void record(const char* primitive, const void* address) {
  if (!g_recording.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_record_mu);
  g_records.push_back({primitive, reinterpret_cast<uintptr_t>(address)});
}

// A kernel refused its arguments: the graph cannot raise where Python sees it, so say it in the
// exception MLX carries out of eval (the builders check arguments first; this is the last line).
void check(int64_t rc, const char* what) {
  if (rc < 0) throw std::runtime_error(std::string(what) + ": the CPU kernel refused its arguments (code " +
                                       std::to_string(rc) + ")");
}

void need(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// Every primitive here runs on the CPU, whatever the default device: on Apple silicon the GPU's graph
// takes their results from unified memory (MLX orders the two streams).
mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

// Without iostreams: a number streamed into an ostringstream crashed the extension built on a Linux
// machine with GCC 13 (the stream's number formatter, as the torch operators' check_text.h says).
std::string shape_str(const mx::Shape& s) {
  std::string o = "(";
  for (size_t i = 0; i < s.size(); i++) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + ")";
}

mx::array float_rows(const mx::array& x, mx::Stream s) {
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

}  // namespace

void record_inputs(bool on) {
  std::lock_guard<std::mutex> lock(g_record_mu);
  g_records.clear();
  g_recording.store(on);
}

std::vector<InputRecord> recorded_inputs() {
  std::lock_guard<std::mutex> lock(g_record_mu);
  return g_records;
}

void CpuPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(name()) + " has no GPU kernel (the GPU backend keeps MLX's own ops)");
}

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

// ---- Attention -----------------------------------------------------------------------------------

namespace {

// Checks q, k, v's head dimension and gives the output [B, Hq, T, hd] memory laid out as [B, T, Hq,
// hd]: transposed back, the output projection's input [B, T, Hq * hd] is then row-contiguous without
// a copy. Returns the output's strides.
mx::Strides attention_output(const mx::array& q, const mx::array& k, const mx::array& v, mx::array& out,
                             const char* what) {
  for (const mx::array* a : {&q, &k, &v})
    if (a->strides().back() != 1 && a->shape().back() > 1)
      throw std::runtime_error(std::string(what) + ": the head dimension of q, k and v must be contiguous");
  const int64_t Hq = q.shape(1), T = q.shape(2), hd = q.shape(3);
  mx::Strides strides{T * Hq * hd, hd, Hq * hd, 1};
  mx::array::Flags flags;
  flags.contiguous = true;
  flags.row_contiguous = T == 1 || Hq == 1;
  flags.col_contiguous = out.size() <= 1;
  out.set_data(mx::allocator::malloc(out.nbytes()), out.size(), strides, flags);
  return strides;
}

}  // namespace

std::vector<mx::Shape> Attention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Attention&>(other);
  return scale_ == o.scale_ && mode_ == o.mode_ && threads_ == o.threads_ && window_ == o.window_;
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
  mx::array& out = outputs[0];
  const int64_t B = q.shape(0), Hq = q.shape(1), T = q.shape(2), hd = q.shape(3), Hkv = k.shape(1);
  const mx::Strides strides = attention_output(q, k, v, out, "Attention");
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  const bool f16 = k.dtype() == mx::float16;
  if (!f16 && k.dtype() != mx::float32) throw std::runtime_error("Attention: keys and values must be float32 or float16");
  const int64_t S = k.shape(2);
  const int32_t* kv_len = mode_ == Mode::Uniform ? nullptr : inputs[3].data<int32_t>();
  const int32_t* q_pos = mode_ == Mode::Uniform ? nullptr : inputs[4].data<int32_t>();
  const int32_t* table = mode_ == Mode::Table ? inputs[5].data<int32_t>() : nullptr;
  const int64_t max_blocks = mode_ == Mode::Table ? inputs[5].shape(1) : 0;
  const int64_t block_tokens = mode_ == Mode::Table ? S : 0;
  const mx::Strides &qs = q.strides(), &ks = k.strides(), &vs = v.strides();
  enc.dispatch([=, qp = q.data<float>(), kp = k.data<void>(), vp = v.data<void>(), op = out.data<float>(),
                scale = scale_, threads = threads_, window = window_]() {
    std::vector<int32_t> lens, pos;
    const int32_t *lp = kv_len, *pp = q_pos;
    if (lp == nullptr) {  // every row holds S keys, its queries the last T of them
      lens.assign(B, static_cast<int32_t>(S));
      pos.assign(B, static_cast<int32_t>(S - T));
      lp = lens.data();
      pp = pos.data();
    }
    const int64_t qst[3] = {qs[0], qs[1], qs[2]}, kst[3] = {ks[0], ks[1], ks[2]}, vst[3] = {vs[0], vs[1], vs[2]};
    const int64_t ost[3] = {strides[0], strides[1], strides[2]};
    check(kernels().attention(qp, B, Hq, T, hd, qst, kp, vp, f16 ? 1 : 0, Hkv, kst, vst, table, max_blocks,
                              block_tokens, lp, pp, scale, op, ost, threads, window),
          "Attention");
  });
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, int threads,
                    const std::optional<mx::array>& kv_len, const std::optional<mx::array>& q_pos,
                    const std::optional<mx::array>& table, int64_t window) {
  need(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "attention: q, k and v must be 4-D");
  need(window >= 0, "attention: window must be 0 (every key) or a positive number of keys");
  need(k.shape() == v.shape(), "attention: k and v differ in shape " + shape_str(k.shape()) + " vs " +
                                   shape_str(v.shape()));
  need(q.shape(3) == k.shape(3) && k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0,
       "attention: q " + shape_str(q.shape()) + " does not fit k " + shape_str(k.shape()));
  need(kv_len.has_value() == q_pos.has_value(), "attention: kv_len and q_pos go together");
  need(!table || kv_len, "attention: a slot table needs kv_len and q_pos");
  need(k.dtype() == v.dtype(), "attention: k and v differ in dtype");
  auto s = cpu_stream();
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, s), k, v};
  auto mode = Attention::Mode::Uniform;
  if (kv_len) {
    need(kv_len->size() == static_cast<size_t>(q.shape(0)), "attention: kv_len needs one length per row");
    mode = table ? Attention::Mode::Table : Attention::Mode::Rows;
    inputs.push_back(mx::contiguous(mx::astype(*kv_len, mx::int32, s), false, s));
    inputs.push_back(mx::contiguous(mx::astype(*q_pos, mx::int32, s), false, s));
  } else {
    need(k.shape(0) == q.shape(0), "attention: q and k differ in rows");
    need(k.shape(2) >= q.shape(2), "attention: fewer keys than queries");
  }
  if (table) inputs.push_back(mx::contiguous(mx::astype(*table, mx::int32, s), false, s));
  return mx::array(q.shape(), mx::float32, std::make_shared<Attention>(s, scale, mode, threads, window),
                   std::move(inputs));
}

std::vector<mx::Shape> CodedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool CodedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CodedAttention&>(other);
  return scale_ == o.scale_ && threads_ == o.threads_ && k_layout_ == o.k_layout_ && v_layout_ == o.v_layout_ &&
         table_ == o.table_;
}

void CodedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &kb = inputs[3], &vb = inputs[4];
  mx::array& out = outputs[0];
  const int64_t B = q.shape(0), Hq = q.shape(1), T = q.shape(2), hd = q.shape(3), Hkv = k.shape(1), R = k.shape(2);
  const mx::Strides strides = attention_output(q, k, v, out, "CodedAttention");
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  mf_kv_codes kc, vc;
  kv_codes_from(k_layout_.data(), k_layout_.size(), kb.data<uint8_t>(), kb.nbytes(), &kc);
  kv_codes_from(v_layout_.data(), v_layout_.size(), vb.data<uint8_t>(), vb.nbytes(), &vc);
  record("CodedAttention", kc.base);
  record("CodedAttention", vc.base);
  const int32_t* table = table_ ? inputs[8].data<int32_t>() : nullptr;
  const int64_t max_blocks = table_ ? inputs[8].shape(1) : 0;
  const mx::Strides &qs = q.strides(), &ks = k.strides(), &vs = v.strides();
  enc.dispatch([=, qp = q.data<float>(), kp = k.data<void>(), vp = v.data<void>(), op = out.data<float>(),
                coded = inputs[5].data<int32_t>(), lens = inputs[6].data<int32_t>(), pos = inputs[7].data<int32_t>(),
                f16 = k.dtype() == mx::float16, scale = scale_, threads = threads_]() {
    const int64_t qst[3] = {qs[0], qs[1], qs[2]}, kst[3] = {ks[0], ks[1], ks[2]}, vst[3] = {vs[0], vs[1], vs[2]};
    const int64_t ost[3] = {strides[0], strides[1], strides[2]};
    check(kernels().attention_coded(qp, B, Hq, T, hd, qst, kp, vp, f16 ? 1 : 0, Hkv, kst, vst, R, table, max_blocks,
                                    lens, pos, scale, op, ost, threads, &kc, coded, &vc, coded + B),
          "CodedAttention");
  });
}

mx::array attention_coded(const mx::array& q, const mx::array& k, const mx::array& v, float scale, int threads,
                          const mx::array& k_codes, std::vector<int64_t> k_layout, const mx::array& v_codes,
                          std::vector<int64_t> v_layout, const mx::array& coded, const mx::array& kv_len,
                          const mx::array& q_pos, const std::optional<mx::array>& table) {
  need(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "attention_coded: q, k and v must be 4-D");
  need(k.shape() == v.shape(), "attention_coded: k and v differ in shape " + shape_str(k.shape()) + " vs " +
                                   shape_str(v.shape()));
  need(q.shape(3) == k.shape(3) && k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0 && k.shape(0) == q.shape(0),
       "attention_coded: q " + shape_str(q.shape()) + " does not fit k " + shape_str(k.shape()));
  need(k.dtype() == v.dtype() && (k.dtype() == mx::float32 || k.dtype() == mx::float16),
       "attention_coded: keys and values must both be float32 or float16");
  need(k_codes.dtype() == mx::uint8 && v_codes.dtype() == mx::uint8, "attention_coded: codes must be uint8 buffers");
  for (const auto* l : {&k_layout, &v_layout})
    need(l->size() == MF_KV_CODES_INTS,
         "attention_coded: a layout is " + std::to_string(MF_KV_CODES_INTS) + " ints (got " + std::to_string(l->size()) +
             ")");
  need(coded.ndim() == 2 && coded.shape(0) == 2 && coded.shape(1) == q.shape(0),
       "attention_coded: coded must be [2, B] (keys' and values' counts per row)");
  need(kv_len.size() == static_cast<size_t>(q.shape(0)) && q_pos.size() == static_cast<size_t>(q.shape(0)),
       "attention_coded: kv_len and q_pos need one value per row");
  auto s = cpu_stream();
  auto i32 = [&](const mx::array& a) { return mx::contiguous(mx::astype(a, mx::int32, s), false, s); };
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, s),
                                k,
                                v,
                                mx::contiguous(k_codes, false, s),
                                mx::contiguous(v_codes, false, s),
                                i32(coded),
                                i32(kv_len),
                                i32(q_pos)};
  if (table) inputs.push_back(i32(*table));
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<CodedAttention>(s, scale, threads, std::move(k_layout), std::move(v_layout),
                                                    table.has_value()),
                   std::move(inputs));
}

std::vector<mx::Shape> MixedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool MixedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const MixedAttention&>(other);
  return scale_ == o.scale_ && threads_ == o.threads_ && layouts_ == o.layouts_;
}

void MixedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &codes = inputs[3], &table = inputs[6];
  mx::array& out = outputs[0];
  const int64_t B = q.shape(0), Hq = q.shape(1), T = q.shape(2), hd = q.shape(3), Hkv = k.shape(1);
  const int64_t block_tokens = k.shape(2), max_blocks = table.shape(1);
  const mx::Strides strides = attention_output(q, k, v, out, "MixedAttention");
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  const int n = static_cast<int>(layouts_.size() / (2 * MF_KV_CODES_INTS));
  std::vector<mf_kv_codes> kc(n), vc(n);
  for (int c = 0; c < n; c++) {
    kv_codes_from(layouts_.data() + 2 * c * MF_KV_CODES_INTS, MF_KV_CODES_INTS, codes.data<uint8_t>(), codes.nbytes(),
                  &kc[c]);
    kv_codes_from(layouts_.data() + (2 * c + 1) * MF_KV_CODES_INTS, MF_KV_CODES_INTS, codes.data<uint8_t>(),
                  codes.nbytes(), &vc[c]);
  }
  record("MixedAttention", codes.data<uint8_t>());
  const mx::Strides &qs = q.strides(), &ks = k.strides(), &vs = v.strides();
  enc.dispatch([=, qp = q.data<float>(), kp = k.data<void>(), vp = v.data<void>(), op = out.data<float>(),
                lens = inputs[4].data<int32_t>(), pos = inputs[5].data<int32_t>(), tp = table.data<int32_t>(),
                cp = inputs[7].data<int32_t>(), f16 = k.dtype() == mx::float16, scale = scale_,
                threads = threads_]() {
    const int64_t qst[3] = {qs[0], qs[1], qs[2]}, kst[3] = {ks[0], ks[1], ks[2]}, vst[3] = {vs[0], vs[1], vs[2]};
    const int64_t ost[3] = {strides[0], strides[1], strides[2]};
    check(kernels().attention_mixed(qp, B, Hq, T, hd, qst, kp, vp, f16 ? 1 : 0, Hkv, kst, vst, tp, cp, max_blocks,
                                    block_tokens, lens, pos, scale, op, ost, threads, n, kc.data(), vc.data()),
          "MixedAttention");
  });
}

mx::array attention_mixed(const mx::array& q, const mx::array& k, const mx::array& v, float scale, int threads,
                          const mx::array& codes, std::vector<int64_t> layouts, const mx::array& kv_len,
                          const mx::array& q_pos, const mx::array& table, const mx::array& classes) {
  need(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "attention_mixed: q, k and v must be 4-D");
  need(k.shape() == v.shape(), "attention_mixed: k and v differ in shape " + shape_str(k.shape()) + " vs " +
                                   shape_str(v.shape()));
  need(q.shape(3) == k.shape(3) && k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0,
       "attention_mixed: q " + shape_str(q.shape()) + " does not fit k " + shape_str(k.shape()));
  need(k.dtype() == v.dtype() && (k.dtype() == mx::float32 || k.dtype() == mx::float16),
       "attention_mixed: keys and values must both be float32 or float16");
  need(codes.dtype() == mx::uint8, "attention_mixed: codes must be a uint8 buffer");
  need(layouts.size() % (2 * MF_KV_CODES_INTS) == 0,
       "attention_mixed: layouts are a keys' and a values' layout of " + std::to_string(MF_KV_CODES_INTS) +
           " ints per class (got " + std::to_string(layouts.size()) + " ints)");
  need(table.ndim() == 2 && table.shape(0) == q.shape(0) && classes.shape() == table.shape(),
       "attention_mixed: table and classes must both be [B, max_blocks]");
  need(kv_len.size() == static_cast<size_t>(q.shape(0)) && q_pos.size() == static_cast<size_t>(q.shape(0)),
       "attention_mixed: kv_len and q_pos need one value per row");
  auto s = cpu_stream();
  auto i32 = [&](const mx::array& a) { return mx::contiguous(mx::astype(a, mx::int32, s), false, s); };
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, s), k, v, mx::contiguous(codes, false, s),
                                i32(kv_len), i32(q_pos), i32(table), i32(classes)};
  return mx::array(q.shape(), mx::float32, std::make_shared<MixedAttention>(s, scale, threads, std::move(layouts)),
                   std::move(inputs));
}

// ---- Fence, AwaitFence ------------------------------------------------------------------------------

void Fence::signal(int64_t value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (value > value_) value_ = value;
  }
  cv_.notify_all();
}

bool Fence::wait(int64_t value) {
  std::unique_lock<std::mutex> lock(mu_);
  if (value_ >= value || cancelled_) return !cancelled_;
  const auto t0 = std::chrono::steady_clock::now();
  cv_.wait(lock, [&] { return value_ >= value || cancelled_; });
  blocked_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return !cancelled_;
}

void Fence::cancel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
  }
  cv_.notify_all();
}

int64_t Fence::value() {
  std::lock_guard<std::mutex> lock(mu_);
  return value_;
}

double Fence::blocked_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  return blocked_;
}

void AwaitFence::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  outputs[0].copy_shared_buffer(inputs[0]);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_input_array(inputs[1]);
  enc.set_output_array(outputs[0]);
  enc.dispatch([ready = ready_, value = value_, release = release_, release_value = release_value_]() {
    if (release && release_value >= 0) release->signal(release_value);
    ready->wait(value);  // cancelled: the engine is closing, and nothing reads the result
  });
}

mx::array await_fence(const mx::array& buffer, const mx::array& dep, std::shared_ptr<Fence> ready, int64_t value,
                      std::shared_ptr<Fence> release, int64_t release_value) {
  need(ready != nullptr, "await_fence: a ready fence is required");
  auto s = cpu_stream();
  return mx::array(buffer.shape(), buffer.dtype(),
                   std::make_shared<AwaitFence>(s, std::move(ready), value, std::move(release), release_value),
                   {buffer, dep});
}

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

// ---- wrap ----------------------------------------------------------------------------------------

mx::array wrap(uintptr_t address, int64_t nbytes) {
  need(address != 0 && nbytes >= 0 && nbytes < (int64_t{1} << 31), "wrap: a non-null address and < 2 GiB");
  mx::allocator::Buffer handle(reinterpret_cast<size_t*>(address) - 1);
  mx::array a(mx::allocator::Data(handle, [](mx::allocator::Buffer) {}), {static_cast<int>(nbytes)}, mx::uint8);
  if (a.data<uint8_t>() != reinterpret_cast<uint8_t*>(address))
    throw std::runtime_error("wrap: this MLX build does not keep CPU buffers as this extension expects");
  return a;
}

// ---- Empty ---------------------------------------------------------------------------------------

void Empty::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  const size_t n = out.nbytes();
  auto data = mx::allocator::malloc(n + align_);
  const auto start = reinterpret_cast<uintptr_t>(data.buffer().raw_ptr());
  const int64_t offset = static_cast<int64_t>((align_ - start % align_) % align_);
  mx::array::Flags flags;
  flags.contiguous = flags.row_contiguous = true;
  flags.col_contiguous = out.ndim() == 1;
  out.set_data(std::move(data), n, out.ndim() == 1 ? mx::Strides{1} : mx::Strides{out.shape(1), 1}, flags, offset);
}

mx::array empty(int64_t nbytes, int64_t align) {
  need(nbytes >= 0 && align >= 1, "empty: nbytes must be >= 0 and align >= 1");
  auto s = cpu_stream();
  // MLX shapes are 32-bit: a buffer past 1 GiB is rows of 4 KiB (rounded up; callers view n bytes).
  mx::Shape shape{static_cast<int>(nbytes)};
  if (nbytes > (int64_t{1} << 30)) shape = {static_cast<int>((nbytes + 4095) / 4096), 4096};
  return mx::array(shape, mx::uint8, std::make_shared<Empty>(s, align), {});
}

}  // namespace mlx_flash
