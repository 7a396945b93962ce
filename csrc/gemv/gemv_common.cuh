// GPTQ-int8 GEMV pieces shared by the kernels in gemv/: the weight layout, the block shape
// and the packed-half math of one 16-code chunk.
//
// Weight layout (made at load time by vllm_patch.ops.reference.repack_gptq_int8):
//   qw [N, K] uint8  the GPTQ codes (0..255), output-major so one output row's K codes are
//                    contiguous: a warp streams 512 B per step with 16-byte loads.
//   sz [N, K/G] half2 (scale, zero) per output row and group of G input channels;
//                    w[k, n] = scale * (q - zero). The int8 lm_head uses the same layout with
//                    G = K and zero = 128 (symmetric codes stored as q + 128).
// y[m, n] = sum_k x[m, k] * w[k, n] (+ bias[n]), fp16 in and out, fp32 accumulation.
#pragma once

#include "common/sm70.cuh"

namespace sm70 {

constexpr int kGemvWarps = 4;  // warps per block (128 threads)

// Packed-half math (why and how: gptq_gemv_stream_kernel, gemv/stream.cuh) for one
// 16-code chunk of one row: returns acc + scale * sum_k x_k (q_k - z).
__device__ __forceinline__ float gemv_chunk_h2(const uint4& w, __half2 s, const uint4 (&xv)[2],
                                               float acc) {
  const __half2* xh0 = reinterpret_cast<const __half2*>(&xv[0]);
  const __half2* xh1 = reinterpret_cast<const __half2*>(&xv[1]);
  const __half2 xh[8] = {xh0[0], xh0[1], xh0[2], xh0[3], xh1[0], xh1[1], xh1[2], xh1[3]};
  const __half2 k256 = __float2half2_rn(0.00390625f);
  // -(1024 + z) / 256, exact: z <= 256 is an integer
  const __half zn = __hmul(__hadd(__high2half(s), __float2half(1024.f)),
                           __float2half(-0.00390625f));
  const __half2 zz = __halves2half2(zn, zn);
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w};
  __half2 pa[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t lo = __byte_perm(wv[q], 0x64646464u, 0x5140);  // codes 0, 1
    const uint32_t hi = __byte_perm(wv[q], 0x64646464u, 0x7362);  // codes 2, 3
    const __half2 v0 = __hfma2(*reinterpret_cast<const __half2*>(&lo), k256, zz);
    const __half2 v1 = __hfma2(*reinterpret_cast<const __half2*>(&hi), k256, zz);
    if (q < 2) {
      pa[2 * q] = __hmul2(v0, xh[2 * q]);
      pa[2 * q + 1] = __hmul2(v1, xh[2 * q + 1]);
    } else {
      pa[2 * q - 4] = __hfma2(v0, xh[2 * q], pa[2 * q - 4]);
      pa[2 * q - 3] = __hfma2(v1, xh[2 * q + 1], pa[2 * q - 3]);
    }
  }
  const float2 f0 = __half22float2(__hadd2(pa[0], pa[1]));
  const float2 f1 = __half22float2(__hadd2(pa[2], pa[3]));
  return fmaf(__low2float(s) * 256.f, (f0.x + f0.y) + (f1.x + f1.y), acc);
}
}  // namespace sm70
