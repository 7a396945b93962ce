// The classic GPTQ-int8 GEMV for M = 2..8 activation rows (layout: gemv/gemv_common.cuh),
// the fallback where the tensor-core kernel's K rules do not hold (K or the group size not
// a multiple of 128) and for small N (gemv/launch.cuh says when).
//
// ksplit = 1: each warp owns R output rows and streams their whole K (large N).
// ksplit = 4: the block's 4 warps share R rows and split K (warp w takes chunk steps w,
// w+4, ...), so few rows still fill the GPU; a shared-memory sum joins them. Each lane
// takes 16-byte chunks (16 codes, all inside one group since G % 16 == 0), U per row in
// flight. Codes become exact floats with a prmt "magic number" (no int->float conversion),
// so the inner loop is one prmt, one add and M fused multiply-adds per weight byte. The x
// chunk is read once per lane and reused for the R rows.
#pragma once

#include "gemv/gemv_common.cuh"

namespace sm70 {

template <int M>
struct GemvRows {
  // rows per block: more rows amortise the x reads; fewer keep registers down at large M
  static constexpr int value = M <= 4 ? 4 : 2;
};

constexpr int kGemvClassicUnroll = 2;  // chunks per row in flight per lane

template <int M, int R>
__global__ void __launch_bounds__(kGemvWarps * 32, 1)
    gptq_gemv_kernel(const __half* __restrict__ x,     // [M, K]
                     const uint8_t* __restrict__ qw,   // [N, K]
                     const __half2* __restrict__ sz,   // [N, K / G]
                     const __half* __restrict__ bias,  // [N] or nullptr
                     __half* __restrict__ y,           // [M, N]
                     int N, int K, int group_size, int ksplit) {
  static_assert(M >= 2 && M <= 8, "M = 1 runs gptq_gemv_stream_kernel (gemv/stream.cuh)");
  constexpr int U = kGemvClassicUnroll;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nw = ksplit == 1 ? 1 : kGemvWarps;  // warps sharing one set of rows
  const int kw = ksplit == 1 ? 0 : warp;        // this warp's K slice
  const int n0 = (ksplit == 1 ? blockIdx.x * kGemvWarps + warp : blockIdx.x) * R;
  __shared__ float red[kGemvWarps][R * M];
  if (ksplit == 1 && n0 >= N) return;
  const int nchunks = K >> 4;
  const int ngroups = K / group_size;

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

  // rows past N re-read row N-1 (never written back): keeps the loop free of branches
  int nrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) nrow[r] = min(n0 + r, N - 1);

  // One step: issue all U*R 16-byte loads, then the math. (Double-buffering the next step's
  // loads costs registers, and the occupancy it cuts outweighs the overlap it gains.)
  const int step = 32 * nw * U;
  auto load_step = [&](int c0, uint4 (&w)[U][R], __half2 (&s)[U][R]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + (u * nw + kw) * 32 + lane;
      const bool ok = c < nchunks;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (ok) {
          w[u][r] = __ldg(reinterpret_cast<const uint4*>(qw + (size_t)nrow[r] * K) + c);
          s[u][r] = __ldg(sz + (size_t)nrow[r] * ngroups + (c * 16) / group_size);
        } else {
          w[u][r] = make_uint4(0u, 0u, 0u, 0u);
          s[u][r] = __floats2half2_rn(0.f, 0.f);
        }
      }
    }
  };
  auto compute_step = [&](int c0, const uint4 (&w)[U][R], const __half2 (&s)[U][R]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + (u * nw + kw) * 32 + lane;
      if (c >= nchunks) continue;
      float p[R][M];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) p[r][m] = 0.f;
      float zf[R];
#pragma unroll
      for (int r = 0; r < R; ++r) zf[r] = 8388608.f + __high2float(s[u][r]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // two halves of 8 codes keep x in 8*M registers
        float xf[M][8];
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K) + 2 * c + h);
          const __half2* xh = reinterpret_cast<const __half2*>(&xv);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(xh[j]);
            xf[m][2 * j] = f.x;
            xf[m][2 * j + 1] = f.y;
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t wa = h ? w[u][r].z : w[u][r].x;
          const uint32_t wb = h ? w[u][r].w : w[u][r].y;
          float wf[8];
          wf[0] = u8_magic<0>(wa) - zf[r];
          wf[1] = u8_magic<1>(wa) - zf[r];
          wf[2] = u8_magic<2>(wa) - zf[r];
          wf[3] = u8_magic<3>(wa) - zf[r];
          wf[4] = u8_magic<0>(wb) - zf[r];
          wf[5] = u8_magic<1>(wb) - zf[r];
          wf[6] = u8_magic<2>(wb) - zf[r];
          wf[7] = u8_magic<3>(wb) - zf[r];
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int m = 0; m < M; ++m) p[r][m] = fmaf(xf[m][j], wf[j], p[r][m]);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float sc = __low2float(s[u][r]);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = fmaf(sc, p[r][m], acc[r][m]);
      }
    }
  };

  for (int c0 = 0; c0 < nchunks; c0 += step) {
    uint4 w[U][R];
    __half2 s[U][R];
    load_step(c0, w, s);
    compute_step(c0, w, s);
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = warp_sum(acc[r][m]);
      if (ksplit == 1) {
        const int n = n0 + r;
        if (lane == ((r * M + m) & 31) && n < N) {
          const float b = bias != nullptr ? __half2float(bias[n]) : 0.f;
          y[(size_t)m * N + n] = __float2half_rn(v + b);
        }
      } else if (lane == 0) {
        red[warp][r * M + m] = v;
      }
    }
  }
  if (ksplit == 1) return;
  __syncthreads();
  for (int i = threadIdx.x; i < R * M; i += kGemvWarps * 32) {
    const int r = i / M, m = i % M;
    const int n = n0 + r;
    if (n < N) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; ++w) v += red[w][i];
      if (bias != nullptr) v += __half2float(bias[n]);
      y[(size_t)m * N + n] = __float2half_rn(v);
    }
  }
}

}  // namespace sm70
