// Attention as MLX primitives (kernels/cpu/attention.cpp): Attention over float keys and values (one
// buffer per row, or a pool's blocks through a slot table), CodedAttention over compressed KV
// (mf_attention_coded) and MixedAttention over a pool's chunks of mixed widths (mf_attention_mixed).
// Each reads the KV where its cache keeps it, and lays its output out as the output projection reads it.
#include "primitives.h"

#include "primitives_common.h"

namespace mlx_flash {

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

}  // namespace mlx_flash
