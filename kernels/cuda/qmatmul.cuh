// The affine stored product on CUDA: float32 activations times a matrix in the store's affine layout
// (cpu/qmatmul.h describes it: codes of `bits` packed lowest bits first into uint32 words, one scale
// and one bias per `group` codes of a row, w = scale * code + bias), read where the bytes lie on the
// device, float32 accumulation. Plain CUDA C++ over raw device pointers, no torch types, so
// qmatmul.cu compiles alone with nvcc -c; the torch operator is ops_cuda.cpp.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mf {

// A plain (unlaid-out) affine matrix in device memory: `rows` rows of `codes` codes each, words
// [rows, codes * bits / 32] 4-byte aligned, scales and biases [rows, codes / group] of scale_type
// (0 float16, 1 bfloat16, 2 float32) aligned to their size.
struct AffineMatrix {
  const uint32_t* words;
  const uint8_t* scales;
  const uint8_t* biases;
  int64_t rows, codes;
  int bits, group, scale_type;
};

constexpr int kMatmulTokens = 8;  // tokens per launch (accumulators live in registers); more take turns
constexpr int kInputChunks = 16;  // rows-are-inputs products sum this many partial products of K

// Floats of scratch affine_matmul needs: 0 when rows are outputs, else kInputChunks partial
// products of up to kMatmulTokens tokens.
int64_t affine_scratch_floats(const AffineMatrix& m, int64_t T, bool rows_are_outputs);

// rows_are_outputs (a linear): y[T, rows] = x[T, codes] · Wᵀ. Otherwise (rows are inputs, e.g. a
// neuron-major down matrix): y[T, codes] = x[T, rows] · W. x and y contiguous float32 device memory;
// scratch affine_scratch_floats() floats. Any T >= 1: launches of up to kMatmulTokens tokens each on
// `stream`. cudaErrorInvalidValue when the matrix is not one this kernel reads (bits 2/4/8, group a
// multiple of 32 that divides `codes`, a known scale type).
cudaError_t affine_matmul(const float* x, int64_t T, const AffineMatrix& m, bool rows_are_outputs, float* y,
                          float* scratch, cudaStream_t stream);

}  // namespace mf
