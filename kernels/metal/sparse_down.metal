// Body of the sparse_down kernel (mx.fast.metal_kernel; MLX writes the signature):
//   inputs  h [T, >= S*BLOCK] float32 (as sparse_gate_up leaves it), slab [S, ROW_BYTES] uint8,
//           idx [>= count] int32, count [1] int32
//   output  y [T, D] float32 = sum over j < count of down(idx[j]) . h[t, j*BLOCK : (j+1)*BLOCK],
//           every element written (0 where count is 0).
// count is read here, on the GPU (clamped to the slots and to idx's length).
//
// Template parameters (compile-time, as in sparse_gate_up): T tokens (at most 8), D, BLOCK,
// ROW_BYTES, ST scale type, DBITS / DGROUP / DW / DS / DB of down, LAYOUT (slab_spec.DownLayout:
// 0 BLOCK, row d of a bundle = its BLOCK codes for output d with one scale and bias; 1 COLUMN,
// BLOCK == 1, the neuron's down column quantized along D in groups of DGROUP), SG SIMD groups per
// threadgroup. The layout is a template parameter rather than a params buffer: it is fixed per slab,
// and as a constant the untaken branch compiles away.
//
// Decomposition: a thread owns PER consecutive outputs d: PER = 1 in the BLOCK layout (its d row of
// every bundle: BLOCK*DBITS/32 words, one scale and bias), PER = 32/DBITS in the COLUMN layout (one
// word of every neuron's column). Grid (32 * ceil(D / PER / 32), SG, 1), threadgroups (32, SG, 1):
// the SG SIMD groups of a threadgroup own the same 32*PER outputs and split the bundles,
// j = sg, sg + SG, ... < count, each lane dequantizing its codes (q * s + b, in registers) and
// accumulating them times h in float32, so 32 lanes read consecutive rows or words of a bundle. The
// SG partial sums of an output meet in threadgroup memory, one SIMD group adding its own at a time
// (SG - 1 barriers), and the last SIMD group writes y: no atomics, and every thread reaches every
// barrier (threads owning outputs past D skip only loads and stores; count bounds a loop, no thread
// returns early).
constexpr int PER = LAYOUT == 0 ? 1 : 32 / DBITS;
threadgroup float part[T * PER * 32];

const int S = slab_shape[0];
const int cnt = metal::max(0, metal::min(count[0], metal::min(S, idx_shape[0])));
const uint hs = h_shape[1];
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint u = threadgroup_position_in_grid.x * 32 + lane;  // output row (BLOCK) or column word (COLUMN)
const bool live = u * PER < D;
const device uint8_t* slab_bytes = (const device uint8_t*)slab;

float acc[T * PER];
for (int e = 0; e < T * PER; e++) {
  acc[e] = 0.0f;
}
if (live) {
  for (int j = sg; j < cnt; j += SG) {
    const device uint8_t* row = slab_bytes + ulong(idx[j]) * ROW_BYTES;
    const device float* hj = h + j * BLOCK;
    if (LAYOUT == 0) {
      const int wpd = BLOCK * DBITS / 32;  // words of one output row
      const device uint* w = (const device uint*)(row + DW) + u * wpd;
      const float s = mf_scale<ST>(row + DS, u);
      const float b = mf_scale<ST>(row + DB, u);
      for (int i = 0; i < wpd; i++) {
        const uint word = w[i];
        for (int k = 0; k < 32 / DBITS; k++) {
          const float wv = float((word >> (DBITS * k)) & ((1u << DBITS) - 1u)) * s + b;
          const int rr = i * (32 / DBITS) + k;
          for (int t = 0; t < T; t++) {
            acc[t] += wv * hj[t * hs + rr];
          }
        }
      }
    } else {
      const uint word = ((const device uint*)(row + DW))[u];
      const uint g = u * PER / DGROUP;
      const float s = mf_scale<ST>(row + DS, g);
      const float b = mf_scale<ST>(row + DB, g);
      float hv[T];
      for (int t = 0; t < T; t++) {
        hv[t] = hj[t * hs];
      }
      for (int k = 0; k < PER; k++) {
        const float wv = float((word >> (DBITS * k)) & ((1u << DBITS) - 1u)) * s + b;
        for (int t = 0; t < T; t++) {
          acc[t * PER + k] += wv * hv[t];
        }
      }
    }
  }
}

// The SG partial sums of each output: SIMD group k adds its own to the running total (k > 0) after
// the barrier that publishes SIMD group k-1's; the last one adds the total to its own and writes y.
for (uint k = 0; k + 1 < SG; k++) {
  if (sg == k) {
    for (int e = 0; e < T * PER; e++) {
      part[e * 32 + lane] = (k == 0 ? 0.0f : part[e * 32 + lane]) + acc[e];
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}
if (sg == SG - 1 && live) {
  for (int t = 0; t < T; t++) {
    for (int k = 0; k < PER; k++) {
      y[t * D + u * PER + k] = acc[t * PER + k] + (SG > 1 ? part[(t * PER + k) * 32 + lane] : 0.0f);
    }
  }
}
