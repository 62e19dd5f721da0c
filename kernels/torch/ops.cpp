// The CPU kernels as torch operators (TORCH_LIBRARY namespace mlx_flash): the same functions the MLX
// primitives call (kernels/cpu/*.cpp, looked up in the library Python loaded), over tensors torch
// allocated or shares with numpy. Each operator checks its tensors (device, dtype, contiguity, sizes)
// and raises one line naming what is wrong; weights arrive as a uint8 buffer tensor and byte offsets,
// read where the read put them. Fake implementations (for torch.compile) are registered from Python
// (mlx_flash/kernels/torch_ops.py). Built at first use into the cache.
#include <torch/library.h>
// The tensor and the two factories these operators use, not <ATen/ATen.h>: the compiler reads a third
// of the lines (the build at first use took 23 s with ATen.h, 14 s without, on one core).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check_text.h"
#include "kernel_table.h"  // (kernels/cpu/, copied beside this file for the build)
#include "moe_table.h"

namespace {

mlx_flash::KernelLibrary& kernels() {
  static mlx_flash::KernelLibrary k;
  return k;
}

const mlx_flash::KernelLibrary& loaded() {
  TORCH_CHECK(kernels().qmatmul != nullptr, "mlx_flash operators: the CPU kernel library is not loaded");
  return kernels();
}

void use_kernel_library(const std::string& path) {
  try {
    kernels() = mlx_flash::kernel_table(path);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

void done(int64_t rc, const char* what) {
  TORCH_CHECK(rc >= 0, what, ": the CPU kernel refused its arguments (code ", mf::text(rc), ")");
}

void cpu_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU (these operators are the CPU kernels)");
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, " must be float32 (got ", t.scalar_type(), ")");
}

void buffer_ok(const at::Tensor& buf, int64_t end) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "the weights buffer must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(end <= buf.numel(), "the weights lie past their buffer (", mf::text(end), " > ", mf::text(buf.numel()),
              " bytes)");
}

const int32_t* ids_ptr(const c10::optional<at::Tensor>& ids) {
  if (!ids) return nullptr;
  TORCH_CHECK(ids->scalar_type() == at::kInt && ids->is_contiguous() && ids->device().is_cpu(),
              "ids must be a contiguous int32 CPU tensor");
  return ids->data_ptr<int32_t>();
}

at::Tensor stored_matmul(const at::Tensor& x, const at::Tensor& buffer, int64_t kind, int64_t w_off, int64_t s_off,
                         int64_t b_off, int64_t scale_type, int64_t bits, int64_t group, int64_t n_out,
                         bool transposed, at::IntArrayRef layout, int64_t threads, const c10::optional<at::Tensor>& ids,
                         int64_t listed, int64_t arith) {
  cpu_float(x, "x");
  buffer_ok(buffer, std::max({w_off, s_off, b_off}));
  TORCH_CHECK(layout.empty() || layout.size() == (kind == 0 ? 7u : 4u), "a layout is 7 ints (affine) or 4 (blocks)");
  TORCH_CHECK((listed != 0) == ids.has_value(), "ids go with a listed axis (rows or groups)");
  const at::Tensor xc = x.contiguous();
  const int64_t K = xc.size(-1), T = K ? xc.numel() / K : 0;
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = n_out;
  at::Tensor y = at::empty(shape, xc.options());
  const uint8_t* base = buffer.data_ptr<uint8_t>();
  const int32_t* ip = ids_ptr(ids);
  const int64_t* lay = layout.empty() ? nullptr : layout.data();
  if (kind == 0) {
    done(loaded().qmatmul(xc.data_ptr<float>(), T, K, reinterpret_cast<const uint32_t*>(base + w_off), base + s_off,
                          base + b_off, (int)scale_type, n_out, (int)bits, (int)group, transposed ? 1 : 0,
                          y.data_ptr<float>(), (int)threads, lay, listed == 1 ? ip : nullptr,
                          listed == 2 ? ip : nullptr, (int)arith),
         "stored_matmul");
  } else {
    done(loaded().blockmatmul(xc.data_ptr<float>(), T, K, base + w_off, (int)kind, n_out, y.data_ptr<float>(),
                              (int)threads, lay, listed == 1 ? ip : nullptr, listed == 2 ? ip : nullptr, (int)arith),
         "stored_matmul");
  }
  return y;
}

at::Tensor stored_rows(const at::Tensor& ids, const at::Tensor& buffer, int64_t kind, int64_t w_off, int64_t s_off,
                       int64_t b_off, int64_t scale_type, int64_t bits, int64_t group, int64_t rows, int64_t k,
                       int64_t row_bytes, int64_t scale_row_bytes) {
  buffer_ok(buffer, std::max({w_off, s_off, b_off}));
  const at::Tensor i32 = ids.to(at::kInt).contiguous();
  std::vector<int64_t> shape(i32.sizes().begin(), i32.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* base = buffer.data_ptr<uint8_t>();
  done(loaded().rows(i32.data_ptr<int32_t>(), i32.numel(), rows, base + w_off, base + s_off, base + b_off, (int)kind,
                     (int)bits, (int)group, (int)scale_type, k, row_bytes, scale_row_bytes, out.data_ptr<float>()),
       "stored_rows");
  return out;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t threads,
                     const c10::optional<at::Tensor>& kv_len, const c10::optional<at::Tensor>& q_pos,
                     const c10::optional<at::Tensor>& table, int64_t window) {
  cpu_float(q, "q");
  TORCH_CHECK(window >= 0, "attention: window must be 0 (every key) or a positive number of keys");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
              "attention: q, k, v must be 4-D, k and v of one shape");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf),
              "attention: keys and values must both be float32 or float16");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(3) == hd && Hkv > 0 && Hq % Hkv == 0, "attention: q does not fit k");
  TORCH_CHECK(kv_len.has_value() == q_pos.has_value(), "attention: kv_len and q_pos go together");
  TORCH_CHECK(!table || kv_len, "attention: a slot table needs kv_len and q_pos");
  for (const at::Tensor* a : {&q, &k, &v})
    TORCH_CHECK(a->stride(3) == 1 || a->size(3) == 1, "attention: the head dimension must be contiguous");
  std::vector<int32_t> lens, pos;
  const int32_t *lp, *pp;
  if (kv_len) {
    lp = ids_ptr(kv_len);
    pp = ids_ptr(q_pos);
    TORCH_CHECK(kv_len->numel() == B && q_pos->numel() == B, "attention: kv_len and q_pos need one value per row");
  } else {
    TORCH_CHECK(k.size(0) == B && S >= T, "attention: rows or keys do not fit the queries");
    lens.assign(B, (int32_t)S);
    pos.assign(B, (int32_t)(S - T));
    lp = lens.data();
    pp = pos.data();
  }
  // [B, Hq, T, hd] laid out as [B, T, Hq, hd]: what the output projection reads after transposing.
  at::Tensor out = at::empty({B, T, Hq, hd}, q.options()).transpose(1, 2);
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)}, os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  const int32_t* tp = ids_ptr(table);
  done(loaded().attention(q.data_ptr<float>(), B, Hq, T, hd, qs, k.data_ptr(), v.data_ptr(),
                          k.scalar_type() == at::kHalf ? 1 : 0, Hkv, ks, vs, tp, table ? table->size(1) : 0,
                          table ? S : 0, lp, pp, (float)scale, out.data_ptr<float>(), os, (int)threads, window),
       "attention");
  return out;
}

// A compressed-KV layout over a uint8 buffer tensor (kv_codes.h); one line naming what is wrong.
mf_kv_codes kv_codes(const at::Tensor& buffer, at::IntArrayRef layout, const char* what) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.scalar_type() == at::kByte && buffer.is_contiguous(), "attention_coded: ",
              what, " codes must be a contiguous uint8 CPU tensor");
  mf_kv_codes c;
  TORCH_CHECK(mlx_flash::kv_codes_from(layout.data(), layout.size(), buffer.data_ptr<uint8_t>(), buffer.numel(), &c),
              "attention_coded: a ", what, " layout is ", mf::text(MF_KV_CODES_INTS), " ints (got ",
              mf::text(layout.size()), ")");
  return c;
}

// Attention over compressed KV (kernels/cpu/attention.cpp mf_attention_coded): k, v [B, Hkv, R, hd]
// float residuals after each row's coded keys and values; coded int32 [2, B] (keys, values).
at::Tensor attention_coded(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t threads,
                           const at::Tensor& k_codes, at::IntArrayRef k_layout, const at::Tensor& v_codes,
                           at::IntArrayRef v_layout, const at::Tensor& coded, const at::Tensor& kv_len,
                           const at::Tensor& q_pos, const c10::optional<at::Tensor>& table) {
  cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
              "attention_coded: q, k, v must be 4-D, k and v of one shape");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf),
              "attention_coded: keys and values must both be float32 or float16");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), hd = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.size(3) == hd && Hkv > 0 && Hq % Hkv == 0 && k.size(0) == B, "attention_coded: q does not fit k");
  for (const at::Tensor* a : {&q, &k, &v})
    TORCH_CHECK(a->stride(3) == 1 || a->size(3) == 1, "attention_coded: the head dimension must be contiguous");
  TORCH_CHECK(coded.dim() == 2 && coded.size(0) == 2 && coded.size(1) == B,
              "attention_coded: coded must be [2, B] (keys' and values' counts per row)");
  TORCH_CHECK(kv_len.numel() == B && q_pos.numel() == B, "attention_coded: kv_len and q_pos need one value per row");
  const mf_kv_codes kc = kv_codes(k_codes, k_layout, "key"), vc = kv_codes(v_codes, v_layout, "value");
  const int32_t* counts = ids_ptr(coded);
  at::Tensor out = at::empty({B, T, Hq, hd}, q.options()).transpose(1, 2);
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)}, os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  done(loaded().attention_coded(q.data_ptr<float>(), B, Hq, T, hd, qs, k.data_ptr(), v.data_ptr(),
                                k.scalar_type() == at::kHalf ? 1 : 0, Hkv, ks, vs, k.size(2), ids_ptr(table),
                                table ? table->size(1) : 0, ids_ptr(kv_len), ids_ptr(q_pos), (float)scale,
                                out.data_ptr<float>(), os, (int)threads, &kc, counts, &vc, counts + B),
       "attention_coded");
  return out;
}

// Attention over a pool's chunks of mixed widths (kernels/cpu/attention.cpp mf_attention_mixed): k, v
// the float pool as blocks [slots, Hkv, block_tokens, hd]; codes the coded chunks' uint8 buffer and
// `layouts` each class's keys' then values' layout over it; table and classes int32 [B, max_blocks].
at::Tensor attention_mixed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t threads,
                           const at::Tensor& codes, at::IntArrayRef layouts, const at::Tensor& kv_len,
                           const at::Tensor& q_pos, const at::Tensor& table, const at::Tensor& classes) {
  cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
              "attention_mixed: q, k, v must be 4-D, k and v of one shape");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf),
              "attention_mixed: keys and values must both be float32 or float16");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), hd = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.size(3) == hd && Hkv > 0 && Hq % Hkv == 0, "attention_mixed: q does not fit k");
  for (const at::Tensor* a : {&q, &k, &v})
    TORCH_CHECK(a->stride(3) == 1 || a->size(3) == 1, "attention_mixed: the head dimension must be contiguous");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && classes.sizes() == table.sizes(),
              "attention_mixed: table and classes must both be [B, max_blocks]");
  TORCH_CHECK(kv_len.numel() == B && q_pos.numel() == B, "attention_mixed: kv_len and q_pos need one value per row");
  TORCH_CHECK(layouts.size() % (2 * MF_KV_CODES_INTS) == 0, "attention_mixed: layouts are a keys' and a values' layout of ",
              mf::text(MF_KV_CODES_INTS), " ints per class (got ", mf::text(layouts.size()), " ints)");
  const int n = static_cast<int>(layouts.size() / (2 * MF_KV_CODES_INTS));
  std::vector<mf_kv_codes> kc(n), vc(n);
  for (int c = 0; c < n; c++) {
    kc[c] = kv_codes(codes, layouts.slice(2 * c * MF_KV_CODES_INTS, MF_KV_CODES_INTS), "key");
    vc[c] = kv_codes(codes, layouts.slice((2 * c + 1) * MF_KV_CODES_INTS, MF_KV_CODES_INTS), "value");
  }
  at::Tensor out = at::empty({B, T, Hq, hd}, q.options()).transpose(1, 2);
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)}, os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  done(loaded().attention_mixed(q.data_ptr<float>(), B, Hq, T, hd, qs, k.data_ptr(), v.data_ptr(),
                                k.scalar_type() == at::kHalf ? 1 : 0, Hkv, ks, vs, ids_ptr(table), ids_ptr(classes),
                                table.size(1), k.size(2), ids_ptr(kv_len), ids_ptr(q_pos), (float)scale,
                                out.data_ptr<float>(), os, (int)threads, n, kc.data(), vc.data()),
       "attention_mixed");
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  cpu_float(x, "x");
  cpu_float(w, "w");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: w must be [D] for x [.., D]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t D = xc.size(-1);
  done(loaded().rms_norm(xc.data_ptr<float>(), wc.data_ptr<float>(), (float)eps, D ? xc.numel() / D : 0, D,
                         y.data_ptr<float>()),
       "rms_norm");
  return y;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& inv_freq, const at::Tensor& pos, int64_t dims,
                bool traditional, double scale) {
  cpu_float(x, "x");
  cpu_float(inv_freq, "inv_freq");
  TORCH_CHECK(x.dim() == 4 && (x.stride(3) == 1 || x.size(3) == 1), "rope: x must be [B, H, T, hd], hd contiguous");
  TORCH_CHECK(inv_freq.numel() == dims / 2 && pos.numel() == x.size(0), "rope: inv_freq [dims / 2] and pos [B]");
  const at::Tensor fc = inv_freq.contiguous(), pc = pos.to(at::kInt).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t xs[3] = {x.stride(0), x.stride(1), x.stride(2)};
  done(loaded().rope(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.size(3), xs, fc.data_ptr<float>(), dims,
                     traditional ? 1 : 0, pc.data_ptr<int32_t>(), (float)scale, y.data_ptr<float>()),
       "rope");
  return y;
}

// A stored matrix from its operator arguments: [kind, w_off, s_off, b_off, scale_type, bits, group, n_out,
// transposed, arith, layout...] (torch_ops.TorchMatrix.spec), its parts found in `buffer`.
mf_matrix matrix_of(const at::Tensor& buffer, at::IntArrayRef spec, const char* what) {
  TORCH_CHECK(spec.size() == 10 || spec.size() == (spec[0] == 0 ? 17u : 14u),
              what, ": a matrix is 10 ints and its layout (7 affine, 4 blocks)");
  buffer_ok(buffer, std::max({spec[1], spec[2], spec[3]}));
  const uint8_t* base = buffer.data_ptr<uint8_t>();
  return mf_matrix{(int)spec[0], base + spec[1], base + spec[2], base + spec[3], (int)spec[4], (int)spec[5],
                   (int)spec[6], spec[7], (int)spec[8], spec.size() > 10 ? spec.data() + 10 : nullptr, nullptr, nullptr,
                   (int)spec[9]};
}

// A sparse product's ids on a matrix: listed 1 names rows (or blocks of rows), 2 groups, 0 none.
void list_on(mf_matrix& m, int64_t listed, const int32_t* ids) {
  TORCH_CHECK(listed >= 0 && listed <= 2, "gated_ffn: listed is 0 (none), 1 (rows) or 2 (groups)");
  TORCH_CHECK(listed == 0 || ids != nullptr, "gated_ffn: a listed matrix needs ids");
  m.row_ids = listed == 1 ? ids : nullptr;
  m.group_ids = listed == 2 ? ids : nullptr;
}

// up empty: gate holds gate|up (2F outputs, gate first); else gate and up hold F each.
at::Tensor gated_ffn(const at::Tensor& x, const at::Tensor& gate_buffer, at::IntArrayRef gate,
                     const at::Tensor& up_buffer, at::IntArrayRef up, const at::Tensor& down_buffer,
                     at::IntArrayRef down, int64_t threads, const c10::optional<at::Tensor>& ids,
                     at::IntArrayRef listed) {
  cpu_float(x, "x");
  mf_matrix g = matrix_of(gate_buffer, gate, "gated_ffn gate"), dn = matrix_of(down_buffer, down, "gated_ffn down");
  mf_matrix u = up.empty() ? mf_matrix{} : matrix_of(up_buffer, up, "gated_ffn up");
  TORCH_CHECK(listed.empty() || listed.size() == 3, "gated_ffn: listed is empty (dense) or one value per matrix");
  if (!listed.empty()) {  // a sparse layer: each matrix's listed units (ids checked by the caller to lie in range)
    const int32_t* ip = ids_ptr(ids);
    list_on(g, listed[0], ip);
    list_on(u, listed[1], ip);
    list_on(dn, listed[2], ip);
  }
  TORCH_CHECK(up.empty() ? g.n_out % 2 == 0 : u.n_out == g.n_out,
              "gated_ffn: gate and up differ in outputs, or gate|up has an odd number (", g.n_out, ")");
  const at::Tensor xc = x.contiguous();
  const int64_t K = xc.size(-1), T = K ? xc.numel() / K : 0;
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = dn.n_out;
  at::Tensor y = at::empty(shape, xc.options());
  // torch's memory for the activations: what its allocator counts
  at::Tensor hidden = at::empty({T, up.empty() ? g.n_out : 2 * g.n_out}, xc.options());
  done(loaded().gated_ffn(xc.data_ptr<float>(), T, K, &g, up.empty() ? nullptr : &u, &dn, hidden.data_ptr<float>(),
                          y.data_ptr<float>(), (int)threads),
       "gated_ffn");
  return y;
}

// A MoE layer's routed experts in one call (kernels/cpu/moe_experts.cpp): sum + each routed expert's
// gated FFN of its tokens times their weights, experts ascending. `table` lists every expert of the
// layer: 0 (not in this call) or 1 followed by its gate, up and down, each [buffer index (-1: none,
// i.e. no up when gate holds gate|up), n, the matrix in n ints as gated_ffn takes it], its buffer among
// `buffers`.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& sum,
                       at::TensorList buffers, at::IntArrayRef table, int64_t threads) {
  cpu_float(x, "x");
  cpu_float(weights, "weights");
  cpu_float(sum, "the sum so far");
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "moe_experts: x [N, D], ids and weights [N, K]");
  TORCH_CHECK(sum.dim() == 2 && sum.size(0) == x.size(0), "moe_experts: the sum so far is [N, Dout]");
  const int64_t N = x.size(0), D = x.size(1), K = ids.size(1), Dout = sum.size(1);
  const std::vector<mf::TableExpert> table_experts = mf::read_moe_table(table, buffers.size());
  std::vector<mf_matrix> mats(3 * table_experts.size());  // 3 per expert: gate, up, down
  std::vector<char> has(mats.size(), 0);                  // which of them the expert has
  int64_t f_max = 0;
  for (size_t i = 0; i < table_experts.size(); i++) {
    const mf::TableExpert& te = table_experts[i];
    if (!te.present) continue;
    const size_t e = 3 * i;
    static const char* names[3] = {"gate", "up", "down"};
    const mf::TableMatrix* parts[3] = {&te.gate, &te.up, &te.down};
    for (int m = 0; m < 3; m++) {
      if (parts[m]->buffer < 0) continue;
      mats[e + m] = matrix_of(buffers[parts[m]->buffer], parts[m]->spec, names[m]);
      has[e + m] = 1;
    }
    const mf_matrix &g = mats[e], &u = mats[e + 1], &dn = mats[e + 2];
    TORCH_CHECK(has[e] && has[e + 2] && dn.n_out == Dout,
                "moe_experts: an expert needs gate and down giving the sum's width");
    TORCH_CHECK(has[e + 1] ? u.n_out == g.n_out : g.n_out % 2 == 0,
                "moe_experts: gate and up differ in outputs, or gate|up has an odd number");
    f_max = std::max(f_max, has[e + 1] ? g.n_out : g.n_out / 2);
  }
  std::vector<const mf_matrix*> ptrs(mats.size(), nullptr);
  for (size_t i = 0; i < mats.size(); i++)
    if (has[i]) ptrs[i] = &mats[i];
  const int64_t E = (int64_t)ptrs.size() / 3;
  TORCH_CHECK(E > 0, "moe_experts: no experts");
  const at::Tensor xc = x.contiguous(), ic = ids.to(at::kInt).contiguous(), wc = weights.contiguous();
  at::Tensor y = sum.contiguous().clone();
  at::Tensor scratch = at::empty({std::max<int64_t>(N * (D + 2 * f_max + Dout), 1)}, xc.options());
  done(loaded().moe_experts(xc.data_ptr<float>(), N, D, ic.data_ptr<int32_t>(), wc.data_ptr<float>(), K, E, ptrs.data(),
                            Dout, scratch.data_ptr<float>(), y.data_ptr<float>(), (int)threads),
       "moe_experts");
  return y;
}

// A channel-major matrix (kernels/cpu/channel_major.cpp) from its operator arguments: its layout in
// `buffer` from byte spec[0], spec[1:] = n_out, k_in, bits, group, scale_type
// (torch_ops.TorchChannelMajor.spec); one line naming what is wrong.
mf_cm_matrix cm_of(const at::Tensor& buffer, at::IntArrayRef spec, const char* what) {
  TORCH_CHECK(spec.size() == 6, what, ": a channel-major matrix is 6 ints (offset, n_out, k_in, bits, group, "
              "scale_type), got ", mf::text(spec.size()));
  const int64_t size = loaded().cm_bytes(spec[1], spec[2], (int)spec[3], (int)spec[4], (int)spec[5]);
  TORCH_CHECK(size >= 0, what, ": the channel-major layout refuses this matrix (code ", mf::text(size),
              "): bits 2, 4 or 8, groups of 32 .. 256 dividing K, scale type 0, 1 or 2");
  TORCH_CHECK(spec[0] >= 0, what, ": the offset must not be negative");
  buffer_ok(buffer, spec[0] + size);
  return mf_cm_matrix{buffer.data_ptr<uint8_t>() + spec[0], spec[1], spec[2], (int)spec[3], (int)spec[4], (int)spec[5]};
}

int64_t* counters_of(const c10::optional<at::Tensor>& counters, const char* what) {
  if (!counters) return nullptr;
  TORCH_CHECK(counters->device().is_cpu() && counters->scalar_type() == at::kLong && counters->is_contiguous() &&
                  counters->numel() == 3,
              what, ": counters must be a contiguous int64 CPU tensor of 3 values");
  return counters->data_ptr<int64_t>();
}

// x [.., K] as float32 rows: the contiguous tensor and its row count, K checked.
at::Tensor rows_of(const at::Tensor& x, int64_t k_in, const char* what, int64_t* T) {
  cpu_float(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k_in, what, ": x must be [.., ", mf::text(k_in), "] (its last axis is ",
              mf::text(x.dim() ? x.size(-1) : 0), ")");
  at::Tensor xc = x.contiguous();
  *T = k_in ? xc.numel() / k_in : 0;
  return xc;
}

at::Tensor empty_rows(const at::Tensor& xc, int64_t n) {
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = n;
  return at::empty(shape, xc.options());
}

// x [.., K] times a channel-major matrix: a row's channels with |x| <= threshold count as zero
// (threshold < 0: none do). counters (int64 [3]: rows, active channels, active groups) are added to
// in place when given.
at::Tensor cm_matmul(const at::Tensor& x, const at::Tensor& buffer, at::IntArrayRef spec, double threshold,
                     int64_t threads, const c10::optional<at::Tensor>& counters) {
  const mf_cm_matrix m = cm_of(buffer, spec, "cm_matmul");
  TORCH_CHECK(!std::isnan(threshold), "cm_matmul: the threshold must be a number (got NaN)");
  int64_t* cp = counters_of(counters, "cm_matmul");
  int64_t T;
  const at::Tensor xc = rows_of(x, m.k_in, "cm_matmul", &T);
  at::Tensor y = empty_rows(xc, m.n_out);
  done(loaded().cm_matmul(m.w, m.n_out, m.k_in, m.bits, m.group, m.scale_type, xc.data_ptr<float>(), T,
                          (float)threshold, y.data_ptr<float>(), (int)threads, cp),
       "cm_matmul");
  return y;
}

// down(act(gate) * up) of x [.., K] over channel-major matrices (kernels/cpu/channel_major_ffn.cpp):
// up empty: gate holds gate|up (2F outputs, gate first); else gate and up hold F each. act 0 silu, 1
// gelu (tanh). Each matrix's counters are added to when given.
at::Tensor cm_gated_ffn(const at::Tensor& x, const at::Tensor& gate_buffer, at::IntArrayRef gate,
                        const at::Tensor& up_buffer, at::IntArrayRef up, const at::Tensor& down_buffer,
                        at::IntArrayRef down, double t_gu, double t_down, int64_t act, int64_t threads,
                        const c10::optional<at::Tensor>& gate_counters, const c10::optional<at::Tensor>& up_counters,
                        const c10::optional<at::Tensor>& down_counters) {
  const mf_cm_matrix g = cm_of(gate_buffer, gate, "cm_gated_ffn gate"), dn = cm_of(down_buffer, down, "cm_gated_ffn down");
  const mf_cm_matrix u = up.empty() ? mf_cm_matrix{} : cm_of(up_buffer, up, "cm_gated_ffn up");
  TORCH_CHECK(up.empty() ? g.n_out % 2 == 0 : (u.n_out == g.n_out && u.k_in == g.k_in),
              "cm_gated_ffn: gate and up differ in shape, or gate|up has an odd number of outputs (",
              mf::text(g.n_out), ")");
  const int64_t F = up.empty() ? g.n_out / 2 : g.n_out;
  TORCH_CHECK(dn.k_in == F, "cm_gated_ffn: down takes ", mf::text(dn.k_in), " inputs, the activations are ",
              mf::text(F));
  TORCH_CHECK(!std::isnan(t_gu) && !std::isnan(t_down), "cm_gated_ffn: the thresholds must be numbers (got NaN)");
  TORCH_CHECK(act == 0 || act == 1, "cm_gated_ffn: act is 0 (silu) or 1 (gelu, tanh approximation)");
  int64_t *gc = counters_of(gate_counters, "cm_gated_ffn gate"), *dc = counters_of(down_counters, "cm_gated_ffn down");
  int64_t* uc = counters_of(up_counters, "cm_gated_ffn up");
  int64_t T;
  const at::Tensor xc = rows_of(x, g.k_in, "cm_gated_ffn", &T);
  at::Tensor y = empty_rows(xc, dn.n_out);
  // torch's memory for the activations: what its allocator counts
  at::Tensor hidden = at::empty({std::max<int64_t>(2 * T * F, 1)}, xc.options());
  done(loaded().cm_gated_ffn(xc.data_ptr<float>(), T, &g, up.empty() ? nullptr : &u, &dn, (float)t_gu, (float)t_down,
                             (int)act, hidden.data_ptr<float>(), y.data_ptr<float>(), (int)threads, gc, uc, dc),
       "cm_gated_ffn");
  return y;
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  cpu_float(g, "g");
  cpu_float(u, "u");
  TORCH_CHECK(g.sizes() == u.sizes(), "silu_mul: g and u differ in shape");
  const at::Tensor gc = g.contiguous(), uc = u.contiguous();
  at::Tensor y = at::empty_like(gc);
  done(loaded().silu_mul(gc.data_ptr<float>(), uc.data_ptr<float>(), gc.numel(), y.data_ptr<float>()), "silu_mul");
  return y;
}

}  // namespace

TORCH_LIBRARY(mlx_flash, m) {
  m.def("use_kernel_library(str path) -> ()", &use_kernel_library);
  m.def("stored_matmul(Tensor x, Tensor buffer, int kind, int w_off, int s_off, int b_off, int scale_type, int bits, "
        "int group, int n_out, bool transposed, int[] layout, int threads, Tensor? ids=None, int listed=0, int arith=0) "
        "-> Tensor");
  m.def("stored_rows(Tensor ids, Tensor buffer, int kind, int w_off, int s_off, int b_off, int scale_type, int bits, "
        "int group, int rows, int k, int row_bytes, int scale_row_bytes) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, float scale, int threads, Tensor? kv_len=None, Tensor? q_pos=None, "
        "Tensor? table=None, int window=0) -> Tensor");
  m.def("attention_coded(Tensor q, Tensor k, Tensor v, float scale, int threads, Tensor k_codes, int[] k_layout, "
        "Tensor v_codes, int[] v_layout, Tensor coded, Tensor kv_len, Tensor q_pos, Tensor? table=None) -> Tensor");
  m.def("attention_mixed(Tensor q, Tensor k, Tensor v, float scale, int threads, Tensor codes, int[] layouts, "
        "Tensor kv_len, Tensor q_pos, Tensor table, Tensor classes) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor inv_freq, Tensor pos, int dims, bool traditional, float scale) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor sum, Tensor[] buffers, int[] table, int threads) "
        "-> Tensor");
  m.def("gated_ffn(Tensor x, Tensor gate_buffer, int[] gate, Tensor up_buffer, int[] up, Tensor down_buffer, "
        "int[] down, int threads, Tensor? ids=None, int[] listed=[]) -> Tensor");
  m.def("cm_matmul(Tensor x, Tensor buffer, int[] spec, float threshold, int threads, Tensor(a!)? counters=None) "
        "-> Tensor");
  m.def("cm_gated_ffn(Tensor x, Tensor gate_buffer, int[] gate, Tensor up_buffer, int[] up, Tensor down_buffer, "
        "int[] down, float t_gu, float t_down, int act, int threads, Tensor(a!)? gate_counters=None, "
        "Tensor(b!)? up_counters=None, Tensor(c!)? down_counters=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlx_flash, CPU, m) {
  m.impl("stored_matmul", &stored_matmul);
  m.impl("stored_rows", &stored_rows);
  m.impl("attention", &attention);
  m.impl("attention_coded", &attention_coded);
  m.impl("attention_mixed", &attention_mixed);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("moe_experts", &moe_experts);
  m.impl("gated_ffn", &gated_ffn);
  m.impl("cm_matmul", &cm_matmul);
  m.impl("cm_gated_ffn", &cm_gated_ffn);
}
