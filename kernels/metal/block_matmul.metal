// Body of the block_matmul kernel (mx.fast.metal_kernel; MLX writes the signature):
//   inputs  x [T, K] float16 or float32, w [N, ROW_BYTES] uint8: the weight's rows of GGUF blocks as
//           the store holds them (row n = output n, K / block weights blocks of its kind's bytes)
//   output  y [T, N] of type OT (float16 or float32): y = x . W^T, every element written.
// N, ROW_BYTES, T and K come from the shapes (one pipeline per kind, pass size and output type,
// whatever the matrix); the launch checks that K = ROW_BYTES / block bytes * block weights.
//
// Template parameters: KIND the GGML type number (6 Q5_0, 7 Q5_1, 12 Q4_K, 13 Q5_K, 14 Q6_K; the
// other kinds' branches compile away), TT tokens per pass (at most 8: accumulators live in
// registers), OT the output type.
//
// Decomposition, for decode (few tokens, memory bound): one SIMD group per output row n. The grid is
// (32, ROWS, 1) with ROWS <= N, threadgroups (32, SG, 1): SIMD group y takes rows y, y + ROWS, ...
// Lane l takes the runs of 32 weights u = l, l + 32, ... of the row (a Q5 block, or a sub-block of
// a K block: 32 lanes read neighbouring bytes), decodes each into registers once per pass and
// multiplies it with the pass's TT tokens, accumulating in float32; the partial sums of a row meet
// in simd_sum. Tokens past TT take further passes over the row (its bytes are then in cache), so one
// launch serves any T. A row never spans SIMD groups, so no threadgroup memory is needed.
const uint N = w_shape[0];
const uint row_bytes = w_shape[1];
const uint T = x_shape[0];
const uint K = x_shape[1];
const uint runs = row_bytes / mf_block_bytes<KIND>() * mf_block_runs<KIND>();
const uint lane = thread_index_in_simdgroup;

for (uint n = thread_position_in_grid.y; n < N; n += threads_per_grid.y) {
  const device uint8_t* row = w + ulong(n) * row_bytes;
  for (uint t0 = 0; t0 < T; t0 += TT) {
    float acc[TT];
    for (int t = 0; t < TT; t++) {
      acc[t] = 0.0f;
    }
    for (uint u = lane; u < runs; u += 32) {
      float wv[32];
      mf_decode_run<KIND>(row, u, wv);
      for (int t = 0; t < TT; t++) {
        if (t0 + t < T) {
          const ulong at = ulong(t0 + t) * K + u * 32;
          float s = 0.0f;
          for (int i = 0; i < 32; i++) {
            s += wv[i] * float(x[at + i]);
          }
          acc[t] += s;
        }
      }
    }
    for (int t = 0; t < TT; t++) {
      const float total = metal::simd_sum(acc[t]);
      if (lane == 0 && t0 + t < T) {
        y[ulong(t0 + t) * N + n] = static_cast<OT>(total);
      }
    }
  }
}
