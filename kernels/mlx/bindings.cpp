// mlx_flash.kernels._mlx_kernels: the CPU kernels as MLX graph operations (primitives.h), for
// mlx_flash/kernels/mlx_kernels.py, their Python binding. Built at install against one MLX version
// (mlx_version() says which); the binding refuses any other.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "kernel_library.h"
#include "mlx/version.h"
#include "primitives.h"

namespace nb = nanobind;
using namespace nb::literals;
using mlx_flash::Listed;
using mlx_flash::MatrixSpec;
namespace mx = mlx::core;

namespace {

MatrixSpec spec_of(int kind, int64_t w_off, int64_t s_off, int64_t b_off, int scale_type, int bits, int group,
                   int64_t n_out, bool transposed, int arith, std::vector<int64_t> layout) {
  MatrixSpec s;
  s.kind = kind;
  s.w_off = w_off;
  s.s_off = s_off;
  s.b_off = b_off;
  s.scale_type = scale_type;
  s.bits = bits;
  s.group = group;
  s.n_out = n_out;
  s.transposed = transposed;
  s.arith = arith;
  s.layout = std::move(layout);
  return s;
}

// A matrix from the list the whole-layer entries take (stored_operands.Operands.spec).
MatrixSpec spec_from(const std::vector<int64_t>& v) {
  if (v.size() != 10 && v.size() != (v.empty() || v[0] == 0 ? 17u : 14u))
    throw std::invalid_argument("a matrix is 10 ints and its layout (7 affine, 4 blocks)");
  return spec_of((int)v[0], v[1], v[2], v[3], (int)v[4], (int)v[5], (int)v[6], v[7], v[8] != 0, (int)v[9],
                 std::vector<int64_t>(v.begin() + 10, v.end()));
}

// A channel-major matrix from the list cm_gated_ffn takes (torch_ops' and mlx_kernels' spec).
mlx_flash::CmSpec cm_spec_from(const std::vector<int64_t>& v) {
  if (v.size() != 6)
    throw std::invalid_argument("a channel-major matrix is 6 ints (offset, n_out, k_in, bits, group, scale_type)");
  mlx_flash::CmSpec s;
  s.offset = v[0];
  s.n_out = v[1];
  s.k_in = v[2];
  s.bits = (int)v[3];
  s.group = (int)v[4];
  s.scale_type = (int)v[5];
  return s;
}

}  // namespace

NB_MODULE(_mlx_kernels, m) {
  m.doc() = "The CPU kernels as MLX primitives (mlx_flash.kernels.mlx_kernels is the binding).";

  m.def("mlx_version", []() {
    return std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
           std::to_string(MLX_VERSION_PATCH);
  }, "The MLX version this extension was built against (it runs with that one only).");

  m.def("load_kernel_library", &mlx_flash::load_kernel_library, "path"_a,
        "Use the CPU kernel library already loaded from `path` (mlx_flash.kernels._qmatmul).");

  m.def(
      "stored_matmul",
      [](const mx::array& x, const mx::array& buffer, int kind, int64_t w_off, int64_t s_off, int64_t b_off,
         int scale_type, int bits, int group, int64_t n_out, bool transposed, int arith, std::vector<int64_t> layout,
         int threads, std::optional<mx::array> ids, int listed) {
        return mlx_flash::stored_matmul(x, buffer,
                                        spec_of(kind, w_off, s_off, b_off, scale_type, bits, group, n_out, transposed,
                                                arith, std::move(layout)),
                                        threads, ids, static_cast<Listed>(listed));
      },
      "x"_a, "buffer"_a, "kind"_a, "w_off"_a, "s_off"_a, "b_off"_a, "scale_type"_a, "bits"_a, "group"_a, "n_out"_a,
      "transposed"_a, "arith"_a, "layout"_a, "threads"_a, "ids"_a = nb::none(), "listed"_a = 0,
      "x [.., K] times the stored matrix in `buffer` -> [.., n_out] float32 (lazy), in arithmetic `arith` (0 float, "
      "1 q8).");

  m.def(
      "gated_ffn",
      [](const mx::array& x, const mx::array& gate_buffer, std::vector<int64_t> gate, const mx::array& up_buffer,
         std::vector<int64_t> up, const mx::array& down_buffer, std::vector<int64_t> down, int threads,
         std::optional<mx::array> ids, std::vector<int> listed) {
        std::optional<MatrixSpec> u;
        if (!up.empty()) u = spec_from(up);
        std::vector<Listed> lists;
        for (int l : listed) {
          if (l < 0 || l > 2) throw std::invalid_argument("gated_ffn: listed is 0 (none), 1 (rows) or 2 (groups)");
          lists.push_back(static_cast<Listed>(l));
        }
        return mlx_flash::gated_ffn(x, gate_buffer, spec_from(gate), up_buffer, u, down_buffer, spec_from(down),
                                    threads, ids, std::move(lists));
      },
      "x"_a, "gate_buffer"_a, "gate"_a, "up_buffer"_a, "up"_a, "down_buffer"_a, "down"_a, "threads"_a,
      "ids"_a = nb::none(), "listed"_a = std::vector<int>{},
      "down(silu(gate) * up) of x [.., K]; each matrix as [kind, w_off, s_off, b_off, scale_type, bits, group, n_out, "
      "transposed, layout...], up [] when gate holds gate|up; sparse: ids and what each matrix lists (lazy).");

  m.def(
      "moe_experts",
      [](const mx::array& x, const mx::array& ids, const mx::array& weights, const mx::array& sum,
         std::vector<mx::array> buffers,
         std::vector<std::vector<std::tuple<int, std::vector<int64_t>>>> experts, int threads) {
        std::vector<mlx_flash::ExpertSpec> specs;
        for (auto& mats : experts) {
          if (mats.size() != 3) throw std::invalid_argument("moe_experts: an expert is (gate, up, down)");
          mlx_flash::ExpertSpec e;
          MatrixSpec* out[3] = {&e.gate, &e.up, &e.down};
          for (int m = 0; m < 3; m++) {
            auto& [buffer, spec] = mats[m];
            e.buffer[m] = buffer;
            if (buffer >= 0) *out[m] = spec_from(spec);
          }
          specs.push_back(std::move(e));
        }
        return mlx_flash::moe_experts(x, ids, weights, sum, buffers, std::move(specs), threads);
      },
      "x"_a, "ids"_a, "weights"_a, "sum"_a, "buffers"_a, "experts"_a, "threads"_a,
      "sum + each routed expert's gated FFN of its tokens times their router weights, experts ascending; experts: "
      "per expert ((buffer index, matrix) for gate, up, down; index -1: no up (gate|up), or no gate: not in this "
      "call), each matrix as gated_ffn takes it (lazy).");

  m.def(
      "stored_rows",
      [](const mx::array& ids, const mx::array& buffer, int kind, int64_t w_off, int64_t s_off, int64_t b_off,
         int scale_type, int bits, int group, int64_t rows, int64_t k, int64_t row_bytes, int64_t scale_row_bytes) {
        return mlx_flash::stored_rows(ids, buffer,
                                      spec_of(kind, w_off, s_off, b_off, scale_type, bits, group, k, true, 0, {}), rows, k,
                                      row_bytes, scale_row_bytes);
      },
      "ids"_a, "buffer"_a, "kind"_a, "w_off"_a, "s_off"_a, "b_off"_a, "scale_type"_a, "bits"_a, "group"_a, "rows"_a,
      "k"_a, "row_bytes"_a, "scale_row_bytes"_a, "Rows `ids` of the stored matrix as float32 [..ids, k] (lazy).");

  nb::class_<mlx_flash::CmCounters>(m, "CmCounters",
                                     "What evaluated channel-major products counted: rows, active channels, "
                                     "active groups.")
      .def(nb::init<>())
      .def("values", &mlx_flash::CmCounters::values, "The three counts.")
      .def("reset", &mlx_flash::CmCounters::reset, "Set them to zero.");

  m.def(
      "cm_matmul",
      [](const mx::array& x, const mx::array& buffer, int64_t offset, int64_t n_out, int64_t k_in, int bits, int group,
         int scale_type, float threshold, int threads, std::shared_ptr<mlx_flash::CmCounters> counters) {
        return mlx_flash::cm_matmul(x, buffer, cm_spec_from({offset, n_out, k_in, bits, group, scale_type}),
                                    threshold, threads, std::move(counters));
      },
      "x"_a, "buffer"_a, "offset"_a, "n_out"_a, "k_in"_a, "bits"_a, "group"_a, "scale_type"_a, "threshold"_a,
      "threads"_a, nb::arg("counters").none() = nb::none(),
      "x [.., k_in] times the channel-major matrix at `offset` in `buffer` -> [.., n_out] float32 (lazy); a row's "
      "channels with |x| <= threshold count as zero (threshold < 0: none); counted into `counters` when given.");

  m.def(
      "cm_gated_ffn",
      [](const mx::array& x, const mx::array& gate_buffer, std::vector<int64_t> gate, const mx::array& up_buffer,
         std::vector<int64_t> up, const mx::array& down_buffer, std::vector<int64_t> down, float t_gu, float t_down,
         int act, int threads, std::shared_ptr<mlx_flash::CmCounters> gate_counters,
         std::shared_ptr<mlx_flash::CmCounters> up_counters, std::shared_ptr<mlx_flash::CmCounters> down_counters) {
        std::optional<mlx_flash::CmSpec> u;
        if (!up.empty()) u = cm_spec_from(up);
        return mlx_flash::cm_gated_ffn(x, gate_buffer, cm_spec_from(gate), up_buffer, u, down_buffer,
                                       cm_spec_from(down), t_gu, t_down, act, threads,
                                       {std::move(gate_counters), std::move(up_counters), std::move(down_counters)});
      },
      "x"_a, "gate_buffer"_a, "gate"_a, "up_buffer"_a, "up"_a, "down_buffer"_a, "down"_a, "t_gu"_a, "t_down"_a,
      "act"_a, "threads"_a, nb::arg("gate_counters").none() = nb::none(), nb::arg("up_counters").none() = nb::none(),
      nb::arg("down_counters").none() = nb::none(),
      "down(act(gate) * up) of x [.., K] over channel-major matrices, each [offset, n_out, k_in, bits, group, "
      "scale_type] in its buffer (up [] when gate holds gate|up); gate and up skip x's channels with |x| <= t_gu, "
      "down the activations' with |h| <= t_down; act 0 silu, 1 gelu (tanh); counted per matrix when given (lazy).");

  m.def("attention", &mlx_flash::attention, "q"_a, "k"_a, "v"_a, "scale"_a, "threads"_a, "kv_len"_a = nb::none(),
        "q_pos"_a = nb::none(), "table"_a = nb::none(), "window"_a = 0,
        "softmax(scale q k^T) v with each query's keys (see primitives.h; window > 0: only its last window keys) "
        "-> [B, Hq, T, hd] float32 (lazy).");

  m.def("attention_coded", &mlx_flash::attention_coded, "q"_a, "k"_a, "v"_a, "scale"_a, "threads"_a, "k_codes"_a,
        "k_layout"_a, "v_codes"_a, "v_layout"_a, "coded"_a, "kv_len"_a, "q_pos"_a, "table"_a = nb::none(),
        "attention over compressed KV: each row's first coded keys and values read as codes (kv_codes.h), "
        "the rest from the float residuals k, v -> [B, Hq, T, hd] float32 (lazy).");

  m.def("attention_mixed", &mlx_flash::attention_mixed, "q"_a, "k"_a, "v"_a, "scale"_a, "threads"_a, "codes"_a,
        "layouts"_a, "kv_len"_a, "q_pos"_a, "table"_a, "classes"_a,
        "attention over a pool's chunks of mixed widths: each block float (class 0, k and v as [slots, Hkv, "
        "block_tokens, hd]) or coded through its class's layouts over codes -> [B, Hq, T, hd] float32 (lazy).");

  m.def("empty", &mlx_flash::empty, "nbytes"_a, "align"_a = 4096,
        "An uninitialized uint8 buffer from MLX's allocator, aligned (lazy; evaluate before viewing it).");

  nb::class_<mlx_flash::Fence>(m, "Fence",
                                "A counter the graph's kernels and a slot's reader take turns on (primitives.h).")
      .def(nb::init<>())
      .def("signal", &mlx_flash::Fence::signal, "value"_a, "Raise the value to `value` (never lowers it).")
      .def("wait", &mlx_flash::Fence::wait, "value"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Block until the value reaches `value`; False when cancelled.")
      .def("cancel", &mlx_flash::Fence::cancel, "Wake every waiter for good (closing).")
      .def_prop_ro("value", &mlx_flash::Fence::value)
      .def_prop_ro("blocked_seconds", &mlx_flash::Fence::blocked_seconds, "Time waiters spent blocked.");

  m.def("await_fence", &mlx_flash::await_fence, "buffer"_a, "dep"_a, "ready"_a, "value"_a, "release"_a = nb::none(),
        "release_value"_a = -1,
        "`buffer` (no copy) once `ready` reaches `value`, evaluated after `dep`; it first signals `release`.");

  m.def(
      "wrap",
      [](uintptr_t address, int64_t nbytes) { return mlx_flash::wrap(address, nbytes); }, "address"_a, "nbytes"_a,
      "A uint8 array over memory MLX did not allocate, without a copy (CPU only; see primitives.h).");

  m.def("rms_norm", &mlx_flash::rms_norm, "x"_a, "w"_a, "eps"_a, "x / sqrt(mean(x^2) + eps) * w (lazy).");
  m.def("rope", &mlx_flash::rope, "x"_a, "inv_freq"_a, "pos"_a, "dims"_a, "traditional"_a, "scale"_a,
        "Rotary position embedding of x [B, H, T, hd] from positions pos [B] (lazy).");
  m.def("silu_mul", &mlx_flash::silu_mul, "g"_a, "u"_a, "silu(g) * u (lazy).");
  m.def("write_tokens", &mlx_flash::write_tokens, "buffer"_a, "x"_a, "offset"_a,
        "buffer with x written at tokens offset.. in place: a KV cache's append (lazy).");

  m.def("record_inputs", &mlx_flash::record_inputs, "on"_a,
        "Start (True) or stop recording the addresses primitives read weights from; clears the record.");
  m.def("recorded_inputs", []() {
    std::vector<std::tuple<std::string, uintptr_t>> out;
    for (const auto& r : mlx_flash::recorded_inputs()) out.emplace_back(r.primitive, r.address);
    return out;
  }, "(primitive, address) for each weight or buffer read since record_inputs(True).");
}
