// int8 GEMM with a fused, per-row low-rank correction (prefill-sized M):
//   y = x W + mask[m] * ((x A) B) (+ bias)
// W uses the GEMV layout (gemv/gemv_common.cuh: qw [N, K] uint8 + sz [N, K/G] half2). A is
// given transposed, at [r, K] fp16, and B transposed, bt [N, r] fp16, so every weight operand
// is "output-major, reduction contiguous", which is the column-major B operand of m8n8k4.
//
// Two launches of one kernel: (1) t = mask * (x A) with fp16 weights at (N = r), rows with
// mask 0 stored as zeros and fully unmasked tiles skipped; (2) y = [x | t] [W ; B] with
// the int8 codes dequantised to fp16 in shared memory and the correction as extra K steps.
// Rank 0 or no masked row: launch (1) is skipped and (2) runs without the extra steps.
//
// Tile 64 x 64 x 32, 4 warps (2 x 2, 32 x 32 each); per k-step of 4 a warp issues four
// m8n8k4 instructions, instruction j covering row block j and quad pair p column block p.
#pragma once

#include "common/mma.cuh"

namespace sm70 {

constexpr int kGmBM = 64, kGmBN = 64, kGmBK = 32, kGmThreads = 128;
constexpr int kGmPitch = kGmBK + 4;  // halves: conflict-free 8-byte fragment reads

struct LowrankGemmParams {
  const __half* x;        // [M, K], row stride ldx
  const uint8_t* qw;      // [N, K] codes, or nullptr when wh is used
  const __half2* sz;      // [N, K / group_size]
  const __half* wh;       // [N, K] fp16 weights (when qw == nullptr)
  const __half* x2;       // [M, K2] second segment activations (the correction), or nullptr
  const __half* w2;       // [N, K2] second segment weights
  const __half* bias;     // [N] or nullptr
  const uint8_t* row_mask;  // [M]: rows with 0 are written as 0 (launch 1), or nullptr
  __half* y;              // [M, N], row stride ldy
  int64_t ldx, ldx2, ldy;
  int M, N, K, K2, group_size;
};

__global__ void __launch_bounds__(kGmThreads) lowrank_gemm_kernel(const LowrankGemmParams p) {
  __shared__ __align__(16) __half xs[kGmBM * kGmPitch];
  __shared__ __align__(16) __half ws[kGmBN * kGmPitch];
  __shared__ int any_row;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int m0 = blockIdx.y * kGmBM, n0 = blockIdx.x * kGmBN;
  const int qp = (lane >> 2) & 3, hi = lane >> 4, l4 = lane & 3;

  if (p.row_mask != nullptr) {  // launch 1: skip tiles without a corrected row
    if (tid == 0) any_row = 0;
    __syncthreads();
    if (tid < kGmBM && m0 + tid < p.M && p.row_mask[m0 + tid]) any_row = 1;
    __syncthreads();
    if (!any_row) {
      for (int i = tid; i < kGmBM * kGmBN; i += kGmThreads) {
        const int r = m0 + i / kGmBN, c = n0 + i % kGmBN;
        if (r < p.M && c < p.N) p.y[(int64_t)r * p.ldy + c] = __float2half_rn(0.f);
      }
      return;
    }
  }

  const int nk1 = p.K / kGmBK;
  const int nk2 = p.x2 != nullptr ? (p.K2 + kGmBK - 1) / kGmBK : 0;
  const int nkt = nk1 + nk2;
  const int ngroups = p.qw != nullptr ? p.K / p.group_size : 1;

  // loader mapping: activations 64 rows x 32 halves = 256 pieces of 8 halves (2/thread);
  // fp16 weights the same; int8 weights 64 rows x 32 codes = 128 pieces of 16 (1/thread)
  uint4 xr[2], wr[2];
  __half2 szr = __floats2half2_rn(0.f, 0.f);
  auto load = [&](int kt) {
    const bool seg2 = kt >= nk1;
    const int kb = seg2 ? (kt - nk1) * kGmBK : kt * kGmBK;
    const int kmax = seg2 ? p.K2 : p.K;
    const __half* xa = seg2 ? p.x2 : p.x;
    const int64_t lda = seg2 ? p.ldx2 : p.ldx;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int piece = tid + j * kGmThreads;
      const int r = piece >> 2, c = (piece & 3) * 8;
      const bool ok = m0 + r < p.M && kb + c + 8 <= kmax;
      xr[j] = ok ? *reinterpret_cast<const uint4*>(xa + (int64_t)(m0 + r) * lda + kb + c)
                 : make_uint4(0u, 0u, 0u, 0u);
    }
    if (!seg2 && p.qw != nullptr) {
      const int r = tid >> 1, c = (tid & 1) * 16;
      const bool ok = n0 + r < p.N;
      wr[0] = ok ? __ldg(reinterpret_cast<const uint4*>(p.qw + (int64_t)(n0 + r) * p.K + kb + c))
                 : make_uint4(0u, 0u, 0u, 0u);
      szr = ok ? __ldg(p.sz + (int64_t)(n0 + r) * ngroups + (kb + c) / p.group_size)
               : __floats2half2_rn(0.f, 0.f);
    } else {
      const __half* wa = seg2 ? p.w2 : p.wh;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int piece = tid + j * kGmThreads;
        const int r = piece >> 2, c = (piece & 3) * 8;
        const bool ok = n0 + r < p.N && kb + c + 8 <= kmax;
        wr[j] = ok ? __ldg(reinterpret_cast<const uint4*>(wa + (int64_t)(n0 + r) * kmax + kb + c))
                   : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  auto store = [&](int kt) {
    const bool seg2 = kt >= nk1;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int piece = tid + j * kGmThreads;
      const int r = piece >> 2, c = (piece & 3) * 8;
      uint2* d = reinterpret_cast<uint2*>(&xs[r * kGmPitch + c]);
      d[0] = make_uint2(xr[j].x, xr[j].y);
      d[1] = make_uint2(xr[j].z, xr[j].w);
    }
    if (!seg2 && p.qw != nullptr) {
      const int r = tid >> 1, c = (tid & 1) * 16;
      // (q - zero) is exact in fp16; one rounding for the scale
      const __half zb = __hadd(__float2half_rn(1024.f), __high2half(szr));
      const __half2 zz = __halves2half2(zb, zb);
      const __half2 sc = __low2half2(szr);
      const uint32_t wv[4] = {wr[0].x, wr[0].y, wr[0].z, wr[0].w};
      uint32_t out[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t lo = __byte_perm(wv[j], 0x64646464u, 0x4140);
        const uint32_t hh = __byte_perm(wv[j], 0x64646464u, 0x4342);
        __half2 a = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&lo), zz), sc);
        __half2 bq = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&hh), zz), sc);
        out[2 * j] = *reinterpret_cast<uint32_t*>(&a);
        out[2 * j + 1] = *reinterpret_cast<uint32_t*>(&bq);
      }
      uint2* d = reinterpret_cast<uint2*>(&ws[r * kGmPitch + c]);
#pragma unroll
      for (int j = 0; j < 4; ++j) d[j] = make_uint2(out[2 * j], out[2 * j + 1]);
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int piece = tid + j * kGmThreads;
        const int r = piece >> 2, c = (piece & 3) * 8;
        uint2* d = reinterpret_cast<uint2*>(&ws[r * kGmPitch + c]);
        d[0] = make_uint2(wr[j].x, wr[j].y);
        d[1] = make_uint2(wr[j].z, wr[j].w);
      }
    }
  };

  float acc[4][8];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;

  if (nkt > 0) load(0);
  for (int kt = 0; kt < nkt; ++kt) {
    __syncthreads();
    store(kt);
    __syncthreads();
    if (kt + 1 < nkt) load(kt + 1);
#pragma unroll
    for (int kk = 0; kk < kGmBK / 4; ++kk) {
      const uint2 b2 = *reinterpret_cast<const uint2*>(
          &ws[(wn * 32 + qp * 8 + l4 + 4 * hi) * kGmPitch + 4 * kk]);
      const uint32_t bb[2] = {b2.x, b2.y};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint2 a2 = *reinterpret_cast<const uint2*>(
            &xs[(wm * 32 + j * 8 + l4 + 4 * hi) * kGmPitch + 4 * kk]);
        const uint32_t a[2] = {a2.x, a2.y};
        mma_m8n8k4(acc[j], a, bb);
      }
    }
  }

#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = m0 + wm * 32 + j * 8 + (lane & 1) + (i & 2) + 4 * hi;
      const int c = n0 + wn * 32 + qp * 8 + (i & 4) + (lane & 2) + (i & 1);
      if (r < p.M && c < p.N) {
        float v = acc[j][i];
        if (p.bias != nullptr) v += __half2float(p.bias[c]);
        if (p.row_mask != nullptr && !p.row_mask[r]) v = 0.f;
        p.y[(int64_t)r * p.ldy + c] = __float2half_rn(v);
      }
    }
  }
}

#ifndef __CUDACC_RTC__
inline void launch_lowrank_gemm(const LowrankGemmParams& p, cudaStream_t stream) {
  dim3 grid((p.N + kGmBN - 1) / kGmBN, (p.M + kGmBM - 1) / kGmBM);
  lowrank_gemm_kernel<<<grid, kGmThreads, 0, stream>>>(p);
}
#endif

}  // namespace sm70
