// Buffers and their synchronization as MLX primitives: Fence and AwaitFence (how a streamed slot's
// reader and the graph's kernels take turns), wrap (memory MLX did not allocate as an array, without
// a copy) and Empty (an aligned, uninitialized buffer the reader pool fills in place). None of them
// computes: they let the weights' reads and the graph's evaluation share memory and order.
#include "primitives.h"

#include <chrono>
#include <mutex>

#include "primitives_common.h"

namespace mlx_flash {

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
