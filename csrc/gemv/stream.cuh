// The M = 1 GPTQ-int8 GEMV (decode): streamed, software-pipelined, packed-half math, two
// rows per warp (layout: gemv/gemv_common.cuh).
//
// Same layout and K split as gptq_gemv_kernel (gemv/classic.cuh), but pipelined: the loads
// of the lane's next chunk step (R rows of codes, their (scale, zero) words and the
// matching x chunk) are issued before the current step is computed, so a warp always has
// one step of loads in flight instead of alternating load-wait-compute. A memory-bound
// GEMV needs many bytes in flight per SM (Little's law: bandwidth x loaded latency), and
// the 4-8K-row shapes give few warps per SM, so the bytes have to come from each warp as
// well as from more warps. x is prefetched with the codes, so the math never waits on a
// dependent L1/L2 round trip for it.
//
// Packed-half math: the fp32 path (prmt + fsub + ffma per weight byte plus the x
// conversions) is issue-bound before it is memory-bound. Here two codes become one half2
// (1024 + q) with one prmt, one HFMA2 makes the exact (q - z) / 256 and one HFMA2
// multiplies by x and accumulates: about 2.2 instructions per byte instead of 3.3. The
// / 256 keeps each product within |x| (exact power-of-two scaling), so a fp16 partial of
// 4 products cannot overflow for |x| < 16384; the partials of each 16-code chunk go to the
// fp32 accumulator with the group scale (x 256). Rounding: one fp16 rounding per product
// and per partial add, about 5e-4 relative per chunk, averaging out over K.
//
// R = 2 rows per warp fits 64 registers, so 8 blocks (32 warps) per SM: more warps cover a
// warp's math better than a deeper pipeline per warp, and twice the warps with half the
// bytes each keep as many loads in flight.
//
// Grid: blocks below ks1_blocks give each warp its own R rows (ksplit 1); the blocks after
// them share one row set between their 4 warps, which split K (ksplit 4). All blocks of one
// kind (ks1_blocks = gridDim.x or 0), or a K-split tail after the ksplit-1 blocks
// (gptq_gemv_stream_tail in gemv/launch.cuh): the short K-split blocks are dispatched last
// (blocks start in index order) and even out the SMs' ends.
#pragma once

#include "gemv/gemv_common.cuh"

namespace sm70 {

constexpr int kGemvStreamRows = 2;         // rows per warp
constexpr int kGemvStreamBlocksPerSm = 8;  // resident blocks per SM (64 registers a thread)

template <int R>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvStreamBlocksPerSm)
    gptq_gemv_stream_kernel(const __half* __restrict__ x,     // [1, K]
                            const uint8_t* __restrict__ qw,   // [N, K]
                            const __half2* __restrict__ sz,   // [N, K / G]
                            const __half* __restrict__ bias,  // [N] or nullptr
                            __half* __restrict__ y,           // [1, N]
                            int N, int K, int group_size, int ks1_blocks) {
  static_assert(R == 2, "the 8-blocks-per-SM register budget (64) holds for R = 2");
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int ksplit = (int)blockIdx.x < ks1_blocks ? 1 : kGemvWarps;
  const int nw = ksplit == 1 ? 1 : kGemvWarps;
  const int kw = ksplit == 1 ? 0 : warp;
  const int n0 = (ksplit == 1 ? blockIdx.x * kGemvWarps + warp
                              : ks1_blocks * kGemvWarps + (blockIdx.x - ks1_blocks)) * R;
  __shared__ float red[kGemvWarps][R];
  if (ksplit == 1 && n0 >= N) return;
  const int nchunks = K >> 4;
  const int ngroups = K / group_size;
  const int cpg = group_size >> 4;  // chunks per group

  const uint4* wrow[R];
  const __half2* srow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = min(n0 + r, N - 1);  // rows past N re-read row N-1, never written
    wrow[r] = reinterpret_cast<const uint4*>(qw + (size_t)n * K);
    srow[r] = sz + (size_t)n * ngroups;
  }
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  struct Stage {
    uint4 w[R];
    __half2 s[R];
    uint4 xv[2];
  };
  const int step = 32 * nw;  // between a lane's chunks
  auto load = [&](int c, Stage& st) {
    if (c < nchunks) {
#pragma unroll
      for (int r = 0; r < R; ++r) st.w[r] = __ldg(wrow[r] + c);
#pragma unroll
      for (int r = 0; r < R; ++r) st.s[r] = __ldg(srow[r] + c / cpg);
      st.xv[0] = __ldg(x4 + 2 * c);
      st.xv[1] = __ldg(x4 + 2 * c + 1);
    }
  };
  auto compute = [&](int c, const Stage& st) {
    if (c >= nchunks) return;
    uint4 xv[2];
    xv[0] = st.xv[0];
    xv[1] = st.xv[1];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = gemv_chunk_h2(st.w[r], st.s[r], xv, acc[r]);
  };

  Stage a, b;
  int c = kw * 32 + lane;
  load(c, a);
  for (; c < nchunks; c += 2 * step) {
    load(c + step, b);
    compute(c, a);
    load(c + 2 * step, a);
    compute(c + step, b);
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float v = warp_sum(acc[r]);
    if (ksplit == 1) {
      const int n = n0 + r;
      if (lane == r && n < N) {
        const float bv = bias != nullptr ? __half2float(bias[n]) : 0.f;
        y[n] = __float2half_rn(v + bv);
      }
    } else if (lane == 0) {
      red[warp][r] = v;
    }
  }
  if (ksplit == 1) return;
  __syncthreads();
  if (threadIdx.x < R) {
    const int n = n0 + threadIdx.x;
    if (n < N) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; ++w) v += red[w][threadIdx.x];
      if (bias != nullptr) v += __half2float(bias[n]);
      y[n] = __float2half_rn(v);
    }
  }
}

}  // namespace sm70
