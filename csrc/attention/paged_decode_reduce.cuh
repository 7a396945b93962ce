// Paged decode attention: the reduce that combines a sequence's split partials
// (attention/paged_decode.cuh writes them).
#pragma once

#include "attention/decode_common.cuh"

namespace sm70 {

// Combine the splits. One block per (sequence, KV head, row, 16-dim slice), 256 threads:
// 4 lanes of 4 dims x 64 groups of splits. Each thread loads the (max, sum) of splits tid,
// tid + 256, .. and its first 4 fp16 partials (every 64th split) at once, one round trip
// for up to 256 splits (32 registers, so the many small blocks stay one wave); each partial
// is weighted by exp2(m - max) * l, and the weighted sums meet in shared memory. (One
// thread per dim walking all splits gave a dozen blocks at batch 1: latency-bound, as long
// as the decode kernel itself.)
constexpr int kPdRedThreads = 256;
constexpr int kPdRedDims = 16;                             // dims per reduce block
constexpr int kPdRedLanes = kPdRedDims / 4;                // float4 lanes
constexpr int kPdRedGroups = kPdRedThreads / kPdRedLanes;  // split groups (64)
constexpr int kPdRedPerThread = kPdMaxSplits / kPdRedThreads;
constexpr int kPdRedPre = 4;  // partials per thread loaded up front (up to 256 splits)

template <int G, int QN, bool BATCHED = false>
__global__ void __launch_bounds__(kPdRedThreads)
    paged_decode_reduce_kernel(const PagedDecodeParams p) {
  constexpr int D = kPdHeadDim;
  constexpr int R = G * QN;
  constexpr int NQ = D / kPdRedDims;
  __shared__ float wgt[kPdMaxSplits];
  __shared__ float red[kPdRedThreads / 32];
  __shared__ __align__(16) float4 acc_s[kPdRedGroups][kPdRedLanes];
  const int dq = blockIdx.x % NQ;
  const int row = (blockIdx.x / NQ) % R;
  const int kvh = (blockIdx.x / (NQ * R)) % p.num_kv_heads;
  const int b = blockIdx.x / (NQ * R * p.num_kv_heads);
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  // this sequence's chunks: the range the decode kernel's schedule recorded (batched), else
  // every split of the one sequence (splits past the context hold empty partials)
  const int S = BATCHED ? p.sched[2 * b + 1] : p.num_splits;
  const int64_t base = (int64_t)kvh * p.num_splits * p.batch + (BATCHED ? p.sched[2 * b] : 0);
  // this thread's partials (every 64th split, 4 dims) are loaded before the weights are
  // known, beside the (max, sum) loads: one global round trip instead of two
  const int dl = tid % kPdRedLanes, sg = tid / kPdRedLanes;
  const __half* po = p.part_o + (base * R + row) * D + kPdRedDims * dq + 4 * dl;
  auto load4 = [&](int s) {  // 4 fp16 dims of split s's partial
    const uint2 u = *reinterpret_cast<const uint2*>(po + (int64_t)s * R * D);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, c.x, c.y);
  };
  float4 pv[kPdRedPre];
#pragma unroll
  for (int j = 0; j < kPdRedPre; ++j) {
    const int s = sg + j * kPdRedGroups;
    pv[j] = s < S ? load4(s) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float ms[kPdRedPerThread], ls[kPdRedPerThread];
  float mx = kNegInf;
#pragma unroll
  for (int i = 0; i < kPdRedPerThread; ++i) {
    const int s = tid + i * kPdRedThreads;
    ms[i] = kNegInf;
    ls[i] = 0.f;
    if (s < S) {
      const float2 ml = *reinterpret_cast<const float2*>(p.part_ml + ((base + s) * R + row) * 2);
      ms[i] = ml.x;
      ls[i] = ml.y;
    }
    mx = fmaxf(mx, ms[i]);
  }
  mx = warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < kPdRedThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  const float m_use = mx == kNegInf ? 0.f : mx;
  float den = 0.f;
#pragma unroll
  for (int i = 0; i < kPdRedPerThread; ++i) {
    const int s = tid + i * kPdRedThreads;
    const float w = exp2f(ms[i] - m_use) * ls[i];  // the partials are already divided by l
    if (s < S) wgt[s] = w;
    den += w;
  }
  den = warp_sum(den);
  __syncthreads();  // everyone has read red (the max) before it is reused
  if (lane == 0) red[warp] = den;
  __syncthreads();  // wgt and red complete
  den = 0.f;
#pragma unroll
  for (int w = 0; w < kPdRedThreads / 32; ++w) den += red[w];
  float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float w, const float4& v) {
    num.x += w * v.x;
    num.y += w * v.y;
    num.z += w * v.z;
    num.w += w * v.w;
  };
#pragma unroll
  for (int j = 0; j < kPdRedPre; ++j) {
    const int s = sg + j * kPdRedGroups;
    add(s < S ? wgt[s] : 0.f, pv[j]);
  }
#pragma unroll 4
  for (int s = sg + kPdRedPre * kPdRedGroups; s < S; s += kPdRedGroups)  // S > 256 only
    add(wgt[s], load4(s));
  acc_s[sg][dl] = num;
  __syncthreads();
  if (tid < kPdRedDims) {
    const int l = tid / 4, c = tid % 4;
    float v = 0.f;
#pragma unroll 8
    for (int g2 = 0; g2 < kPdRedGroups; ++g2) v += reinterpret_cast<const float*>(&acc_s[g2][l])[c];
    const int g = row / QN, qi = row % QN;
    p.out[(int64_t)(b * QN + qi) * p.out_tok_stride + (int64_t)(kvh * G + g) * D +
          kPdRedDims * dq + tid] = __float2half_rn(den > 0.f ? v / den : 0.f);
  }
}

}  // namespace sm70
