// Helpers of the block_matmul kernel body (block_matmul.metal), passed to mx.fast.metal_kernel as
// `header`: GGUF block decoding (layouts in ../cpu/gguf_blocks.h), one run of 32 weights at a time,
// into float32 exactly as kernels/gguf_blocks_ref.py dequantizes (every product exact, the one
// rounding Q5_1's + m and the K kinds' - dmin * m).
//
// Fields are read byte by byte: blocks of 22 (Q5_0) and 210 (Q6_K) bytes leave most blocks of a row
// off 4-byte alignment, and a misaligned word load is undefined on the GPU.

// KIND is the GGML type number (ggml.h, quant_spec.BLOCKS): 6 Q5_0, 7 Q5_1, 12 Q4_K, 13 Q5_K, 14 Q6_K.
template <int KIND>
constexpr uint mf_block_bytes() {
  return KIND == 6 ? 22 : KIND == 7 ? 24 : KIND == 12 ? 144 : KIND == 13 ? 176 : 210;
}

// Runs of 32 weights per block: a Q5 block is one; a K block's 256 weights are eight.
template <int KIND>
constexpr uint mf_block_runs() {
  return KIND == 6 || KIND == 7 ? 1 : 8;
}

// The float16 at p, widened (exact).
inline float mf_f16(const device uint8_t* p) {
  return float(as_type<half>(ushort(uint(p[0]) | (uint(p[1]) << 8))));
}

// The little-endian uint32 at p.
inline uint mf_u32(const device uint8_t* p) {
  return uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24);
}

// Run u (weights 32u .. 32u + 31) of a row of blocks, into w[0 .. 31].
template <int KIND>
inline void mf_decode_run(const device uint8_t* row, uint u, thread float* w) {
  const device uint8_t* b = row + (u / mf_block_runs<KIND>()) * mf_block_bytes<KIND>();
  const uint s = u % mf_block_runs<KIND>();  // the run within its block
  if (KIND == 6 || KIND == 7) {  // d, (m,) qh (32 fifth bits), qs[16]: weight j low nibble, j + 16 high
    const float d = mf_f16(b);
    const float m = KIND == 7 ? mf_f16(b + 2) : 0.0f;
    const device uint8_t* after = b + (KIND == 7 ? 4 : 2);
    const uint qh = mf_u32(after);
    const device uint8_t* qs = after + 4;
    for (uint j = 0; j < 16; j++) {
      const uint lo = (uint(qs[j]) & 0xFu) | (((qh >> j) & 1u) << 4);
      const uint hi = (uint(qs[j]) >> 4) | (((qh >> (j + 16)) & 1u) << 4);
      if (KIND == 6) {
        w[j] = d * float(int(lo) - 16);
        w[j + 16] = d * float(int(hi) - 16);
      } else {
        w[j] = d * float(lo) + m;
        w[j + 16] = d * float(hi) + m;
      }
    }
  } else if (KIND == 12 || KIND == 13) {
    // d, dmin, scales[12] (eight 6-bit scale/min pairs, ggml's get_scale_min_k4), (Q5_K: qh[32],)
    // qs[128]: run s is sub-block s, the low nibbles of qs[32 (s / 2) ..] for even s, the high for
    // odd s; Q5_K's fifth bit of weight l is bit s of qh[l].
    const float d = mf_f16(b);
    const float dmin = mf_f16(b + 2);
    const device uint8_t* sc = b + 4;
    uint scale;
    uint mn;
    if (s < 4) {
      scale = uint(sc[s]) & 63u;
      mn = uint(sc[s + 4]) & 63u;
    } else {
      scale = (uint(sc[s + 4]) & 0xFu) | ((uint(sc[s - 4]) >> 6) << 4);
      mn = (uint(sc[s + 4]) >> 4) | ((uint(sc[s]) >> 6) << 4);
    }
    const float ds = d * float(scale);
    const float dm = dmin * float(mn);
    const device uint8_t* qh = b + 16;
    const device uint8_t* qs = b + (KIND == 13 ? 48 : 16) + 32 * (s / 2);
    const uint shift = 4 * (s % 2);
    for (uint l = 0; l < 32; l++) {
      uint q = (uint(qs[l]) >> shift) & 0xFu;
      if (KIND == 13) {
        q |= ((uint(qh[l]) >> s) & 1u) << 4;
      }
      w[l] = ds * float(q) - dm;
    }
  } else {
    // Q6_K: ql[128], qh[64], scales[16] (int8), d. Half h = s / 4 of 128 weights, run r = s % 4 of
    // it: low 4 bits from ql[64h + 32 (r % 2) + l] (high nibble for r >= 2), top 2 bits from bits 2r
    // of qh[32h + l], scale scales[8h + 2r + l / 16] (sub-blocks of 16).
    const uint h = s / 4;
    const uint r = s % 4;
    const device uint8_t* ql = b + 64 * h + 32 * (r % 2);
    const device uint8_t* qh = b + 128 + 32 * h;
    const device uint8_t* sc = b + 192 + 8 * h + 2 * r;
    const float d = mf_f16(b + 208);
    const float d0 = d * float(int(sc[0]) - (sc[0] > 127 ? 256 : 0));  // the int8 scales
    const float d1 = d * float(int(sc[1]) - (sc[1] > 127 ? 256 : 0));
    for (uint l = 0; l < 32; l++) {
      const int q = int(((uint(ql[l]) >> (4 * (r / 2))) & 0xFu) | (((uint(qh[l]) >> (2 * r)) & 3u) << 4)) - 32;
      w[l] = (l < 16 ? d0 : d1) * float(q);
    }
  }
}
