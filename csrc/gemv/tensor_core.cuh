// The tensor-core GPTQ-int8 GEMV: M = 2..8 activation rows (MTP verification) on the
// tensor cores (layout: gemv/gemv_common.cuh).
//
// The classic kernel spends M fused multiply-adds per weight byte, so at M = 4 (1 + 3 draft
// tokens) it is issue-bound well below the copy bandwidth; an mma instruction multiplies a
// whole weight tile by all 8 activation rows at once, so the instruction count per weight
// byte no longer grows with M. Codes enter the product as the biased half 1024 + q (one
// prmt per two codes); the offset and the zero leave exactly through a second product with
// the constant -(1024 + z): both products are exact in the fp32 accumulator (11-bit x
// 11-bit) and a unit's sums run over only 128 k, so the biased operand costs no accuracy
// (unlike the decode attention's V, summed over thousands of tokens). One unit = 128 k of
// the warp's row tile; its scale (group_size % 128 == 0) multiplies the unit's sum into the
// fp32 accumulator.
// arch::Sm70 (m8n8k4, what a V100 runs): each quad pair p multiplies the same 8 weight rows
//   by the 8 activation rows over its own quarter of the unit's k (chunks p and p + 4), lane
//   row l4 + 4 hi for both A (weights) and B (activations); the four quad pairs' sums meet
//   by shuffles at the end.
// arch::Sm80 (m16n8k16, the sm_80+ test GPU, where m8n8k4 is emulated and slow):
//   A = 16 weight rows x 16 k, B = 16 k x 8 activation rows; lane (g, t) holds rows g and
//   g + 8 and activation row g; k order is permuted so its four k per step are the
//   contiguous dims 16t + 4s .. +3 of a 16-code chunk (one 16-byte load per row feeds four
//   steps; the four t lanes of a row read 64 contiguous bytes).
// ksplit warps share one row tile and take every ksplit-th unit (W warps per block,
// W / ksplit tiles per block); shared memory joins them. The launcher always passes
// ksplit = W (one tile per block): fewer warps per tile left too few warps on the GPU.
#pragma once

#include "common/arch.cuh"
#include "common/mma.cuh"
#include "gemv/gemv_common.cuh"

namespace sm70 {

constexpr int kGemvTcUnit = 128;  // k per unit

template <class Arch>
struct GemvTcRows {
  static constexpr int value = Arch::kM16n8k16 ? 16 : 8;  // weight rows per warp tile
};

// Pipeline and register budget per instantiation. W = 4 warps per tile, two units in
// flight. arch::Sm70 keeps one accumulator chain at 88 registers (4 blocks of 4 warps per
// SM: 16 warps, about twice the bytes in flight a V100 needs). arch::Sm80: with CH = 1
// chain (16 dependent mma per unit) the registers fit 5 blocks per SM (96), best when the
// grid is several waves; CH = 2 chains of 8 (116 registers, 4 blocks) are best when the
// grid is one wave. W = 8 (tiles too few for 12 warps per SM at W = 4) on arch::Sm80
// reads x when a unit is computed instead of a unit ahead (an L1 hit): 80 registers,
// 3 blocks of 8 warps per SM. Three stages and 6 blocks of 4 warps were slower.
template <class Arch, int W, int CH>
struct GemvTcPipe {
  static constexpr bool kTc16 = Arch::kM16n8k16;
  static constexpr int stages = 2;
  static constexpr bool x_late = kTc16 && W == 8;
  static constexpr int min_blocks = W == 8 ? (kTc16 ? 3 : 2) : (kTc16 && CH == 1 ? 5 : 4);
};

template <class Arch, int W, int CH>
__global__ void __launch_bounds__(W * 32, (GemvTcPipe<Arch, W, CH>::min_blocks))
    gptq_gemv_tc_kernel(const __half* __restrict__ x,     // [M, K]
                        const uint8_t* __restrict__ qw,   // [N, K]
                        const __half2* __restrict__ sz,   // [N, K / G]
                        const __half* __restrict__ bias,  // [N] or nullptr
                        __half* __restrict__ y,           // [M, N]
                        int M, int N, int K, int group_size, int ksplit) {
  constexpr bool TC16 = Arch::kM16n8k16;  // m16n8k16 fragments, else m8n8k4
  constexpr int TN = GemvTcRows<Arch>::value;
  constexpr int NACC = TC16 ? 4 : 8;  // C fragment floats per lane
  constexpr int NW = TC16 ? 2 : 1;    // weight rows per lane
  constexpr bool XL = GemvTcPipe<Arch, W, CH>::x_late;
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
  const int wr0 = TC16 ? lane >> 2 : (lane & 3) + 4 * hi;
  const int kp = TC16 ? lane & 3 : (lane >> 2) & 3;
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
        if constexpr (TC16) {
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
    if constexpr (TC16) {
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
  constexpr int S = GemvTcPipe<Arch, W, CH>::stages;
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

  if constexpr (!TC16) {  // the four quad pairs covered different k
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
  if (!TC16 && ((lane >> 2) & 3) != 0) return;  // quad pair 0 holds the sums
#pragma unroll
  for (int i = 0; i < NACC; ++i) {
    const int n = TC16 ? n0 + (lane >> 2) + 8 * (i >> 1) : n0 + (lane & 1) + (i & 2) + 4 * hi;
    const int m = TC16 ? 2 * (lane & 3) + (i & 1) : (i & 4) + (lane & 2) + (i & 1);
    if (n < N && m < M) {
      const float bv = bias != nullptr ? __half2float(bias[n]) : 0.f;
      y[(size_t)m * N + n] = __float2half_rn(acc[i] + bv);
    }
  }
}

}  // namespace sm70
