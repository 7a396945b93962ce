// Gated DeltaNet recurrent decode: 1..S tokens per sequence (S = 1 + MTP k) against the
// per-sequence state h [HV, dv, dk], one state slot per token position (vLLM's
// spec_state_indices_tensor [N, S]; a plain decode passes [N] and S = 1).
//
// Per token of sequence n and value head hv (key head hv / (HV / H)):
//   qn = q / sqrt(|q|^2 + 1e-6) * scale,  kn = k / sqrt(|k|^2 + 1e-6)
//   g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
//   h <- exp(g) h;  u = beta (v - h kn);  h <- h + u kn^T;  o = h qn   (all float32)
// The initial state is read from column num_accepted[n] - 1 of the sequence's indices
// (column 0 without num_accepted); token t stores its state to column t when that slot is
// > 0. A sequence whose initial slot is <= 0 (vLLM's null block, padding) writes zero
// outputs and touches no state. vllm_patch/ops/reference_gdn.py is the definition.
//
// Work split: one block of 4 warps per (16 rows of one head, sequence); 8 lanes share a
// row, each lane holding 16 of its 128 values (k = 32 i + 4 j + c, so the 8 lanes of a row
// read 128 contiguous bytes per load). Row dot products are 3 shuffles within the 8 lanes.
// The block's control flow depends only on (sequence, head), so every shuffle has the
// whole warp. The state stays in registers across the sequence's tokens.
//
// State storage: float32, or int16 codes with one float32 scale per row
// (state_scale [slots, HV, dv], h ~= scale * code, scale = max |row| / 32767): the row's
// 8 lanes find its max with 3 shuffles when storing.
#pragma once

#include "common/sm70.cuh"
#include "gdn/inputs.cuh"

namespace sm70 {

constexpr int kGdnDk = 128;  // key head size
constexpr int kGdnDv = 128;  // value head size (state rows per head)
constexpr int kGdnThreads = 128;
constexpr int kGdnRowLanes = 8;                               // lanes sharing one row
constexpr int kGdnPer = kGdnDk / kGdnRowLanes;                // values per lane (16)
constexpr int kGdnRowsPerBlock = kGdnThreads / kGdnRowLanes;  // 16
constexpr int kGdnMaxCols = 8;                                // state columns: 1 + k, k <= 7

struct GdnRecurrentParams : GdnInputs {
  void* state;                // [slots, HV, dv, dk] float or int16, slot stride below
  int64_t state_slot_stride;  // elements
  float* state_scale;         // int16 only: [slots, HV, dv], slot stride below
  int64_t scale_slot_stride;
  const int32_t* query_start_loc;  // [N + 1]
  const int32_t* state_indices;    // [N, cols], row stride indices_stride
  int64_t indices_stride;
  int cols;
  const int32_t* num_accepted;  // [N] or null
  __half* out;                  // [T, HV, dv]
  int num_k_heads;
  int num_v_heads;
  float scale;
};

__device__ __forceinline__ float gdn_row_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  return v;
}

__device__ __forceinline__ float gdn_row_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
  return v;
}

// This lane's 16 values of a 128-wide fp16 head (4 loads of 4 halves).
__device__ __forceinline__ void gdn_load_head(const __half* head, int j, float (&f)[kGdnPer]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint2 w = *reinterpret_cast<const uint2*>(head + 32 * i + 4 * j);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
    f[4 * i] = lo.x;
    f[4 * i + 1] = lo.y;
    f[4 * i + 2] = hi.x;
    f[4 * i + 3] = hi.y;
  }
}

// Load / store of one state row's 16 values of this lane (row = its 128 values).
template <class S>
struct GdnStateRow;

template <>
struct GdnStateRow<float> {
  static __device__ __forceinline__ void load(const float* row, const float*, int j,
                                              float (&h)[kGdnPer]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 w = *reinterpret_cast<const float4*>(row + 32 * i + 4 * j);
      h[4 * i] = w.x;
      h[4 * i + 1] = w.y;
      h[4 * i + 2] = w.z;
      h[4 * i + 3] = w.w;
    }
  }
  static __device__ __forceinline__ void store(float* row, float*, int j,
                                               const float (&h)[kGdnPer]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<float4*>(row + 32 * i + 4 * j) =
          make_float4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
  }
};

template <>
struct GdnStateRow<short> {
  static __device__ __forceinline__ void load(const short* row, const float* scale, int j,
                                              float (&h)[kGdnPer]) {
    const float s = *scale;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint2 w = *reinterpret_cast<const uint2*>(row + 32 * i + 4 * j);
      h[4 * i] = s * (float)(short)(w.x & 0xffffu);
      h[4 * i + 1] = s * (float)(short)(w.x >> 16);
      h[4 * i + 2] = s * (float)(short)(w.y & 0xffffu);
      h[4 * i + 3] = s * (float)(short)(w.y >> 16);
    }
  }
  static __device__ __forceinline__ uint32_t code(float x, float inv) {
    const int c = max(-32767, min(32767, __float2int_rn(x * inv)));
    return (uint32_t)(c & 0xffff);
  }
  static __device__ __forceinline__ void store(short* row, float* scale, int j,
                                               const float (&h)[kGdnPer]) {
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < kGdnPer; ++e) amax = fmaxf(amax, fabsf(h[e]));
    amax = gdn_row_max(amax);
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint2 w;
      w.x = code(h[4 * i], inv) | (code(h[4 * i + 1], inv) << 16);
      w.y = code(h[4 * i + 2], inv) | (code(h[4 * i + 3], inv) << 16);
      *reinterpret_cast<uint2*>(row + 32 * i + 4 * j) = w;
    }
    if (j == 0) *scale = amax / 32767.f;
  }
};

// grid (dv / 16, HV, N), kGdnThreads threads.
template <class S>
__global__ void __launch_bounds__(kGdnThreads) gdn_recurrent_kernel(const GdnRecurrentParams p) {
  const int n = blockIdx.z;
  const int hv = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int j = lane & (kGdnRowLanes - 1);
  const int v = blockIdx.x * kGdnRowsPerBlock + (threadIdx.x >> 3);
  const int bos = p.query_start_loc[n];
  const int eos = p.query_start_loc[n + 1];
  if (eos <= bos) return;
  const int32_t* idx = p.state_indices + (int64_t)n * p.indices_stride;
  const int col0 = p.num_accepted ? min(max(p.num_accepted[n] - 1, 0), p.cols - 1) : 0;
  const int64_t slot0 = idx[col0];
  __half* out = p.out + (int64_t)hv * kGdnDv + v;
  const int64_t out_tok = (int64_t)p.num_v_heads * kGdnDv;
  if (slot0 <= 0) {  // padding: zero output, no state
    if (j == 0)
      for (int t = bos; t < eos; ++t) out[t * out_tok] = __float2half(0.f);
    return;
  }
  const int h = hv / (p.num_v_heads / p.num_k_heads);
  const int64_t row_off = ((int64_t)hv * kGdnDv + v) * kGdnDk;
  const int64_t scale_off = (int64_t)hv * kGdnDv + v;
  S* state = reinterpret_cast<S*>(p.state);

  float st[kGdnPer];
  GdnStateRow<S>::load(state + slot0 * p.state_slot_stride + row_off,
                       p.state_scale + slot0 * p.scale_slot_stride + scale_off, j, st);
  const GdnHeadGate hg = gdn_head_gate(p, hv);
  const int q_off = h * kGdnDk;
  const int k_off = (p.num_k_heads + h) * kGdnDk;
  const int v_off = 2 * p.num_k_heads * kGdnDk + hv * kGdnDv + v;

  for (int t = bos; t < eos; ++t) {
    const __half* row = p.qkv + (int64_t)t * p.qkv_stride;
    float qf[kGdnPer], kf[kGdnPer];
    gdn_load_head(row + q_off, j, qf);
    gdn_load_head(row + k_off, j, kf);
    const float vin = __half2float(row[v_off]);
    float qq = 0.f, kk = 0.f;
#pragma unroll
    for (int e = 0; e < kGdnPer; ++e) {
      qq = fmaf(qf[e], qf[e], qq);
      kk = fmaf(kf[e], kf[e], kk);
    }
    const float qs = rsqrtf(gdn_row_sum(qq) + 1e-6f) * p.scale;
    const float ks = rsqrtf(gdn_row_sum(kk) + 1e-6f);
    float g, beta;
    gdn_gate(p, hg, t, hv, g, beta);
    const float decay = expf(g);
    float hk = 0.f;
#pragma unroll
    for (int e = 0; e < kGdnPer; ++e) {
      st[e] *= decay;
      hk = fmaf(st[e], kf[e], hk);
    }
    // h kn = (h k) ks; the update adds u kn = (u ks) k
    const float uk = beta * (vin - gdn_row_sum(hk) * ks) * ks;
    float o = 0.f;
#pragma unroll
    for (int e = 0; e < kGdnPer; ++e) {
      st[e] = fmaf(uk, kf[e], st[e]);
      o = fmaf(st[e], qf[e], o);
    }
    o = gdn_row_sum(o) * qs;
    if (j == 0) out[t * out_tok] = __float2half_rn(o);
    const int col = t - bos;
    if (col < p.cols) {
      const int64_t slot = idx[col];
      if (slot > 0)
        GdnStateRow<S>::store(state + slot * p.state_slot_stride + row_off,
                              p.state_scale + slot * p.scale_slot_stride + scale_off, j, st);
    }
  }
}

#ifndef __CUDACC_RTC__
template <class S>
inline void launch_gdn_recurrent(const GdnRecurrentParams& p, int num_seqs,
                                 cudaStream_t stream) {
  if (num_seqs == 0) return;
  const dim3 grid(kGdnDv / kGdnRowsPerBlock, p.num_v_heads, num_seqs);
  gdn_recurrent_kernel<S><<<grid, kGdnThreads, 0, stream>>>(p);
}
#endif

}  // namespace sm70
