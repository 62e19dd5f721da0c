// The CPU kernels as MLX primitives: nodes of MLX's lazy graph whose eval_cpu runs our x86 code on
// the buffers MLX hands them, so a token's forward is built once and evaluated once, with no host
// round trip per product. Weights arrive as a uint8 buffer input (memory MLX allocated, filled in
// place by the reader pool) and byte offsets into it: the kernel reads the stored bytes where the
// read put them. GPU evaluation is not implemented here: on Metal the backend keeps MLX's own
// quantized_matmul and fast attention (mlx_flash/backends/mlx.py).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace mlx_flash {

namespace mx = mlx::core;

// A stored matrix: its quantization and where its parts lie in the buffer input (bytes from its start).
struct MatrixSpec {
  int kind = 0;  // 0: affine groups (w = q * scale + bias); else a GGUF block type (gguf_blocks.h)
  int64_t w_off = 0, s_off = 0, b_off = 0;
  int scale_type = 0, bits = 0, group = 0;  // affine only
  int64_t n_out = 0;
  bool transposed = true;        // rows are outputs (y = x W^T); always for block types
  int arith = 0;                 // 0: the float arithmetic; 1: q8 where the kernels read the matrix (cpu/q8.h)
  std::vector<int64_t> layout;   // empty: a plain matrix; else the kernel's row layout (7 or 4 ints)
  bool operator==(const MatrixSpec& o) const {
    return kind == o.kind && w_off == o.w_off && s_off == o.s_off && b_off == o.b_off && scale_type == o.scale_type &&
           bits == o.bits && group == o.group && n_out == o.n_out && transposed == o.transposed &&
           arith == o.arith && layout == o.layout;
  }
};

// What a sparse product's id input lists (see kernels/cpu/qmatmul.h: Problem's row_ids, group_ids).
enum class Listed { None = 0, Rows = 1, Groups = 2 };

class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
};

// y[.., N] = x[.., K] times a stored matrix (inputs: x float32, buffer uint8, [ids int32]).
class StoredMatmul : public CpuPrimitive {
 public:
  StoredMatmul(mx::Stream s, MatrixSpec spec, Listed listed, int threads)
      : CpuPrimitive(s), spec_(std::move(spec)), listed_(listed), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "StoredMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  MatrixSpec spec_;
  Listed listed_;
  int threads_;
};

// down(silu(x G^T) * (x U^T)): a gated FFN layer in one node (inputs: x float32, the gate, up and down
// buffers, one array may serve as several; [ids int32] for a sparse layer). No up: gate holds gate|up
// (2F outputs, gate first). Sparse: each matrix lists ids as `listed` says (gate, up, down), its n_out the
// sparse product's width. The same products and activation as separate nodes, to the bit.
class GatedFFN : public CpuPrimitive {
 public:
  GatedFFN(mx::Stream s, MatrixSpec gate, std::optional<MatrixSpec> up, MatrixSpec down, std::vector<Listed> listed,
           int threads)
      : CpuPrimitive(s), gate_(std::move(gate)), up_(std::move(up)), down_(std::move(down)),
        listed_(std::move(listed)), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "GatedFFN"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  MatrixSpec gate_;
  std::optional<MatrixSpec> up_;
  MatrixSpec down_;
  std::vector<Listed> listed_;  // empty: dense
  int threads_;
};

// One expert of a MoE layer as MoEExperts takes it: its gate, up and down, each with the buffer input
// it lies in (an index among the buffers; -1: no such matrix, i.e. no up when gate holds gate|up, and
// an expert without a gate is not in this call).
struct ExpertSpec {
  int buffer[3] = {-1, -1, -1};  // gate, up, down
  MatrixSpec gate, up, down;
  bool present() const { return buffer[0] >= 0; }
  bool operator==(const ExpertSpec& o) const {
    return buffer[0] == o.buffer[0] && buffer[1] == o.buffer[1] && buffer[2] == o.buffer[2] && gate == o.gate &&
           up == o.up && down == o.down;
  }
};

// A MoE layer's routed experts in one node (kernels/cpu/moe_experts.cpp): inputs x [N, D] float32, ids
// int32 [N, K], weights float32 [N, K], the sum so far [N, Dout] float32, then the buffers the experts
// lie in. The output is the sum plus every routed expert's weighted output, experts in ascending order;
// a routed expert not in `experts` adds nothing (a later call's wave adds it). `scratch_floats`: what
// the largest expert's share of the tokens needs.
class MoEExperts : public CpuPrimitive {
 public:
  MoEExperts(mx::Stream s, std::vector<ExpertSpec> experts, int64_t scratch_floats, int threads)
      : CpuPrimitive(s), experts_(std::move(experts)), scratch_(scratch_floats), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[3].shape()}; }
  const char* name() const override { return "MoEExperts"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<ExpertSpec> experts_;
  int64_t scratch_;
  int threads_;
};

// A channel-major matrix (kernels/cpu/channel_major.cpp): where its layout lies in the buffer input
// and its shape and quantization.
struct CmSpec {
  int64_t offset = 0, n_out = 0, k_in = 0;
  int bits = 0, group = 0, scale_type = 0;
  bool operator==(const CmSpec& o) const {
    return offset == o.offset && n_out == o.n_out && k_in == o.k_in && bits == o.bits && group == o.group &&
           scale_type == o.scale_type;
  }
};

// What evaluated channel-major products counted (rows, active channels, active groups), shared by a
// Python object and the nodes that add to it: a node keeps it alive until it has run.
class CmCounters {
 public:
  void add(const int64_t* counts) {
    for (int i = 0; i < 3; i++) v_[i].fetch_add(counts[i], std::memory_order_relaxed);
  }
  std::vector<int64_t> values() const { return {v_[0].load(), v_[1].load(), v_[2].load()}; }
  void reset() {
    for (auto& v : v_) v.store(0);
  }

 private:
  std::atomic<int64_t> v_[3] = {{0}, {0}, {0}};
};

// y[.., N] = x[.., K] times a channel-major matrix, a row's channels with |x| <= threshold taken as
// zero (threshold < 0: none are); inputs x float32, buffer uint8. Counts into `counters` when set.
class ChannelMajorMatmul : public CpuPrimitive {
 public:
  ChannelMajorMatmul(mx::Stream s, CmSpec spec, float threshold, int threads, std::shared_ptr<CmCounters> counters)
      : CpuPrimitive(s), spec_(spec), threshold_(threshold), threads_(threads), counters_(std::move(counters)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "ChannelMajorMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  CmSpec spec_;
  float threshold_;
  int threads_;
  std::shared_ptr<CmCounters> counters_;
};

// down(act(x G^T) * (x U^T)) over channel-major matrices (kernels/cpu/channel_major_ffn.cpp): gate and
// up skip x's channels with |x| <= t_gu, down the activations' with |h| <= t_down (negative: none).
// Inputs: x float32, the gate, up and down buffers (uint8; one array may serve as several). No up: gate
// holds gate|up (2F outputs, gate first). act 0 silu, 1 gelu (tanh). Each matrix counts into its own
// counters when set (gate, up, down). The same products and activation as separate nodes, to the bit.
class ChannelMajorFFN : public CpuPrimitive {
 public:
  using Counters = std::array<std::shared_ptr<CmCounters>, 3>;
  ChannelMajorFFN(mx::Stream s, CmSpec gate, std::optional<CmSpec> up, CmSpec down, float t_gu, float t_down,
                  int act, int threads, Counters counters)
      : CpuPrimitive(s), gate_(gate), up_(up), down_(down), t_gu_(t_gu), t_down_(t_down), act_(act),
        threads_(threads), counters_(std::move(counters)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "ChannelMajorFFN"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  CmSpec gate_;
  std::optional<CmSpec> up_;
  CmSpec down_;
  float t_gu_, t_down_;
  int act_, threads_;
  Counters counters_;
};

// Rows ids[...] of a stored matrix as float32 [..., K] (inputs: ids int32, buffer uint8); an id
// outside [0, rows) gives a row of zeros (callers check ids first: a lazy graph cannot raise).
class StoredRows : public CpuPrimitive {
 public:
  StoredRows(mx::Stream s, MatrixSpec spec, int64_t rows, int64_t k, int64_t row_bytes, int64_t scale_row_bytes)
      : CpuPrimitive(s), spec_(std::move(spec)), rows_(rows), k_(k), wr_(row_bytes), sr_(scale_row_bytes) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "StoredRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  MatrixSpec spec_;
  int64_t rows_, k_, wr_, sr_;
};

// softmax(scale q k^T) v (kernels/cpu/attention.cpp). Inputs q [B, Hq, T, hd], k, v, then by mode:
//   Uniform: k, v [B, Hkv, S, hd]; every row holds S keys, its first query at S - T
//   Rows:    as Uniform, plus kv_len, q_pos int32 [B]
//   Table:   k, v pools [blocks, Hkv, block_tokens, hd], plus kv_len, q_pos [B], table int32 [B, max_blocks]
// Output [B, Hq, T, hd] laid out in memory as [B, T, Hq, hd] (what the output projection reads).
class Attention : public CpuPrimitive {
 public:
  enum class Mode { Uniform = 0, Rows = 1, Table = 2 };
  Attention(mx::Stream s, float scale, Mode mode, int threads, int64_t window)
      : CpuPrimitive(s), scale_(scale), mode_(mode), threads_(threads), window_(window) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "Attention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  Mode mode_;
  int threads_;
  int64_t window_;  // keys a query sees back from its own position (0: all)
};

// Attention over compressed KV (kernels/cpu/attention.cpp mf_attention_coded). Inputs q, k, v (float
// residuals [B, Hkv, R, hd] after each row's coded part), k_codes, v_codes (uint8 buffers), coded int32
// [2, B] (keys' and values' coded counts per row), kv_len, q_pos [B], [table int32 [B, max_blocks]];
// the layouts are kv_codes.h's MF_KV_CODES_INTS ints each. Output as Attention's.
class CodedAttention : public CpuPrimitive {
 public:
  CodedAttention(mx::Stream s, float scale, int threads, std::vector<int64_t> k_layout, std::vector<int64_t> v_layout,
                 bool table)
      : CpuPrimitive(s),
        scale_(scale),
        threads_(threads),
        k_layout_(std::move(k_layout)),
        v_layout_(std::move(v_layout)),
        table_(table) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "CodedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int threads_;
  std::vector<int64_t> k_layout_, v_layout_;
  bool table_;
};

// Attention over a pool's chunks of mixed widths (kernels/cpu/attention.cpp mf_attention_mixed).
// Inputs q, k, v (the float pool as blocks [slots, Hkv, block_tokens, hd]), codes (uint8: the coded
// chunks' buffer), kv_len, q_pos [B], table and classes int32 [B, max_blocks]; `layouts` holds each
// class's keys' then values' layout (kv_codes.h's MF_KV_CODES_INTS ints each) over `codes`.
class MixedAttention : public CpuPrimitive {
 public:
  MixedAttention(mx::Stream s, float scale, int threads, std::vector<int64_t> layouts)
      : CpuPrimitive(s), scale_(scale), threads_(threads), layouts_(std::move(layouts)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MixedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int threads_;
  std::vector<int64_t> layouts_;
};

// x / sqrt(mean(x^2) + eps) * w over the last axis (inputs: x, w float32).
class RmsNorm : public CpuPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : CpuPrimitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  const char* name() const override { return "RmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

// Rotary position embedding of x [B, H, T, hd] (inputs: x, inv_freq float32 [dims / 2], pos int32 [B]:
// each row's first position); the output is contiguous.
class Rope : public CpuPrimitive {
 public:
  Rope(mx::Stream s, int dims, bool traditional, float scale)
      : CpuPrimitive(s), dims_(dims), traditional_(traditional), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  const char* name() const override { return "Rope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

// silu(g) * u (inputs g, u float32 of one shape: rows of F along the last axis, each with its own
// row stride, e.g. the two halves of a fused gate|up product).
class SiluMul : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  const char* name() const override { return "SiluMul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// A KV cache's append in place: x [B, H, T, hd] written into buffer [B, H, cap, hd] at tokens
// offset..offset+T; the output is the buffer itself (its memory, no copy) once written. A buffer
// that is not plain memory of its own (a broadcast zeros) is first copied into memory that is.
class WriteTokens : public CpuPrimitive {
 public:
  WriteTokens(mx::Stream s, int64_t offset) : CpuPrimitive(s), offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  const char* name() const override { return "WriteTokens"; }

 private:
  int64_t offset_;
};

// An uninitialized uint8 buffer from MLX's allocator, its start aligned to `align` bytes (direct
// reads need page-aligned destinations): memory the reader pool fills in place.
class Empty : public CpuPrimitive {
 public:
  Empty(mx::Stream s, int64_t align) : CpuPrimitive(s), align_(align) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "Empty"; }

 private:
  int64_t align_;
};

// A monotonic counter threads wait on: how a streamed slot's reader and the graph's kernels take
// turns. The reader signals `ready` with a use's number when its bytes are in the slot; a kernel's
// buffer input waits for it inside the graph (AwaitFence), and the same node tells the reader, through
// `release`, that every earlier use is done (the node runs after the layer's input, so after every
// kernel of the layers before it). Blocked time is counted for the engine's stats.
class Fence {
 public:
  void signal(int64_t value);
  // Block until the value reaches `value` (or cancel()); returns false when cancelled.
  bool wait(int64_t value);
  void cancel();
  int64_t value();
  double blocked_seconds();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t value_ = 0;
  bool cancelled_ = false;
  double blocked_ = 0.0;
};

// `buffer` itself (no copy), once `ready` reaches `value`, after `dep`; first signals `release` with
// `release_value` (-1: none). Inputs: buffer, dep.
class AwaitFence : public CpuPrimitive {
 public:
  AwaitFence(mx::Stream s, std::shared_ptr<Fence> ready, int64_t value, std::shared_ptr<Fence> release,
             int64_t release_value)
      : CpuPrimitive(s), ready_(std::move(ready)), release_(std::move(release)), value_(value),
        release_value_(release_value) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  const char* name() const override { return "AwaitFence"; }

 private:
  std::shared_ptr<Fence> ready_, release_;
  int64_t value_, release_value_;
};

// Graph-building functions (the Python binding's entries).
mx::array stored_matmul(const mx::array& x, const mx::array& buffer, MatrixSpec spec, int threads,
                        const std::optional<mx::array>& ids, Listed listed);
mx::array gated_ffn(const mx::array& x, const mx::array& gate_buffer, MatrixSpec gate, const mx::array& up_buffer,
                    std::optional<MatrixSpec> up, const mx::array& down_buffer, MatrixSpec down, int threads,
                    const std::optional<mx::array>& ids, std::vector<Listed> listed);
mx::array moe_experts(const mx::array& x, const mx::array& ids, const mx::array& weights, const mx::array& sum,
                      const std::vector<mx::array>& buffers, std::vector<ExpertSpec> experts, int threads);
mx::array stored_rows(const mx::array& ids, const mx::array& buffer, MatrixSpec spec, int64_t rows, int64_t k,
                      int64_t row_bytes, int64_t scale_row_bytes);
mx::array cm_matmul(const mx::array& x, const mx::array& buffer, CmSpec spec, float threshold, int threads,
                    std::shared_ptr<CmCounters> counters);
mx::array cm_gated_ffn(const mx::array& x, const mx::array& gate_buffer, CmSpec gate, const mx::array& up_buffer,
                       std::optional<CmSpec> up, const mx::array& down_buffer, CmSpec down, float t_gu, float t_down,
                       int act, int threads, ChannelMajorFFN::Counters counters);
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, int threads,
                    const std::optional<mx::array>& kv_len, const std::optional<mx::array>& q_pos,
                    const std::optional<mx::array>& table, int64_t window);
mx::array attention_coded(const mx::array& q, const mx::array& k, const mx::array& v, float scale, int threads,
                          const mx::array& k_codes, std::vector<int64_t> k_layout, const mx::array& v_codes,
                          std::vector<int64_t> v_layout, const mx::array& coded, const mx::array& kv_len,
                          const mx::array& q_pos, const std::optional<mx::array>& table);
mx::array attention_mixed(const mx::array& q, const mx::array& k, const mx::array& v, float scale, int threads,
                          const mx::array& codes, std::vector<int64_t> layouts, const mx::array& kv_len,
                          const mx::array& q_pos, const mx::array& table, const mx::array& classes);
mx::array empty(int64_t nbytes, int64_t align);
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps);
mx::array rope(const mx::array& x, const mx::array& inv_freq, const mx::array& pos, int dims, bool traditional,
               float scale);
mx::array silu_mul(const mx::array& g, const mx::array& u);
mx::array write_tokens(const mx::array& buffer, const mx::array& x, int64_t offset);
// A uint8 array over memory MLX did not allocate (a numpy buffer the I/O code owns), without a copy.
// CPU only: MLX's CPU allocator keeps each buffer's size in the word before its data, so a Buffer
// handle for `address` is the address of that word; the memory is never freed through MLX. The caller
// keeps the memory alive while the array lives, and evaluates what reads it before reusing it.
mx::array wrap(uintptr_t address, int64_t nbytes);
mx::array await_fence(const mx::array& buffer, const mx::array& dep, std::shared_ptr<Fence> ready, int64_t value,
                      std::shared_ptr<Fence> release, int64_t release_value);

// Addresses the primitives received (tests check that weights reach the kernel where they were
// read): while on, each evaluation records (primitive name, address of each weight or buffer it
// reads); off by default, costing one branch.
struct InputRecord {
  const char* primitive;
  uintptr_t address;
};
void record_inputs(bool on);
std::vector<InputRecord> recorded_inputs();

}  // namespace mlx_flash
