// Body of the sparse_gate_up kernel (mx.fast.metal_kernel; MLX writes the signature):
//   inputs  x [T, D] float32, slab [S, ROW_BYTES] uint8, idx [>= count] int32, count [1] int32
//   output  h [T, S * BLOCK] float32, zero-filled by the launch (init_value=0):
//           h[t, j*BLOCK + r] = silu(x[t] . gate_r) * (x[t] . up_r) of bundle idx[j], j < count.
// count is read here, on the GPU (clamped to the slots and to idx's length): the launch is sized for
// the slab, never for the count, so no host sync learns it.
//
// Template parameters (compile-time: the token loop and the code unpacking unroll, the scale-type
// branches fold away; a slab layout is fixed per model, so one pipeline per layout and token count):
//   T tokens (at most 8: accumulators live in registers), D model width, BLOCK neurons per bundle,
//   ROW_BYTES slab row stride, ST scale type (0 f16, 1 bf16, 2 f32), and for gate (G...) and up (U...):
//   BITS 4 or 8, GROUP quantization group along D, W / S / B byte offsets of words, scales, biases.
//
// Decomposition: one SIMD group per neuron row n = j*BLOCK + r. The grid is (32, ROWS, 1) with
// ROWS <= S*BLOCK, threadgroups (32, 4, 1): SIMD group y takes rows y, y + ROWS, ... below
// count*BLOCK (those past it have none and are done at once). Lane l takes the 32-code chunks
// c = l, l + 32, ... of the row (4 words at 4 bits, 8 at 8 bits: 32 lanes read consecutive words;
// a chunk never straddles a group, groups being multiples of 32) and accumulates, per token,
// s * sum(q * x) + b * sum(x) for gate and up from the packed codes; the partial sums meet in
// simd_sum. A row never spans SIMD groups, so no threadgroup memory is needed.
const int S = slab_shape[0];
const int cnt = metal::max(0, metal::min(count[0], metal::min(S, idx_shape[0])));
const uint rows = uint(cnt) * BLOCK;
const uint lane = thread_index_in_simdgroup;
const device uint8_t* slab_bytes = (const device uint8_t*)slab;

for (uint n = thread_position_in_grid.y; n < rows; n += threads_per_grid.y) {
  const uint j = n / BLOCK;
  const uint r = n % BLOCK;
  const device uint8_t* row = slab_bytes + ulong(idx[j]) * ROW_BYTES;
  const device uint* gw = (const device uint*)(row + GW) + r * (D * GBITS / 32);
  const device uint* uw = (const device uint*)(row + UW) + r * (D * UBITS / 32);
  float ag[T];
  float au[T];
  for (int t = 0; t < T; t++) {
    ag[t] = 0.0f;
    au[t] = 0.0f;
  }
  for (uint c = lane; c < D / 32; c += 32) {
    uint wg[GBITS];
    uint wu[UBITS];
    for (int i = 0; i < GBITS; i++) {
      wg[i] = gw[c * GBITS + i];
    }
    for (int i = 0; i < UBITS; i++) {
      wu[i] = uw[c * UBITS + i];
    }
    const uint gi = r * (D / GGROUP) + c * 32 / GGROUP;
    const uint ui = r * (D / UGROUP) + c * 32 / UGROUP;
    const float gs = mf_scale<ST>(row + GS, gi);
    const float gb = mf_scale<ST>(row + GB, gi);
    const float us = mf_scale<ST>(row + US, ui);
    const float ub = mf_scale<ST>(row + UB, ui);
    for (int t = 0; t < T; t++) {
      const device float* xc = x + t * D + c * 32;
      float xs = 0.0f;
      float qg = 0.0f;
      float qu = 0.0f;
      for (int k = 0; k < 32; k++) {
        const float xv = xc[k];
        xs += xv;
        qg += mf_code<GBITS>(wg, k) * xv;
        qu += mf_code<UBITS>(wu, k) * xv;
      }
      ag[t] += gs * qg + gb * xs;
      au[t] += us * qu + ub * xs;
    }
  }
  for (int t = 0; t < T; t++) {
    const float g = metal::simd_sum(ag[t]);
    const float u = metal::simd_sum(au[t]);
    if (lane == 0) {
      h[t * (S * BLOCK) + n] = g / (1.0f + metal::exp(-g)) * u;
    }
  }
}
