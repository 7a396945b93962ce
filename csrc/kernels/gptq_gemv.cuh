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
// software-pipelined gptq_gemv_stream_kernel below (packed-half math) by default, M = 2..8
// the tensor-core gptq_gemv_tc_kernel; this classic kernel serves M = 2..8 only when K or
// the group size is not a multiple of 128 (and M = 1 when forced with kernel = 1).
#pragma once

#include "sm70_common.cuh"

#ifndef __CUDACC_RTC__
#include <atomic>
#endif

namespace sm70 {

constexpr int kGemvWarps = 4;  // warps per block (128 threads)
// resident blocks per SM of the 2-row streamed kernel (kernel 13): 64 registers a thread
constexpr int kGemvR2BlocksPerSm = 8;

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

// The 16 activations of one 16-code chunk (two uint4 of halves) as floats.
__device__ __forceinline__ void gemv_x16_to_float(const uint4 (&xv)[2], float (&xf)[16]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __half2* xh = reinterpret_cast<const __half2*>(&xv[h]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(xh[j]);
      xf[8 * h + 2 * j] = f.x;
      xf[8 * h + 2 * j + 1] = f.y;
    }
  }
}

// sum_k x_k (q_k - z) over one 16-code chunk in fp32 (the streamed and stream-K kernels'
// fp32 math; the caller applies the scale): prmt magic numbers, two FMA chains to halve
// the dependent latency.
__device__ __forceinline__ float gemv_chunk_dot_f32(const float (&xf)[16], const uint4& w,
                                                    float z) {
  const float zf = 8388608.f + z;
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w};
  float p0 = 0.f, p1 = 0.f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    p0 = fmaf(xf[4 * q + 0], u8_magic<0>(wv[q]) - zf, p0);
    p1 = fmaf(xf[4 * q + 1], u8_magic<1>(wv[q]) - zf, p1);
    p0 = fmaf(xf[4 * q + 2], u8_magic<2>(wv[q]) - zf, p0);
    p1 = fmaf(xf[4 * q + 3], u8_magic<3>(wv[q]) - zf, p1);
  }
  return p0 + p1;
}

// Packed-half math (H2 of gptq_gemv_stream_kernel, described there) for one 16-code chunk
// of one row: returns acc + scale * sum_k x_k (q_k - z).
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
// XS = true: x is staged once per block in dynamic shared memory (K * 2 bytes) instead of
// being loaded with every chunk: 8 fewer registers per chunk in flight, which buys U = 2
// (twice the code bytes in flight per warp) inside the 128 registers of 4 blocks per SM.
// H2 = true: packed-half math. On the H200 the fp32 path is issue-bound before it is
// memory-bound (ncu: 54 % of issue slots busy at 62 % of DRAM bandwidth; prmt + fsub + ffma
// per weight byte plus the x conversions). Here two codes become one half2 (1024 + q)
// with one prmt, one HFMA2 makes the exact (q - z) / 256 and one HFMA2 multiplies by x and
// accumulates: about 2.2 instructions per byte instead of 3.3. The / 256 keeps each
// product within |x| (exact power-of-two scaling), so a fp16 partial of 4 products cannot
// overflow for |x| < 16384; the partials of each 16-code chunk go to the fp32
// accumulator with the group scale (x 256). Rounding: one fp16 rounding per
// product and per partial add, about 5e-4 relative per chunk, averaging out over K.
// R = 2 (kernel 13, the default) runs 8 blocks per SM in 64 registers, R = 4 runs 4.
template <int R, int U, bool XS = false, bool H2 = false>
__global__ void __launch_bounds__(kGemvWarps * 32,
                                  R == 2 ? kGemvR2BlocksPerSm : ((U == 1 || XS) ? 4 : 3))
    gptq_gemv_stream_kernel(const __half* __restrict__ x,     // [1, K]
                            const uint8_t* __restrict__ qw,   // [N, K]
                            const __half2* __restrict__ sz,   // [N, K / G]
                            const __half* __restrict__ bias,  // [N] or nullptr
                            __half* __restrict__ y,           // [1, N]
                            int N, int K, int group_size, int ks1_blocks) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // blocks below ks1_blocks: each warp owns R rows (ksplit 1); the blocks after them share
  // one row set between their warps, which split K (ksplit 4). All of one kind: ks1_blocks
  // = gridDim.x or 0; both (kernels 12, 13, gptq_gemv_stream_tail): the short K-split blocks
  // come last and even out the SMs' ends
  const int ksplit = (int)blockIdx.x < ks1_blocks ? 1 : kGemvWarps;
  const int nw = ksplit == 1 ? 1 : kGemvWarps;
  const int kw = ksplit == 1 ? 0 : warp;
  const int n0 = (ksplit == 1 ? blockIdx.x * kGemvWarps + warp
                              : ks1_blocks * kGemvWarps + (blockIdx.x - ks1_blocks)) * R;
  __shared__ float red[kGemvWarps][R];
  extern __shared__ __align__(16) unsigned char gemv_dyn_smem[];
  const uint4* xs = reinterpret_cast<const uint4*>(gemv_dyn_smem);
  if constexpr (XS) {
    const uint4* xg = reinterpret_cast<const uint4*>(x);
    uint4* xd = reinterpret_cast<uint4*>(gemv_dyn_smem);
    for (int i = threadIdx.x; i < (K >> 3); i += kGemvWarps * 32) xd[i] = __ldg(xg + i);
    __syncthreads();
  }
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
        if constexpr (!XS) {
          st.xv[u][0] = __ldg(x4 + 2 * c);
          st.xv[u][1] = __ldg(x4 + 2 * c + 1);
        }
      }
    }
  };
  auto compute = [&](int c0, const Stage& st) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * cstride;
      if (c >= nchunks) continue;
      uint4 xv[2];
      if constexpr (XS) {
        xv[0] = xs[2 * c];
        xv[1] = xs[2 * c + 1];
      } else {
        xv[0] = st.xv[u][0];
        xv[1] = st.xv[u][1];
      }
      if constexpr (H2) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = gemv_chunk_h2(st.w[u][r], st.s[u][r], xv, acc[r]);
      } else {
        float xf[16];
        gemv_x16_to_float(xv, xf);
#pragma unroll
        for (int r = 0; r < R; ++r)
          acc[r] = fmaf(__low2float(st.s[u][r]),
                        gemv_chunk_dot_f32(xf, st.w[u][r], __high2float(st.s[u][r])), acc[r]);
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
// x staged in shared memory (kernels 6, 7) up to the default dynamic limit; longer K falls
// back to the U = 1 kernel, which reads x from global memory.
constexpr size_t kGemvMaxXsBytes = 48 * 1024;

// Balanced persistent ("stream-K") M = 1 kernel. The streamed kernel above gives each warp
// one row set and a fixed grid of N/16 blocks: on the H200 that is 0.85 waves for qkv and
// 2.06 / 2.42 for gate_up / down, and a warp lives only ~10 pipeline steps: wave
// quantisation and the pipeline ramp/tail were the suspects for its 55-63 % of DRAM peak
// (ncu). Here the work is
// cut into units = (row set of R rows, step of 32 x 16-byte chunks), and a grid of exactly
// resident blocks hands every warp the same number of contiguous units (+-1): one ramp per
// warp, no tail wave, and the pipeline runs straight across row-set boundaries.
// Per-chunk math is the streamed kernel's (prmt magic numbers, two FMA chains per row,
// fp32 accumulation); lanes past the K tail load zeros, which add exactly 0.
// A row set split between warps is joined in fp32 through ws [N] (atomicAdd) and a
// per-row-set step counter cnt: the warp whose steps complete the count writes y and
// zeroes both again, so the workspace is zero before and after every launch (no memset
// per call, graph-capturable). The order of the partial adds is not fixed, so a result can
// differ from run to run in its last bit. A warp's partial first segment is joined only at
// its end, with its last one, so the fences and counter round trip never stall the pipeline.
// Measured on the H200 (docs/gemv_stream_k.md): S = 2 at 58-82 % of copy bandwidth on the
// large shapes, level with the streamed kernel on gate_up / down (+-1 %), 4-20 % slower on
// the other large shapes and 15-30 % on the small ones (N = 48, 5120 x 3072); the
// join's L2 round trips at the end and the loss of the streamed grid's address locality
// are the suspects. Selected only with kernel = 4 / 5 for now.
// S = 2 fits 128 registers (4 blocks per SM) without spills; S = 3 spills a little at 128
// and runs at 3 blocks per SM; R = 8, S = 2 spills at 128 and is not instantiated (ptxas,
// sm_70 and sm_90).
template <int R, int S>
__global__ void __launch_bounds__(kGemvWarps * 32, S == 2 ? 4 : 3)
    gptq_gemv_sk_kernel(const __half* __restrict__ x,     // [1, K]
                        const uint8_t* __restrict__ qw,   // [N, K]
                        const __half2* __restrict__ sz,   // [N, K / G]
                        const __half* __restrict__ bias,  // [N] or nullptr
                        __half* __restrict__ y,           // [1, N]
                        int N, int K, int group_size,
                        float* __restrict__ ws,           // [N], zero on entry and exit
                        int* __restrict__ cnt) {          // [ceil(N / R)], same
  static_assert(S >= 2, "the pipeline needs at least two stages");
  static_assert((R & (R - 1)) == 0 && 2 * R <= 32, "R: a power of two, at most 16");
  const int lane = threadIdx.x & 31;
  const int nchunks = K >> 4;
  const int nsteps = (nchunks + 31) >> 5;
  const int ngroups = K / group_size;
  const int cpg = group_size >> 4;  // chunks per group
  const int units = (N + R - 1) / R * nsteps;
  const long long nwarps = (long long)gridDim.x * kGemvWarps;
  const long long gw = (long long)blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  const int u_begin = (int)(gw * units / nwarps);
  const int u_end = (int)((gw + 1) * units / nwarps);
  if (u_begin >= u_end) return;  // more warps than units (small N * K)
  const uint4* x4 = reinterpret_cast<const uint4*>(x);

  struct Stage {
    uint4 w[R];
    __half2 s[R];
    uint4 xv[2];
  };
  // Load cursor: row set lrs, chunk lc = step * 32 + lane, and lc's group lg with
  // remainder lrem, advanced incrementally (no integer division per unit). Each load
  // finds its rows from lrs, so the stages may hold units of different row sets.
  const int q32 = 32 / cpg, r32 = 32 % cpg;  // one step in groups
  int lrs = u_begin / nsteps;
  int lc = (u_begin - lrs * nsteps) * 32 + lane;
  int lg = lc / cpg, lrem = lc - lg * cpg;
  auto load = [&](Stage& st) {
    if (lc < nchunks) {
      // 32-bit offsets (the launcher requires N * K < 2^32): fewer integer instructions
      // per unit, which matters at ~300 instructions per 2 KB unit
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const unsigned n = min((unsigned)(lrs * R + r), (unsigned)(N - 1));  // clamp: N-1
        st.w[r] = __ldg(reinterpret_cast<const uint4*>(qw + (n * (unsigned)K + 16u * lc)));
        st.s[r] = __ldg(sz + (n * (unsigned)ngroups + lg));
      }
      st.xv[0] = __ldg(x4 + 2 * lc);
      st.xv[1] = __ldg(x4 + 2 * lc + 1);
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        st.w[r] = make_uint4(0u, 0u, 0u, 0u);
        st.s[r] = __floats2half2_rn(0.f, 0.f);
      }
      st.xv[0] = make_uint4(0u, 0u, 0u, 0u);
      st.xv[1] = make_uint4(0u, 0u, 0u, 0u);
    }
    lc += 32;
    lg += q32;
    lrem += r32;
    if (lrem >= cpg) lrem -= cpg, ++lg;
    if (lc - lane >= nsteps * 32) lc = lane, lg = lane / cpg, lrem = lane - lg * cpg, ++lrs;
  };

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  auto compute = [&](const Stage& st) {
    float xf[16];
    gemv_x16_to_float(st.xv, xf);
#pragma unroll
    for (int r = 0; r < R; ++r)
      acc[r] = fmaf(__low2float(st.s[r]), gemv_chunk_dot_f32(xf, st.w[r], __high2float(st.s[r])),
                    acc[r]);
  };

  // A warp's range has at most two partial segments: its first (the tail of a row set
  // begun by the previous warp) and its last. The first one's sums wait in registers
  // (lane r: row r) and both are joined after the last unit, when no load is in flight:
  // the fences and the counter round trip would otherwise stall the pipeline mid-range.
  float head_v = 0.f;
  int head_rs = 0, head_steps = 0;
  // Lanes 0..R-1 carry the head segment, lanes R..2R-1 the tail (steps == 0: none). Every
  // partial goes into ws; the warp whose steps complete a row set's count writes y.
  auto join = [&](float tail_v, int tail_rs, int tail_steps) {
    const float tv = __shfl_sync(0xffffffffu, tail_v, (lane + 32 - R) & 31);
    const bool is_head = lane < R;
    const int e_rs = is_head ? head_rs : tail_rs;
    const int e_steps = is_head ? head_steps : tail_steps;
    const int n = e_rs * R + (lane & (R - 1));
    const bool mine = lane < 2 * R && e_steps > 0 && n < N;
    if (mine) atomicAdd(ws + n, is_head ? head_v : tv);
    __threadfence();  // the partials are visible before the count says so
    __syncwarp();
    int seen = 0;
    if ((lane == 0 || lane == R) && e_steps > 0) seen = atomicAdd(cnt + e_rs, e_steps);
    seen = __shfl_sync(0xffffffffu, seen, is_head ? 0 : R);
    const bool last = lane < 2 * R && e_steps > 0 && seen + e_steps == nsteps;
    if (__any_sync(0xffffffffu, last)) __threadfence();
    if (last && n < N) {
      const float t = atomicExch(ws + n, 0.f);
      y[n] = __float2half_rn(t + (bias != nullptr ? __half2float(bias[n]) : 0.f));
    }
    if (last && (lane & (R - 1)) == 0) atomicExch(cnt + e_rs, 0);
  };
  // End of a segment [s0, s1) of row set rs after unit u: a whole row set writes y now.
  auto flush = [&](int rs, int s0, int s1, int u) {
    float v = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float t = warp_sum(acc[r]);
      acc[r] = 0.f;
      if (lane == r) v = t;
    }
    if (s0 == 0 && s1 == nsteps) {
      const int n = rs * R + lane;
      if (lane < R && n < N)
        y[n] = __float2half_rn(v + (bias != nullptr ? __half2float(bias[n]) : 0.f));
      if (u + 1 == u_end && head_steps > 0) join(0.f, 0, 0);
    } else if (u + 1 < u_end) {  // only the first segment can end early and be partial
      head_v = v;
      head_rs = rs;
      head_steps = s1 - s0;
    } else {
      join(v, rs, s1 - s0);
    }
  };

  // S-stage register pipeline: unit v lives in stage (v - u_begin) % S; the load of unit
  // u + j + S - 1 is issued before unit u + j is computed. Conditions are warp-uniform.
  Stage st[S];
  int crs = lrs, cstep = lc >> 5, seg0 = cstep;  // unit being computed, its segment's start
#pragma unroll
  for (int i = 0; i < S - 1; ++i)
    if (u_begin + i < u_end) load(st[i]);
  for (int u = u_begin; u < u_end; u += S) {
#pragma unroll
    for (int j = 0; j < S; ++j) {
      if (u + j + S - 1 < u_end) load(st[(j + S - 1) % S]);
      if (u + j < u_end) {
        compute(st[j]);
        if (++cstep == nsteps || u + j + 1 == u_end) {
          flush(crs, seg0, cstep, u + j);
          ++crs;
          cstep = 0;
          seg0 = 0;
        }
      }
    }
  }
}

// ---- Tensor-core GEMV (kernels 10, 11): M = 1..8 activation rows on the tensor cores.
// The classic kernel spends M fused multiply-adds per weight byte, so at M = 4 (MTP
// verification, 1 + 3 draft tokens) it is issue-bound at 30 % of the H200's copy bandwidth;
// an mma instruction multiplies a whole weight tile by all 8 activation rows at once, so
// the instruction count per weight byte no longer grows with M. Codes enter the product as
// the biased half 1024 + q (one prmt per two codes); the offset and the zero leave exactly
// through a second product with the constant -(1024 + z): both products are exact in the
// fp32 accumulator (11-bit x 11-bit) and a unit's sums run over only 128 k, so the biased
// operand costs no accuracy (unlike the decode attention's V, summed over thousands of
// tokens). One unit = 128 k of the warp's row tile; its scale (group_size % 128 == 0)
// multiplies the unit's sum into the fp32 accumulator.
// NATIVE (sm_80+, m16n8k16): A = 16 weight rows x 16 k, B = 16 k x 8 activation rows;
//   lane (g, t) holds rows g and g + 8 and activation row g; k order is permuted so its
//   four k per step are the contiguous dims 16t + 4s .. +3 of a 16-code chunk (one 16-byte
//   load per row feeds four steps; the four t lanes of a row read 64 contiguous bytes).
// Volta (m8n8k4): each quad pair p multiplies the same 8 weight rows by the 8 activation
//   rows over its own quarter of the unit's k (chunks p and p + 4), lane row l4 + 4 hi for
//   both A (weights) and B (activations); the four quad pairs' sums meet by shuffles at the
//   end. The H200 emulates m8n8k4 (slow), so there the Volta variant is checked for
//   correctness only.
// ksplit warps share one row tile and take every ksplit-th unit (W warps per block, W / ksplit
// tiles per block); shared memory joins them.
constexpr int kGemvTcUnit = 128;  // k per unit

template <bool NATIVE>
struct GemvTcRows {
  static constexpr int value = NATIVE ? 16 : 8;  // weight rows per warp tile
};

// Pipeline and register budget per variant, tuned on the H200 (2026-11-30, m16n8k16, M = 1
// and 4, every model shape; docs/kernels.md). W = 4 warps per tile, two units in flight:
// with CH = 1 accumulator chain (16 dependent mma per unit) the registers fit 5 blocks per
// SM (96), which wins when the grid is several waves (gate_up, lm_head: 10-13 % faster
// than CH = 2); CH = 2 chains of 8 (116 registers, 4 blocks) wins when the grid is one wave
// (qkv, in_proj_qkvz: 6-7 %). W = 8 (the 5120-row shapes) reads x when a unit is computed
// instead of a unit ahead (an L1 hit): 80 registers, 3 blocks of 8 warps per SM, 13-17 %
// faster there than W = 4. Three stages (96-143 registers) and 6 blocks of 4 warps (80)
// were slower. Volta keeps one chain at 88 registers (4 blocks of 4 warps: 16 warps, about
// 2x the bytes in flight a V100 needs); not measured there.
template <bool NATIVE, int W, int CH>
struct GemvTcPipe {
  static constexpr int stages = 2;
  static constexpr bool x_late = NATIVE && W == 8;
  static constexpr int min_blocks = W == 8 ? (NATIVE ? 3 : 2) : (NATIVE && CH == 1 ? 5 : 4);
};

template <bool NATIVE, int W, int CH>
__global__ void __launch_bounds__(W * 32, (GemvTcPipe<NATIVE, W, CH>::min_blocks))
    gptq_gemv_tc_kernel(const __half* __restrict__ x,     // [M, K]
                        const uint8_t* __restrict__ qw,   // [N, K]
                        const __half2* __restrict__ sz,   // [N, K / G]
                        const __half* __restrict__ bias,  // [N] or nullptr
                        __half* __restrict__ y,           // [M, N]
                        int M, int N, int K, int group_size, int ksplit) {
  constexpr int TN = GemvTcRows<NATIVE>::value;
  constexpr int NACC = NATIVE ? 4 : 8;  // C fragment floats per lane
  constexpr int NW = NATIVE ? 2 : 1;    // weight rows per lane
  constexpr bool XL = GemvTcPipe<NATIVE, W, CH>::x_late;
  __shared__ float red[W][NACC][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int tile = blockIdx.x * (W / ksplit) + warp / ksplit;
  const int part = warp % ksplit;
  const int n0 = tile * TN;
  const int units = K / kGemvTcUnit;
  const int ngroups = K / group_size;
  const int upg = group_size / kGemvTcUnit;  // units per group

  // lane coordinates: weight rows, k part (which 16-code chunks of a unit), activation row
  const int hi = lane >> 4;
  const int wr0 = NATIVE ? lane >> 2 : (lane & 3) + 4 * hi;
  const int kp = NATIVE ? lane & 3 : (lane >> 2) & 3;
  const int xm = wr0;
  const uint4* wp[NW];
  const __half2* sp[NW];
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    const int n = min(n0 + wr0 + 8 * i, N - 1);  // rows past N re-read row N-1, never written
    wp[i] = reinterpret_cast<const uint4*>(qw + (size_t)n * K);
    sp[i] = sz + (size_t)n * ngroups;
  }
  const bool xlive = xm < M;
  const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)(xlive ? xm : 0) * K);

  struct Stage {
    uint4 w[NW][2];  // row i, chunk j (dims 64 j + 16 kp .. +15 of the unit)
    uint4 xv[XL ? 1 : 2][2];  // chunk j, halves h (dims +8 h .. +7); XL: x read late
    int c;
    __half2 s[NW];
  };
  auto load = [&](int u, Stage& st) {
    if (u >= units) return;
    const int c = u * 8 + kp;  // 16-code chunk of j = 0; j = 1 is c + 4
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      st.w[i][0] = __ldg(wp[i] + c);
      st.w[i][1] = __ldg(wp[i] + c + 4);
    }
    st.c = c;
    if constexpr (!XL) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          st.xv[j][h] = xlive ? __ldg(xp + 2 * (c + 4 * j) + h) : make_uint4(0u, 0u, 0u, 0u);
    }
    const int gi = ngroups == 1 ? 0 : (upg == 1 ? u : u / upg);
#pragma unroll
    for (int i = 0; i < NW; ++i) st.s[i] = __ldg(sp[i] + gi);
  };

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  auto compute = [&](const Stage& st) {
    // CH = 2: one accumulator per 64-k half of the unit, two independent chains of 8 mma
    // instead of one of 16 (each step's pair of products keeps the partial small, above)
    float cc[CH][NACC];
#pragma unroll
    for (int j = 0; j < CH; ++j)
#pragma unroll
      for (int i = 0; i < NACC; ++i) cc[j][i] = 0.f;
    uint32_t zf[NW];  // half2 (-(1024 + z)) twice: exact, z <= 256 is an integer
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      const __half zn = __hneg(__hadd(__high2half(st.s[i]), __float2half(1024.f)));
      const __half2 z2 = __halves2half2(zn, zn);
      zf[i] = *reinterpret_cast<const uint32_t*>(&z2);
    }
    uint4 xl[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        xl[j][h] = !XL ? st.xv[XL ? 0 : j][h]
                       : (xlive ? __ldg(xp + 2 * (st.c + 4 * j) + h) : make_uint4(0u, 0u, 0u, 0u));
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t xw[8] = {xl[j][0].x, xl[j][0].y, xl[j][0].z, xl[j][0].w,
                              xl[j][1].x, xl[j][1].y, xl[j][1].z, xl[j][1].w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t b[2] = {xw[2 * s], xw[2 * s + 1]};  // x dims 4s .. 4s+3 of the chunk
        if constexpr (NATIVE) {
          const uint32_t w0 = (&st.w[0][j].x)[s], w1 = (&st.w[1][j].x)[s];
          const uint32_t a[4] = {__byte_perm(w0, 0x64646464u, 0x5140),
                                 __byte_perm(w1, 0x64646464u, 0x5140),
                                 __byte_perm(w0, 0x64646464u, 0x7362),
                                 __byte_perm(w1, 0x64646464u, 0x7362)};
          const uint32_t az[4] = {zf[0], zf[NW - 1], zf[0], zf[NW - 1]};
          mma_m16n8k16(*reinterpret_cast<float(*)[4]>(cc[j % CH]), a, b);
          mma_m16n8k16(*reinterpret_cast<float(*)[4]>(cc[j % CH]), az, b);
        } else {
          const uint32_t w0 = (&st.w[0][j].x)[s];
          const uint32_t a[2] = {__byte_perm(w0, 0x64646464u, 0x5140),
                                 __byte_perm(w0, 0x64646464u, 0x7362)};
          const uint32_t az[2] = {zf[0], zf[0]};
          mma_m8n8k4(*reinterpret_cast<float(*)[8]>(cc[j % CH]), a, b);
          mma_m8n8k4(*reinterpret_cast<float(*)[8]>(cc[j % CH]), az, b);
        }
      }
    }
    float c[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) c[i] = CH == 2 ? cc[0][i] + cc[CH - 1][i] : cc[0][i];
    if constexpr (NATIVE) {
      // c0, c1: weight row g, activation rows 2t, 2t+1; c2, c3: row g + 8
      const float s0 = __low2float(st.s[0]), s1 = __low2float(st.s[NW - 1]);
      acc[0] = fmaf(s0, c[0], acc[0]);
      acc[1] = fmaf(s0, c[1], acc[1]);
      acc[2] = fmaf(s1, c[2], acc[2]);
      acc[3] = fmaf(s1, c[3], acc[3]);
    } else {
      // C rows (lane & 1) + (i & 2) + 4 hi: their scales sit with the quad's lanes
      // (lane & 1) and (lane & 1) + 2, which load rows of the same hi
      const float sm = __low2float(st.s[0]);
      const float sa = __shfl_sync(0xffffffffu, sm, (lane & ~3) | (lane & 1));
      const float sb = __shfl_sync(0xffffffffu, sm, (lane & ~3) | ((lane & 1) + 2));
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf((i & 2) ? sb : sa, c[i], acc[i]);
    }
  };

  // S-stage register pipeline: unit part + v * ksplit lives in stage v % S; the load of
  // the unit S - 1 ahead is issued before a unit is computed
  constexpr int S = GemvTcPipe<NATIVE, W, CH>::stages;
  Stage st[S];
#pragma unroll
  for (int i = 0; i < S - 1; ++i) load(part + i * ksplit, st[i]);
  for (int u = part; u < units; u += S * ksplit) {
#pragma unroll
    for (int j = 0; j < S; ++j) {
      const int uj = u + j * ksplit;
      load(uj + (S - 1) * ksplit, st[(j + S - 1) % S]);
      if (uj < units) compute(st[j]);
    }
  }

  if constexpr (!NATIVE) {  // the four quad pairs covered different k
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 4);
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 8);
    }
  }
  if (ksplit > 1) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) red[warp][i][lane] = acc[i];
    __syncthreads();
    if (part != 0) return;
    for (int w = 1; w < ksplit; ++w)
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[i] += red[warp + w][i][lane];
  }
  if (!NATIVE && ((lane >> 2) & 3) != 0) return;  // quad pair 0 holds the sums
#pragma unroll
  for (int i = 0; i < NACC; ++i) {
    const int n = NATIVE ? n0 + (lane >> 2) + 8 * (i >> 1) : n0 + (lane & 1) + (i & 2) + 4 * hi;
    const int m = NATIVE ? 2 * (lane & 3) + (i & 1) : (i & 4) + (lane & 2) + (i & 1);
    if (n < N && m < M) {
      const float bv = bias != nullptr ? __half2float(bias[n]) : 0.f;
      y[(size_t)m * N + n] = __float2half_rn(acc[i] + bv);
    }
  }
}

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

// Tensor-core kernel (10, 11): needs K % 128 == 0 and group_size % 128 == 0 (the caller
// checks). K is split over every warp of a block (one row tile per block): on the H200 1 or
// 2 warps per tile lost on every model shape and M (2026-11-30: up to 2.5x on the shapes
// with few row tiles, 5-15 % on the others).
inline bool gptq_gemv_tc_fits(int K, int group_size) {
  return K % kGemvTcUnit == 0 && group_size % kGemvTcUnit == 0;
}

// Warps per row tile: 4, or 8 when 4 per tile would leave fewer than 12 warps per SM
// (the 5120-row shapes on the H200: 320 tiles) and every warp keeps 2+ units.
inline int gptq_gemv_tc_ksplit(int N, int K, int tile_rows, int sm_count) {
  const int tiles = (N + tile_rows - 1) / tile_rows;
  return tiles * kGemvWarps < 12 * sm_count && K / kGemvTcUnit >= 16 ? 8 : kGemvWarps;
}

// ksplit: 0 auto, or 1, 2, 4, 8 warps per row tile (forced, for tuning and tests).
template <bool NATIVE>
inline void launch_gptq_gemv_tc_t(const __half* x, const uint8_t* qw, const __half2* sz,
                                  const __half* bias, __half* y, int M, int N, int K,
                                  int group_size, int sm_count, int ksplit,
                                  cudaStream_t stream) {
  constexpr int rows = GemvTcRows<NATIVE>::value;
  const int ks = ksplit > 0 ? ksplit : gptq_gemv_tc_ksplit(N, K, rows, sm_count);
  const int tiles = (N + rows - 1) / rows;
  if (ks == 8) {
    gptq_gemv_tc_kernel<NATIVE, 8, 1><<<tiles, 8 * 32, 0, stream>>>(x, qw, sz, bias, y, M, N, K,
                                                                    group_size, ks);
    return;
  }
  const int blocks = (tiles * ks + kGemvWarps - 1) / kGemvWarps;
  if constexpr (NATIVE) {
    // two accumulator chains when the grid is one wave at 4 blocks per SM (GemvTcPipe)
    if (blocks <= 4 * sm_count) {
      gptq_gemv_tc_kernel<true, kGemvWarps, 2><<<blocks, kGemvWarps * 32, 0, stream>>>(
          x, qw, sz, bias, y, M, N, K, group_size, ks);
      return;
    }
  }
  gptq_gemv_tc_kernel<NATIVE, kGemvWarps, 1><<<blocks, kGemvWarps * 32, 0, stream>>>(
      x, qw, sz, bias, y, M, N, K, group_size, ks);
}

inline void launch_gptq_gemv_tc(bool native, const __half* x, const uint8_t* qw,
                                const __half2* sz, const __half* bias, __half* y, int M, int N,
                                int K, int group_size, int sm_count, int ksplit,
                                cudaStream_t stream) {
  if (native) {
    launch_gptq_gemv_tc_t<true>(x, qw, sz, bias, y, M, N, K, group_size, sm_count, ksplit,
                                stream);
  } else {
    launch_gptq_gemv_tc_t<false>(x, qw, sz, bias, y, M, N, K, group_size, sm_count, ksplit,
                                 stream);
  }
}

// kernel: 0 auto (13 for M = 1; the classic kernel otherwise: the binding sends M = 2..8
// to launch_gptq_gemv_tc when it fits), 1 classic,
// 2 streamed U = 1, 3 streamed U = 2, 6 streamed U = 2 with x in shared memory, 7 the same
// with 8 rows per warp and U = 1, 8 / 9 streamed U = 1 / 2 with packed-half math, 12 = 8
// with a K-split tail (gptq_gemv_stream_tail), 13 = 12 with 2 rows per warp (2, 3, 6-9,
// 12, 13 need M = 1; the caller checks). U = 2 was slower than U = 1 on every shape on the
// H200 (165 registers: 3 blocks per SM, not 4).
// Kernel 12: kernel 8 with its grid balanced over the SMs. A ksplit-1 grid of B blocks
// gives some SMs ceil(B / SMs) blocks and others one fewer; when that leaves the busiest
// SMs more than 5 % above the average, only floor(B / SMs) x SMs blocks keep ksplit 1 (the
// same count on every SM) and the rows left over go to K-split blocks (4 rows each, the
// warps split K): a quarter of the bytes per block, dispatched last (blocks start in index
// order), so they even out the SMs' ends. H200 (132 SMs), four calls, against kernel 8:
// gate_up 1088 blocks, 25.4-25.6 against 28.7-28.9 us; o_proj / out_proj 320 blocks,
// 7.3-7.4 against 7.6-7.7; qkv 448 blocks, 12.2-12.4 against 12.4-12.6; qkvz (512 blocks,
// 3 % above the average) ran 14.2-14.3 against 13.4-13.5 with the split, hence the
// threshold (docs/kernels.md).
// Kernel 13, the M = 1 default: the same kernel with 2 rows per warp (R = 2) instead of 4,
// which fits 64 registers, so 8 blocks (32 warps) per SM instead of 4 (16 warps): twice
// the warps, each with half the bytes in flight. Why: on the H200 a read-only stream over
// qkv_proj's 38 MB runs faster with more loads in flight per SM (bench/bench_read_ceiling.py:
// 10.8 us with 32 KB, 10.4 with 64 KB), kernel 8's loads without its math took 11.0 and
// kernel 12 12.3, and more warps cover a warp's math better than a deeper pipeline per warp
// (3-5 stages per warp in registers ran 5-15 % slower than 2; twice the bytes per warp at 2
// rows lost too; experiments of 2026-11-30, docs/kernels.md). What it still pays above a
// read-only kernel is a fixed cost per launch, 3.85-4.04 against 2.20-2.33 us in the
// eighth and ninth sessions' runs (bench/launch_cost.py fits; the warps' ends spread over
// 2-3 us). Its tail rule: split only
// when the grid is more than one wave of resident blocks (then the last partial wave ran
// 1-2 blocks per SM for a whole block lifetime: gate_up at 2176 blocks 26.4-26.6 us
// plain, 24.2 split); in one wave any split lost (qkv 12.1 against 11.7). H200, against
// kernel 12 in the same calls (us): qkv 11.6-11.9 / 12.3, in_proj_qkvz 12.9-13.0 / 13.3,
// gate_up 24.2-24.8 / 25.3-25.9, down_proj 15.2-15.4 / 16.1-16.3, MTP fc 17.1-17.4 /
// 18.0-18.2, lm_head 144-146 / 152-154.
struct GemvTail {
  int blocks;      // grid
  int ks1_blocks;  // blocks with ksplit 1 (the rest split K)
};

// The streamed kernel's ks1_blocks for a grid of one kind: all ksplit 1, or all K-split.
inline int gptq_gemv_ks1_blocks(int ksplit, int blocks) { return ksplit == 1 ? blocks : 0; }

// The grid with its K-split tail: split when the busiest SM would carry more than pct %
// above the average, and only grids of more than min_blocks blocks (kernel 12: 5 %, any
// grid; kernel 13: any excess, grids above one wave of resident blocks).
inline GemvTail gptq_gemv_stream_tail(int N, int rows, int ksplit, int blocks, int sms,
                                      int pct = 5, int min_blocks = 0) {
  const GemvTail plain = {blocks, gptq_gemv_ks1_blocks(ksplit, blocks)};
  if (ksplit != 1 || sms <= 0 || blocks < sms || blocks <= min_blocks) return plain;
  const int full = blocks / sms;
  if (blocks % sms == 0 || 100LL * (full + 1) * sms <= (100LL + pct) * blocks) return plain;
  const int ks1 = full * sms;
  const int rows_left = N - ks1 * kGemvWarps * rows;
  return {ks1 + (rows_left + rows - 1) / rows, ks1};
}

template <int M>
inline void launch_gptq_gemv(const __half* x, const uint8_t* qw, const __half2* sz,
                             const __half* bias, __half* y, int N, int K, int group_size,
                             int sm_count, cudaStream_t stream, int kernel = 0) {
  if constexpr (M == 1) {
    if (kernel == 0 || kernel == 13) {  // the M = 1 default: 2 rows per warp
      constexpr int R2 = kGemvStreamRows / 2;
      const int ks2 = gptq_gemv_stream_ksplit(N, K, R2, sm_count);
      const GemvTail t = gptq_gemv_stream_tail(N, R2, ks2, gptq_gemv_blocks(N, R2, ks2),
                                               sm_count, 0, kGemvR2BlocksPerSm * sm_count);
      gptq_gemv_stream_kernel<R2, 1, false, true><<<t.blocks, kGemvWarps * 32, 0, stream>>>(
          x, qw, sz, bias, y, N, K, group_size, t.ks1_blocks);
      return;
    }
    if (kernel != 1) {
      constexpr int R = kGemvStreamRows;
      const int ks = gptq_gemv_stream_ksplit(N, K, R, sm_count);
      const int blocks = gptq_gemv_blocks(N, R, ks);
      const int ks1 = gptq_gemv_ks1_blocks(ks, blocks);
      const size_t xs_bytes = (size_t)K * 2;
      if (kernel == 12) {
        const GemvTail t = gptq_gemv_stream_tail(N, R, ks, blocks, sm_count);
        gptq_gemv_stream_kernel<R, 1, false, true><<<t.blocks, kGemvWarps * 32, 0, stream>>>(
            x, qw, sz, bias, y, N, K, group_size, t.ks1_blocks);
      } else if (kernel == 8) {  // the same kernel, every block ksplit 1 or every block 4
        gptq_gemv_stream_kernel<R, 1, false, true><<<blocks, kGemvWarps * 32, 0, stream>>>(
            x, qw, sz, bias, y, N, K, group_size, ks1);
      } else if (kernel == 9) {
        gptq_gemv_stream_kernel<R, 2, false, true><<<blocks, kGemvWarps * 32, 0, stream>>>(
            x, qw, sz, bias, y, N, K, group_size, ks1);
      } else if ((kernel == 6 || kernel == 7) && xs_bytes <= kGemvMaxXsBytes) {
        if (kernel == 6) {
          gptq_gemv_stream_kernel<R, 2, true><<<blocks, kGemvWarps * 32, xs_bytes, stream>>>(
              x, qw, sz, bias, y, N, K, group_size, ks1);
        } else {
          constexpr int R8 = 2 * kGemvStreamRows;
          const int ks8 = gptq_gemv_stream_ksplit(N, K, R8, sm_count);
          const int b8 = gptq_gemv_blocks(N, R8, ks8);
          gptq_gemv_stream_kernel<R8, 1, true><<<b8, kGemvWarps * 32, xs_bytes, stream>>>(
              x, qw, sz, bias, y, N, K, group_size, gptq_gemv_ks1_blocks(ks8, b8));
        }
      } else if (kernel != 3) {
        gptq_gemv_stream_kernel<R, 1><<<blocks, kGemvWarps * 32, 0, stream>>>(
            x, qw, sz, bias, y, N, K, group_size, ks1);
      } else {
        gptq_gemv_stream_kernel<R, 2><<<blocks, kGemvWarps * 32, 0, stream>>>(
            x, qw, sz, bias, y, N, K, group_size, ks1);
      }
      return;
    }
  }
  constexpr int R = GemvRows<M>::value;
  const int ks = gptq_gemv_ksplit(N, R, sm_count);
  gptq_gemv_kernel<M, R><<<gptq_gemv_blocks(N, R, ks), kGemvWarps * 32, 0, stream>>>(
      x, qw, sz, bias, y, N, K, group_size, ks);
}

// ---- stream-K (M = 1): kernel 4 = R 4, S 2; kernel 5 = R 4, S 3.
// Workspace: N floats (partial sums) then one int per row set, zero-filled once by the
// caller and kept per stream (launches on one stream are ordered; two streams need two).
// Sized for R = 4, the smallest R, so one buffer serves every stream-K kernel.
inline size_t gptq_gemv_sk_workspace_ints(int N) {
  return (size_t)N + (size_t)((N + kGemvStreamRows - 1) / kGemvStreamRows);
}

// The stream-K kernels address rows with 32-bit offsets.
inline bool gptq_gemv_sk_fits(long long N, long long K) { return N * K < (1ll << 32); }

inline int gptq_gemv_sk_units(int N, int K, int rows) {
  return (N + rows - 1) / rows * (((K >> 4) + 31) >> 5);
}

// Persistent grid: every resident block, or fewer when there are not 4 units per block.
inline int gptq_gemv_sk_grid(int units, int sm_count, int blocks_per_sm) {
  const int need = (units + kGemvWarps - 1) / kGemvWarps;
  const int cap = sm_count * blocks_per_sm;
  return need < cap ? (need > 0 ? need : 1) : (cap > 0 ? cap : 1);
}

constexpr int kGemvMaxDevices = 64;

template <int R, int S>
inline cudaError_t launch_gptq_gemv_sk_rs(const __half* x, const uint8_t* qw, const __half2* sz,
                                          const __half* bias, __half* y, int N, int K,
                                          int group_size, int* workspace, int device,
                                          int sm_count, cudaStream_t stream) {
  // resident blocks per SM of this instantiation, queried once per device (a driver call);
  // zero = not yet known (static storage starts zeroed)
  static std::atomic<int> resident[kGemvMaxDevices];
  const bool cached = device >= 0 && device < kGemvMaxDevices;
  int bps = cached ? resident[device].load(std::memory_order_relaxed) : 0;
  if (bps == 0) {
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &bps, gptq_gemv_sk_kernel<R, S>, kGemvWarps * 32, 0);
    if (e != cudaSuccess) return e;
    if (bps < 1) bps = 1;
    if (cached) resident[device].store(bps, std::memory_order_relaxed);
  }
  const int grid = gptq_gemv_sk_grid(gptq_gemv_sk_units(N, K, R), sm_count, bps);
  gptq_gemv_sk_kernel<R, S><<<grid, kGemvWarps * 32, 0, stream>>>(
      x, qw, sz, bias, y, N, K, group_size, reinterpret_cast<float*>(workspace),
      workspace + N);
  return cudaSuccess;
}

// Same requirements as launch_gptq_gemv, plus N >= 1, K >= 16, N * K < 2^32 (see
// gptq_gemv_sk_fits) and a zeroed workspace of gptq_gemv_sk_workspace_ints(N) ints.
// Returns the occupancy query's error, if any.
inline cudaError_t launch_gptq_gemv_sk(int kernel, const __half* x, const uint8_t* qw,
                                       const __half2* sz, const __half* bias, __half* y, int N,
                                       int K, int group_size, int* workspace, int device,
                                       int sm_count, cudaStream_t stream) {
  if (kernel == 5)
    return launch_gptq_gemv_sk_rs<4, 3>(x, qw, sz, bias, y, N, K, group_size, workspace,
                                        device, sm_count, stream);
  return launch_gptq_gemv_sk_rs<4, 2>(x, qw, sz, bias, y, N, K, group_size, workspace, device,
                                      sm_count, stream);
}
#endif

}  // namespace sm70
