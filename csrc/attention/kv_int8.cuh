// int8 KV cache, per token and head: the write (quantise K and V into paged blocks).
//
// The cache is addressed through strides, as vLLM's allocator lays it out (no contiguity
// assumed): the D int8 codes of (block, token-in-block, head) start at
//   cache + block * blk_stride + token * tok_stride + head * head_stride   (bytes)
// and its fp32 scale at
//   scale + block * sc_blk_stride + token * sc_tok_stride + head * sc_head_stride (floats),
// K and V each with their own base and the same strides. TRITON_ATTN's hybrid page (rows
// of D + 4 bytes, the scale in the 4 padding bytes) and a packed [block, head, token, D]
// cache are two instances. Rows need only 4-byte alignment: codes are stored as 4-byte
// words. x ~= scale * q with scale = max|x| / 127 over the head's head_dim values and
// q = round(x / scale) in [-127, 127] (an all-zero row stores scale 0).
#pragma once

#include "common/sm70.cuh"

namespace sm70 {

constexpr int kKvWriteWarps = 4;

struct KvCacheStrides {
  int64_t blk, tok, head;           // bytes, of the codes
  int64_t sc_blk, sc_tok, sc_head;  // floats, of the scales
};

// One warp quantises one (token, head, K-or-V) row of D values, D / 32 per lane.
template <int D>
__global__ void __launch_bounds__(kKvWriteWarps * 32)
    kv_int8_write_kernel(const __half* __restrict__ k, const __half* __restrict__ v,
                         int64_t k_tok_stride, int64_t v_tok_stride,  // in elements
                         int8_t* __restrict__ k_cache, int8_t* __restrict__ v_cache,
                         float* __restrict__ k_scale, float* __restrict__ v_scale,
                         const KvCacheStrides st,
                         const int64_t* __restrict__ slot_mapping, int num_tokens,
                         int num_heads, int block_size) {
  static_assert(D % 256 == 0 || D == 128 || D == 64, "head_dim must be 64, 128 or 256k");
  constexpr int PER = D / 32;  // values per lane (8 for head_dim 256)
  static_assert(PER % 2 == 0, "pairs of halves per lane");
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * kKvWriteWarps + (threadIdx.x >> 5);
  if (row >= (int64_t)num_tokens * num_heads * 2) return;
  const int which = (int)(row & 1);  // 0: K, 1: V
  const int64_t th = row >> 1;
  const int t = (int)(th / num_heads);
  const int h = (int)(th % num_heads);
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;  // padding token: nothing to store
  const __half* src =
      which ? v + (int64_t)t * v_tok_stride + (int64_t)h * D : k + (int64_t)t * k_tok_stride + (int64_t)h * D;

  float f[PER];
  const __half2* s2 = reinterpret_cast<const __half2*>(src + lane * PER);
#pragma unroll
  for (int j = 0; j < PER / 2; ++j) {
    const float2 p = __half22float2(s2[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
  }
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) amax = fmaxf(amax, fabsf(f[j]));
  amax = warp_max(amax);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;

  const int64_t blk = slot / block_size;
  const int64_t off = slot % block_size;
  int8_t* dst = (which ? v_cache : k_cache) + blk * st.blk + off * st.tok + h * st.head +
                lane * PER;
  uint32_t packed[PER / 4 > 0 ? PER / 4 : 1];
#pragma unroll
  for (int j = 0; j < PER / 4; ++j) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      int q = __float2int_rn(f[4 * j + b] * inv);
      q = max(-127, min(127, q));
      word |= ((uint32_t)(q & 0xff)) << (8 * b);
    }
    packed[j] = word;
  }
#pragma unroll
  for (int j = 0; j < PER / 4; ++j) reinterpret_cast<uint32_t*>(dst)[j] = packed[j];
  const int64_t sc = blk * st.sc_blk + off * st.sc_tok + h * st.sc_head;
  if (lane == 0) (which ? v_scale : k_scale)[sc] = amax / 127.f;
}

#ifndef __CUDACC_RTC__
template <int D>
inline void launch_kv_int8_write(const __half* k, const __half* v, int64_t k_tok_stride,
                                 int64_t v_tok_stride, int8_t* k_cache, int8_t* v_cache,
                                 float* k_scale, float* v_scale, const KvCacheStrides& st,
                                 const int64_t* slot_mapping, int num_tokens, int num_heads,
                                 int block_size, cudaStream_t stream) {
  const int64_t rows = (int64_t)num_tokens * num_heads * 2;
  if (rows == 0) return;
  const int blocks = (int)((rows + kKvWriteWarps - 1) / kKvWriteWarps);
  kv_int8_write_kernel<D><<<blocks, kKvWriteWarps * 32, 0, stream>>>(
      k, v, k_tok_stride, v_tok_stride, k_cache, v_cache, k_scale, v_scale, st, slot_mapping,
      num_tokens, num_heads, block_size);
}
#endif

}  // namespace sm70
