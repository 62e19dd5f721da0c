// Helpers of the sparse FFN kernel bodies (sparse_gate_up.metal, sparse_down.metal), passed to
// mx.fast.metal_kernel as `header` (MLX places it before the generated kernel function). The slab
// layout they read is kernels/slab_spec.py's.

// Scale or bias i of a run of them starting at p, as float. ST is slab_spec.ScaleType:
// 0 float16, 1 bfloat16 (stored as uint16 words: the high half of a float32), 2 float32.
template <int ST>
inline float mf_scale(const device uint8_t* p, uint i) {
  if (ST == 0) {
    return float(((const device half*)p)[i]);
  }
  if (ST == 1) {
    return as_type<float>(uint(((const device ushort*)p)[i]) << 16);
  }
  return ((const device float*)p)[i];
}

// Code k (0..31) of 32 codes packed little-endian in BITS-bit fields of w[0 .. BITS-1]:
// code k sits at bit BITS * (k % (32 / BITS)) of word k / (32 / BITS).
template <int BITS>
inline float mf_code(thread const uint* w, int k) {
  return float((w[k / (32 / BITS)] >> (BITS * (k % (32 / BITS)))) & ((1u << BITS) - 1u));
}
