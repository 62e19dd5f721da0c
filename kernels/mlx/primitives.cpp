// The primitives' common part: the recording of the addresses they receive (record_inputs, for the
// tests that check weights reach the kernel where they were read) and the GPU evaluation none of them
// has. The primitives themselves are one file per family: primitives_matmul.cpp (stored matrices'
// products and rows), primitives_ffn.cpp (gated FFN layers, MoE experts), primitives_attention.cpp,
// primitives_pointwise.cpp (RMS norm, RoPE, silu * up, KV writes), primitives_buffers.cpp (fences,
// wrapped and empty buffers) and primitives_channel_major.cpp (the product skipping zeroed inputs);
// what they share is primitives_common.h.
#include "primitives.h"

#include <atomic>
#include <mutex>
#include <stdexcept>

#include "primitives_common.h"

namespace mlx_flash {

namespace {

std::atomic<bool> g_recording{false};
std::mutex g_record_mu;
std::vector<InputRecord> g_records;

}  // namespace

void record(const char* primitive, const void* address) {
  if (!g_recording.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_record_mu);
  g_records.push_back({primitive, reinterpret_cast<uintptr_t>(address)});
}

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

}  // namespace mlx_flash
