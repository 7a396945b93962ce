// GPTQ-int8 GEMV / small GEMM for decode and MTP verification (M = 1..8 rows).
//
// Weight layout (made at load time by sm70ctl.kernels.reference.repack_gptq_int8):
//   qw [N, K] uint8  the GPTQ codes (0..255), output-major so one output row's K codes are
//                    contiguous: a warp streams 512 B per step with 16-byte loads.
//   sz [N, K/G] half2 (scale, zero) per output row and group of G input channels;
//                    w[k, n] = scale * (q - zero). The int8 lm_head uses the same layout with
//                    G = K and zero = 128 (symmetric codes stored as q + 128).
// y[m, n] = sum_k x[m, k] * w[k, n] (+ bias[n]), fp16 in and out, fp32 accumulation.
//
// ksplit = 1: each warp owns R output rows and streams their whole K (large N: lm_head).
// ksplit = 4: the block's 4 warps share R rows and split K (warp w takes chunk steps w,
// w+4, ...), so N = 3-8K rows still fill the GPU; a shared-memory sum joins them. Each lane
// takes 16-byte chunks (16 codes, all inside one group since G % 16 == 0), U per row in
// flight. Codes become exact floats with a prmt "magic number" (no int->float conversion),
// so the inner loop is one prmt, one add and M fused multiply-adds per weight byte. The x
// chunk is read once per lane and reused for the R rows. M = 1 (decode) runs the
// software-pipelined gptq_gemv_stream_kernel below by default; this classic kernel serves
// M = 2..8 (and M = 1 when forced with kernel = 1).
#pragma once

#include "sm70_common.cuh"

namespace sm70 {

constexpr int kGemvWarps = 4;  // warps per block (128 threads)

template <int M>
struct GemvRows {
  // rows per block: more rows amortise the x reads; fewer keep registers down at large M
  static constexpr int value = M <= 4 ? 4 : 2;
};

template <int M>
struct GemvUnroll {
  // chunks per row in flight per lane
  static constexpr int value = 2;
};

template <int M, int R>
__global__ void __launch_bounds__(kGemvWarps * 32, M == 1 ? 5 : 1)
    gptq_gemv_kernel(const __half* __restrict__ x,     // [M, K]
                     const uint8_t* __restrict__ qw,   // [N, K]
                     const __half2* __restrict__ sz,   // [N, K / G]
                     const __half* __restrict__ bias,  // [N] or nullptr
                     __half* __restrict__ y,           // [M, N]
                     int N, int K, int group_size, int ksplit) {
  constexpr int U = GemvUnroll<M>::value;
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

  // One step: issue all U*R 16-byte loads, then the math. (A double-buffered variant that
  // issued the next step's loads first measured slower on the H200: 128 registers cut
  // occupancy more than the overlap gained.)
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

// Streamed M = 1 kernel (decode). Same layout, math and K split as gptq_gemv_kernel, but
// software-pipelined: the loads of the lane's next chunk step (R rows x U chunks of codes,
// their (scale, zero) words and the matching x chunk) are issued before the current step
// is computed, so a warp always has one step of loads in flight instead of alternating
// load-wait-compute. The H200 needs about 40 KB in flight per SM (Little's law at
// 4.8 TB/s and ~1 us loaded latency); the 4-8K-row shapes give only 10-14 warps per SM, so
// the bytes have to come from each warp rather than from more warps. x is prefetched with
// the codes (it was loaded inside the math before, one dependent L1/L2 round trip per step).
template <int R, int U>
__global__ void __launch_bounds__(kGemvWarps * 32, U == 1 ? 4 : 3)
    gptq_gemv_stream_kernel(const __half* __restrict__ x,     // [1, K]
                            const uint8_t* __restrict__ qw,   // [N, K]
                            const __half2* __restrict__ sz,   // [N, K / G]
                            const __half* __restrict__ bias,  // [N] or nullptr
                            __half* __restrict__ y,           // [1, N]
                            int N, int K, int group_size, int ksplit) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nw = ksplit == 1 ? 1 : kGemvWarps;
  const int kw = ksplit == 1 ? 0 : warp;
  const int n0 = (ksplit == 1 ? blockIdx.x * kGemvWarps + warp : blockIdx.x) * R;
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
    uint4 w[U][R];
    __half2 s[U][R];
    uint4 xv[U][2];
  };
  const int cstride = 32 * nw;      // between a lane's chunks inside one step
  const int step = cstride * U;     // between a lane's steps
  auto load = [&](int c0, Stage& st) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * cstride;
      if (c < nchunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) st.w[u][r] = __ldg(wrow[r] + c);
#pragma unroll
        for (int r = 0; r < R; ++r) st.s[u][r] = __ldg(srow[r] + c / cpg);
        st.xv[u][0] = __ldg(x4 + 2 * c);
        st.xv[u][1] = __ldg(x4 + 2 * c + 1);
      }
    }
  };
  auto compute = [&](int c0, const Stage& st) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + u * cstride >= nchunks) continue;
      float xf[16];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2* xh = reinterpret_cast<const __half2*>(&st.xv[u][h]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __half22float2(xh[j]);
          xf[8 * h + 2 * j] = f.x;
          xf[8 * h + 2 * j + 1] = f.y;
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float zf = 8388608.f + __high2float(st.s[u][r]);
        const uint32_t wv[4] = {st.w[u][r].x, st.w[u][r].y, st.w[u][r].z, st.w[u][r].w};
        float p0 = 0.f, p1 = 0.f;  // two chains: half the dependent FMA latency
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          p0 = fmaf(xf[4 * q + 0], u8_magic<0>(wv[q]) - zf, p0);
          p1 = fmaf(xf[4 * q + 1], u8_magic<1>(wv[q]) - zf, p1);
          p0 = fmaf(xf[4 * q + 2], u8_magic<2>(wv[q]) - zf, p0);
          p1 = fmaf(xf[4 * q + 3], u8_magic<3>(wv[q]) - zf, p1);
        }
        acc[r] = fmaf(__low2float(st.s[u][r]), p0 + p1, acc[r]);
      }
    }
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

constexpr int kGemvStreamRows = 4;

#ifndef __CUDACC_RTC__
// Host-side launch helpers (nvcc only). Requirements checked by the caller:
// K % 16 == 0, group_size % 16 == 0, K % group_size == 0, 16-byte aligned x and qw.
// K split across the block's warps only when one warp per R rows would leave the GPU
// short of warps (fewer than 10 per SM). Measured on the H200 (docs/kernels.md): N = 5120
// and 48 gain from the split, N >= 7168 lose; V100 is not yet measured.
inline int gptq_gemv_ksplit(int N, int rows, int sm_count) {
  if (sm_count < 0) return kGemvWarps;  // forced by the caller
  const int warps = (N + rows - 1) / rows;
  return warps < 10 * sm_count ? kGemvWarps : 1;
}

// Streamed kernel: split only when the rows leave the GPU short of warps AND K is long
// enough that each warp's slice still fills the pipeline (H200, 2026-11-29: N = 5120 gains
// from the split at K = 8704 and 10240, loses at K = 3072; N = 48 gains).
inline int gptq_gemv_stream_ksplit(int N, int K, int rows, int sm_count) {
  if (sm_count < 0) return kGemvWarps;  // forced by the caller
  const int warps = (N + rows - 1) / rows;
  return warps < 10 * sm_count && (K >= 4096 || warps < sm_count) ? kGemvWarps : 1;
}

inline int gptq_gemv_blocks(int N, int rows, int ksplit) {
  const int row_sets = (N + rows - 1) / rows;
  return ksplit == 1 ? (row_sets + kGemvWarps - 1) / kGemvWarps : row_sets;
}

// kernel: 0 auto (streamed U = 1 for M = 1, the classic kernel otherwise), 1 classic,
// 2 streamed U = 1, 3 streamed U = 2 (2 and 3 need M = 1; the caller checks). U = 2 was
// slower than U = 1 on every shape on the H200 (165 registers: 3 blocks per SM, not 4).
template <int M>
inline void launch_gptq_gemv(const __half* x, const uint8_t* qw, const __half2* sz,
                             const __half* bias, __half* y, int N, int K, int group_size,
                             int sm_count, cudaStream_t stream, int kernel = 0) {
  if constexpr (M == 1) {
    if (kernel != 1) {
      constexpr int R = kGemvStreamRows;
      const int ks = gptq_gemv_stream_ksplit(N, K, R, sm_count);
      const int blocks = gptq_gemv_blocks(N, R, ks);
      if (kernel != 3) {
        gptq_gemv_stream_kernel<R, 1><<<blocks, kGemvWarps * 32, 0, stream>>>(
            x, qw, sz, bias, y, N, K, group_size, ks);
      } else {
        gptq_gemv_stream_kernel<R, 2><<<blocks, kGemvWarps * 32, 0, stream>>>(
            x, qw, sz, bias, y, N, K, group_size, ks);
      }
      return;
    }
  }
  constexpr int R = GemvRows<M>::value;
  const int ks = gptq_gemv_ksplit(N, R, sm_count);
  gptq_gemv_kernel<M, R><<<gptq_gemv_blocks(N, R, ks), kGemvWarps * 32, 0, stream>>>(
      x, qw, sz, bias, y, N, K, group_size, ks);
}
#endif

}  // namespace sm70
