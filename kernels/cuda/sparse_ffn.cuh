// The CUDA member of the sparse FFN kernels (see kernels/sparse_ffn.py for the protocol and
// kernels/slab_spec.py for the slab layout): plain CUDA C++ launchers over raw device pointers, no
// torch types, so sparse_ffn.cu compiles alone with nvcc -c. The torch binding is
// sparse_ffn_torch.cpp.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mf {

// One of gate, up, down inside a bundle: byte offsets of its words, scales and biases.
struct SlabMatrix {
  int w, s, b, bits, group;
};

// SlabSpec as ints. down_layout: 0 block (one group per output row per bundle), 1 column (bundles
// of one neuron, the down column quantized along d_model). scale_type: 0 f16, 1 bf16, 2 f32.
struct SlabLayout {
  int d_model, block, row_bytes;
  SlabMatrix gate, up, down;
  int down_layout, scale_type;
};

constexpr int kMaxTokens = 8;    // per launch: accumulators live in registers
constexpr int kDownChunks = 16;  // sparse_down splits the active bundles into this many partial sums

// h [T, slots*block] = silu(x·gate) * (x·up) of the bundles idx[0:count], count read on the device
// (h is zero past count*block). x [T, d_model] float32, slab [slots, row_bytes] uint8, idx [slots]
// int32, count [1] int32, all device memory, rows 4-byte aligned. T in 1..kMaxTokens.
cudaError_t sparse_gate_up(const float* x, int T, const uint8_t* slab, int slots, const int32_t* idx,
                           const int32_t* count, const SlabLayout& lay, float* h, cudaStream_t stream);

// y [T, d_model] = sum over j < count of down(idx[j]) · h[:, j*block:(j+1)*block] (h row stride
// h_stride floats), float32 accumulation in kDownChunks partial sums (scratch: kDownChunks * T *
// d_model floats) added in a fixed order, so a result does not depend on scheduling.
cudaError_t sparse_down(const float* h, int T, int h_stride, const uint8_t* slab, int slots, const int32_t* idx,
                        const int32_t* count, const SlabLayout& lay, float* scratch, float* y, cudaStream_t stream);

}  // namespace mf
