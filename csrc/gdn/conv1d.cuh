// Gated DeltaNet causal depthwise conv1d (kernel width 4) with SiLU, over the packed
// q|k|v channels (D = 5120 per GPU at TP=2), in vLLM's SD state layout:
//   conv_state [slots, rows, D] fp16 (rows = 3 + MTP k; D innermost), slot stride free.
//   out_t[d] = silu(bias[d] + sum_j weight[d, j] * seq[t + j][d])  (float32 sums)
// where seq is the sequence's 3-row window followed by its inputs.
//
// Update (decode, 1..1 + k tokens per sequence, one thread per channel pair over all the
// sequence's tokens): the window is rows off .. off + 2 of the state, off = num_accepted - 1
// (0 without num_accepted). Afterwards the state holds, from row 0: without num_accepted
// the last 3 entries of seq; with it seq[1..] (rows off + 1, off + 2, then every input), as
// far as the state has rows, so the next step's off = accepted - 1 finds its window.
// Prefill (varlen sequences of any length): the window is rows 0..2 where
// has_initial_state, else zeros; the state ends with the last 3 entries of seq. Blocks
// take 64-token chunks of a sequence; only chunk 0 reads the initial window, and the same
// thread writes the final state after reading it (later chunks read their window from x),
// so no two blocks touch one state row.
// A sequence whose slot (state_indices column 0) is <= 0 is skipped: zero outputs, no
// state. vllm_patch/ops/reference_gdn.py (conv1d_*_reference) is the definition.
#pragma once

#include "common/sm70.cuh"

namespace sm70 {

constexpr int kConvWidth = 4;
constexpr int kConvThreads = 128;  // each thread: 2 adjacent channels (half2)
constexpr int kConvChunk = 64;     // prefill tokens per block step
constexpr int kConvMaxChunkBlocks = 64;

struct GdnConvParams {
  const __half* x;  // [T, D], token stride x_stride (elements)
  int64_t x_stride;
  __half* out;  // [T, D] contiguous
  __half* state;  // [slots, rows, D]
  int64_t state_slot_stride;
  int state_rows;
  const __half* weight;  // [D, 4] contiguous
  const __half* bias;    // [D] or null
  const int32_t* query_start_loc;  // [N + 1]
  const int32_t* state_indices;    // column 0 of [N, ...], row stride indices_stride
  int64_t indices_stride;
  const int32_t* num_accepted;     // update: [N] or null
  const bool* has_initial_state;   // prefill: [N] or null (every window zero)
  int dim;
  bool silu;
};

struct ConvTaps {
  float2 w[kConvWidth];
  float2 bias;
};

__device__ __forceinline__ ConvTaps conv_taps(const GdnConvParams& p, int c) {
  ConvTaps t;
  // weight rows c and c + 1: 8 contiguous halves
  const uint4 raw = *reinterpret_cast<const uint4*>(p.weight + (int64_t)c * kConvWidth);
  const float2 c0a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));  // w[c][0..1]
  const float2 c0b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));  // w[c][2..3]
  const float2 c1a = __half22float2(*reinterpret_cast<const __half2*>(&raw.z));
  const float2 c1b = __half22float2(*reinterpret_cast<const __half2*>(&raw.w));
  t.w[0] = make_float2(c0a.x, c1a.x);
  t.w[1] = make_float2(c0a.y, c1a.y);
  t.w[2] = make_float2(c0b.x, c1b.x);
  t.w[3] = make_float2(c0b.y, c1b.y);
  t.bias = p.bias ? __half22float2(*reinterpret_cast<const __half2*>(p.bias + c))
                  : make_float2(0.f, 0.f);
  return t;
}

__device__ __forceinline__ float conv_act(float y, bool silu) {
  return silu ? y / (1.f + expf(-y)) : y;
}

// One output pair from the window (oldest first) and the current input.
__device__ __forceinline__ __half2 conv_step(const ConvTaps& t, const __half2 (&win)[3],
                                             __half2 xt, bool silu) {
  float2 acc = t.bias;
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    const float2 v = __half22float2(win[j]);
    acc.x = fmaf(t.w[j].x, v.x, acc.x);
    acc.y = fmaf(t.w[j].y, v.y, acc.y);
  }
  const float2 v = __half22float2(xt);
  acc.x = fmaf(t.w[3].x, v.x, acc.x);
  acc.y = fmaf(t.w[3].y, v.y, acc.y);
  return __floats2half2_rn(conv_act(acc.x, silu), conv_act(acc.y, silu));
}

__device__ __forceinline__ __half2 ld_h2(const __half* p) {
  return *reinterpret_cast<const __half2*>(p);
}
__device__ __forceinline__ void st_h2(__half* p, __half2 v) {
  *reinterpret_cast<__half2*>(p) = v;
}

// grid (ceil(D / 256), N), kConvThreads threads.
__global__ void __launch_bounds__(kConvThreads) gdn_conv1d_update_kernel(const GdnConvParams p) {
  const int c = 2 * (blockIdx.x * kConvThreads + threadIdx.x);
  if (c >= p.dim) return;
  const int n = blockIdx.y;
  const int bos = p.query_start_loc[n];
  const int eos = p.query_start_loc[n + 1];
  if (eos <= bos) return;
  const int64_t slot = p.state_indices[(int64_t)n * p.indices_stride];
  if (slot <= 0) {
    for (int t = bos; t < eos; ++t) st_h2(p.out + (int64_t)t * p.dim + c, __float2half2_rn(0.f));
    return;
  }
  const bool spec = p.num_accepted != nullptr;
  const int off = spec ? min(max(p.num_accepted[n] - 1, 0), p.state_rows - 3) : 0;
  __half* st = p.state + slot * p.state_slot_stride + c;
  const int64_t row = p.dim;  // state row stride
  __half2 win[3];
#pragma unroll
  for (int j = 0; j < 3; ++j) win[j] = ld_h2(st + (off + j) * row);
  const __half2 keep1 = win[1], keep2 = win[2];  // seq[1], seq[2]: the spec state's head
  const ConvTaps taps = conv_taps(p, c);
  for (int t = bos; t < eos; ++t) {
    const __half2 xt = ld_h2(p.x + (int64_t)t * p.x_stride + c);
    st_h2(p.out + (int64_t)t * p.dim + c, conv_step(taps, win, xt, p.silu));
    win[0] = win[1];
    win[1] = win[2];
    win[2] = xt;
  }
  if (spec) {
    // seq[1..]: the two old rows, then every input, as far as the state has rows
    const int len = eos - bos;
    st_h2(st, keep1);
    if (p.state_rows > 1) st_h2(st + row, keep2);
    for (int r = 2; r < p.state_rows && r - 2 < len; ++r)
      st_h2(st + r * row, ld_h2(p.x + (int64_t)(bos + r - 2) * p.x_stride + c));
  } else {
#pragma unroll
    for (int j = 0; j < 3; ++j) st_h2(st + j * row, win[j]);
  }
}

// grid (ceil(D / 256), N, chunk blocks), kConvThreads threads.
__global__ void __launch_bounds__(kConvThreads) gdn_conv1d_prefill_kernel(const GdnConvParams p) {
  const int c = 2 * (blockIdx.x * kConvThreads + threadIdx.x);
  if (c >= p.dim) return;
  const int n = blockIdx.y;
  const int bos = p.query_start_loc[n];
  const int len = p.query_start_loc[n + 1] - bos;
  if (len <= 0) return;
  const int64_t slot = p.state_indices[(int64_t)n * p.indices_stride];
  const __half* x = p.x + (int64_t)bos * p.x_stride + c;
  __half* out = p.out + (int64_t)bos * p.dim + c;
  if (slot <= 0) {
    for (int t = blockIdx.z; t < len; t += gridDim.z)
      st_h2(out + (int64_t)t * p.dim, __float2half2_rn(0.f));
    return;
  }
  __half* st = p.state + slot * p.state_slot_stride + c;
  const int64_t row = p.dim;
  const ConvTaps taps = conv_taps(p, c);
  for (int s = blockIdx.z * kConvChunk; s < len; s += gridDim.z * kConvChunk) {
    __half2 win[3];
    if (s == 0) {
      const bool init = p.has_initial_state && p.has_initial_state[n];
#pragma unroll
      for (int j = 0; j < 3; ++j) win[j] = init ? ld_h2(st + j * row) : __float2half2_rn(0.f);
      // the final state, last 3 of (window ++ x), before any later write could matter
#pragma unroll
      for (int r = 0; r < 3; ++r) {
        const int i = len + r;  // index into seq
        st_h2(st + r * row, i < 3 ? win[i] : ld_h2(x + (int64_t)(i - 3) * p.x_stride));
      }
    } else {
#pragma unroll
      for (int j = 0; j < 3; ++j) win[j] = ld_h2(x + (int64_t)(s - 3 + j) * p.x_stride);
    }
    const int end = min(len, s + kConvChunk);
    for (int t = s; t < end; ++t) {
      const __half2 xt = ld_h2(x + (int64_t)t * p.x_stride);
      st_h2(out + (int64_t)t * p.dim, conv_step(taps, win, xt, p.silu));
      win[0] = win[1];
      win[1] = win[2];
      win[2] = xt;
    }
  }
}

#ifndef __CUDACC_RTC__
inline void launch_gdn_conv1d_update(const GdnConvParams& p, int num_seqs, cudaStream_t stream) {
  if (num_seqs == 0 || p.dim == 0) return;
  const dim3 grid((p.dim / 2 + kConvThreads - 1) / kConvThreads, num_seqs);
  gdn_conv1d_update_kernel<<<grid, kConvThreads, 0, stream>>>(p);
}

// total_tokens sizes the chunk blocks per sequence without reading the lengths on the host
// (one sequence may hold them all).
inline void launch_gdn_conv1d_prefill(const GdnConvParams& p, int num_seqs, int64_t total_tokens,
                                      cudaStream_t stream) {
  if (num_seqs == 0 || p.dim == 0 || total_tokens == 0) return;
  const int64_t chunks = (total_tokens + kConvChunk - 1) / kConvChunk;
  const int z = (int)(chunks < kConvMaxChunkBlocks ? chunks : kConvMaxChunkBlocks);
  const dim3 grid((p.dim / 2 + kConvThreads - 1) / kConvThreads, num_seqs, z);
  gdn_conv1d_prefill_kernel<<<grid, kConvThreads, 0, stream>>>(p);
}
#endif

}  // namespace sm70
