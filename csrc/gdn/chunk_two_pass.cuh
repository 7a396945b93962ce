// Gated DeltaNet chunked prefill in two passes: the same computation as chunk_prefill.cuh
// (reference_gdn.gdn_prefill_reference defines it), split the way FLA splits it so that
// only the state recurrence runs chunk after chunk.
//
// Pass 1 (gdn_chunk_wy_kernel), one block per (chunk, value head), every chunk at once:
// the gates and their within-chunk cumsum G, A, T = (I + A)^-1, and into scratch (token-
// major, like the output): W = T diag(beta e^G) K and U = T diag(beta) V [T, HV, 128] fp16,
// P = (Q K^T e^(G_i - G_j), j <= i) [T, HV, 64] fp16 (row t holds its chunk's 64 columns,
// zeros above the diagonal) and G [T, HV] fp32. Its chunks come from chunk_indices
// [NT, 2] (sequence, chunk within the sequence), the table vLLM's GDN metadata already has
// for FLA (so the grid needs no device-to-host copy).
// Pass 2 (gdn_chunk_state_kernel), one block per (32 value columns, head, sequence) as in
// chunk_prefill.cuh, walking the sequence's chunks: V' = U - W H,
// O = diag(e^G) Q H + P V', H <- e^(G_last) H + K^T diag(e^(G_last - G_j)) V', with q, k
// normalised again from qkv (cheaper than a scratch copy per value head).
// Both tags as chunk_prefill.cuh (m8n8k4 for arch::Sm70, m16n8k16 for arch::Sm80).
#pragma once

#include "gdn/chunk_prefill.cuh"

namespace sm70 {

constexpr int kG2VPitch = 136;  // halves per row of the full 64 x 128 value tile (pass 1)

// pass 1: Q, K, A (fp32), Tw and Tu, V [64 x 128], G and beta
constexpr int kG2OffK = kGcQBytes;
constexpr int kG2OffA = kG2OffK + kGcQBytes;
constexpr int kG2OffT = kG2OffA + kGcR1Bytes;
constexpr int kG2OffV = kG2OffT + 2 * kGcTBytes;
constexpr int kG2OffG = kG2OffV + kGcChunk * kG2VPitch * 2;
constexpr int kG2WySmemBytes = kG2OffG + 2 * kGcChunk * 4;
static_assert(kG2WySmemBytes <= 96 * 1024, "Volta: at most 96 KB of shared memory per block");
static_assert(kG2OffV % 16 == 0 && kG2OffG % 16 == 0, "16-byte aligned sub-buffers");

// pass 2: Q, K, W, P, U then V', V' decayed and transposed, the fp16 state copy, G
constexpr int kG2OffSK = kGcQBytes;
constexpr int kG2OffSW = kG2OffSK + kGcQBytes;
constexpr int kG2OffSP = kG2OffSW + kGcQBytes;
constexpr int kG2OffSU = kG2OffSP + kGcTBytes;
constexpr int kG2OffSVd = kG2OffSU + kGcVBytes;
constexpr int kG2OffSH = kG2OffSVd + kGcVBytes;
constexpr int kG2OffSG = kG2OffSH + kGcHBytes;
constexpr int kG2StateSmemBytes = kG2OffSG + kGcChunk * 4;
static_assert(kG2StateSmemBytes <= 96 * 1024, "Volta: at most 96 KB of shared memory");
static_assert(kG2OffSP % 16 == 0 && kG2OffSU % 16 == 0 && kG2OffSVd % 16 == 0 &&
                  kG2OffSH % 16 == 0 && kG2OffSG % 16 == 0,
              "16-byte aligned sub-buffers");

struct GdnTwoPassScratch {
  const int32_t* chunk_indices;  // [NT, 2]: sequence, chunk within it
  __half* w;                     // [T, HV, 128]
  __half* u;                     // [T, HV, 128]
  __half* pm;                    // [T, HV, 64]
  float* gc;                     // [T, HV]
};

// grid (NT, HV), kGcThreads threads, kG2WySmemBytes of dynamic shared memory.
template <class Arch>
__global__ void __launch_bounds__(kGcThreads, 1)
    gdn_chunk_wy_kernel(const GdnChunkParams p, const GdnTwoPassScratch sc) {
  extern __shared__ __align__(16) unsigned char g2_smem[];
  using Tile = GcTile<Arch>;
  __half* qs = reinterpret_cast<__half*>(g2_smem);
  __half* ks = reinterpret_cast<__half*>(g2_smem + kG2OffK);
  float* as = reinterpret_cast<float*>(g2_smem + kG2OffA);
  __half* tw = reinterpret_cast<__half*>(g2_smem + kG2OffT);
  __half* tu = reinterpret_cast<__half*>(g2_smem + kG2OffT + kGcTBytes);
  __half* vs = reinterpret_cast<__half*>(g2_smem + kG2OffV);
  float* gcum = reinterpret_cast<float*>(g2_smem + kG2OffG);
  float* bet = gcum + kGcChunk;

  const int hv = blockIdx.y;
  const int n = sc.chunk_indices[2 * blockIdx.x];
  const int chunk = sc.chunk_indices[2 * blockIdx.x + 1];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int bos = p.query_start_loc[n];
  const int eos = p.query_start_loc[n + 1];
  const int c0 = bos + chunk * kGcChunk;
  if (c0 >= eos) return;
  if (p.state_indices[(int64_t)n * p.indices_stride] <= 0) return;  // pass 2 writes zeros
  const int len = min(kGcChunk, eos - c0);
  const int h = hv / (p.num_v_heads / p.num_k_heads);
  const float neg_a = -expf(p.A_log[hv]);
  const float dt_bias = p.dt_bias_f32 ? p.dt_bias_f32[hv] : __half2float(p.dt_bias_f16[hv]);

  gc_load_normed(p, c0, len, h * kGcDk, p.scale, qs);
  gc_load_normed(p, c0, len, (p.num_k_heads + h) * kGcDk, 1.f, ks);
  {  // the value head's 64 x 128 tile: 4 threads per row, 32 values each
    const int r = tid >> 2;
    const int cc = 32 * (tid & 3);
    const int v_col = 2 * p.num_k_heads * kGcDk + hv * kGcDv + cc;
    uint2* dst = reinterpret_cast<uint2*>(vs + r * kG2VPitch + cc);
    const uint2* src =
        reinterpret_cast<const uint2*>(p.qkv + (int64_t)(c0 + r) * p.qkv_stride + v_col);
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = r < len ? src[i] : make_uint2(0u, 0u);
  }
  if (tid < kGcChunk) {
    float g = 0.f, beta = 0.f;
    if (tid < len) {
      const int64_t t = c0 + tid;
      const float x = __half2float(p.a[t * p.a_stride + hv]) + dt_bias;
      const float bx = __half2float(p.b[t * p.b_stride + hv]);
      const float softplus = x <= 20.f ? log1pf(expf(x)) : x;
      g = neg_a * softplus;
      beta = 1.f / (1.f + expf(-bx));
    }
    gcum[tid] = g;
    bet[tid] = beta;
  }
  __syncthreads();
  if (warp == 0) {  // inclusive cumsum of g, as in chunk_prefill.cuh
    const float x0 = gcum[2 * lane], x1 = gcum[2 * lane + 1];
    float s = x0 + x1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    float excl = __shfl_up_sync(0xffffffffu, s, 1);
    if (lane == 0) excl = 0.f;
    gcum[2 * lane] = excl + x0;
    gcum[2 * lane + 1] = s;
  }
  __syncthreads();
  if (tid < len) sc.gc[(int64_t)(c0 + tid) * p.num_v_heads + hv] = gcum[tid];

  // A below the diagonal, 1 on it, 0 above (as chunk_prefill.cuh)
  {
    const int rt = warp >> 1;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int ct = 2 * (warp & 1) + e;
      float acc[8];
      gc_zero(acc);
      if (ct <= rt)
        gc_mma<Arch, kGcDk, true, kGcBK>(acc, ks + 16 * rt * kGcKPitch, kGcKPitch, 1,
                                        ks + 16 * ct * kGcKPitch, 1, kGcKPitch);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = 16 * rt + Tile::row(lane, i);
        const int c = 16 * ct + Tile::col(lane, i);
        float x = 0.f;
        if (c == r) {
          x = 1.f;
        } else if (c < r && r < len) {
          x = acc[i] * bet[r] * expf(gcum[r] - gcum[c]);
        }
        as[r * kGcAPitch + c] = x;
      }
    }
  }
  __syncthreads();

  const int64_t row_stride = (int64_t)p.num_v_heads;  // scratch rows: token, then head
  if (warp < 2) {
    // T = (I + A)^-1, one column per thread (as chunk_prefill.cuh), into Tw and Tu
    const int c = tid;
    float x[kGcChunk];
#pragma unroll
    for (int i = 0; i < kGcChunk; ++i) {
      const float* arow = as + i * kGcAPitch;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int j = 0; j + 1 < i; j += 2) {
        const float2 a2 = *reinterpret_cast<const float2*>(arow + j);
        s0 = fmaf(a2.x, x[j], s0);
        s1 = fmaf(a2.y, x[j + 1], s1);
      }
      if (i & 1) s0 = fmaf(arow[i - 1], x[i - 1], s0);
      x[i] = (i == c ? 1.f : 0.f) - (s0 + s1);
    }
    const float bc = bet[c];
    const float bgc = bc * expf(gcum[c]);
#pragma unroll
    for (int i = 0; i < kGcChunk; ++i) {
      tw[i * kGcTPitch + c] = __float2half_rn(x[i] * bgc);
      tu[i * kGcTPitch + c] = __float2half_rn(x[i] * bc);
    }
  } else {
    // meanwhile warps 2..7: P = Q K^T e^(G_i - G_j) for j <= i, zeros above, to scratch;
    // the 16 tiles of 64 x 64 go round the six warps
    for (int t = warp - 2; t < 16; t += kGcWarps - 2) {
      const int rt = t >> 2;
      const int ct = t & 3;
      float acc[8];
      gc_zero(acc);
      if (ct <= rt)
        gc_mma<Arch, kGcDk, true, kGcBK>(acc, qs + 16 * rt * kGcKPitch, kGcKPitch, 1,
                                        ks + 16 * ct * kGcKPitch, 1, kGcKPitch);
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int r = 16 * rt + Tile::row(lane, i);
        const int c = 16 * ct + Tile::col(lane, i);  // c + 1 is accumulator i + 1's
        if (r < len) {
          const float x0 = c <= r ? acc[i] * expf(gcum[r] - gcum[c]) : 0.f;
          const float x1 = c + 1 <= r ? acc[i + 1] * expf(gcum[r] - gcum[c + 1]) : 0.f;
          *reinterpret_cast<__half2*>(sc.pm + ((int64_t)(c0 + r) * row_stride + hv) * kGcChunk +
                                      c) = __floats2half2_rn(x0, x1);
        }
      }
    }
  }
  __syncthreads();

  // U = Tu V and W = Tw K [64 x 128] each: warp w takes row tile w / 2 and column tiles
  // 4 (w % 2) .. + 3 of both, straight to scratch
  {
    const int rt = warp >> 1;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ct = 4 * (warp & 1) + e;
      float acc[8];
      gc_zero(acc);
      gc_mma<Arch, kGcChunk, true, kGcBN>(acc, tu + 16 * rt * kGcTPitch, kGcTPitch, 1,
                                          vs + 16 * ct, kG2VPitch, 1);
      float wacc[8];
      gc_zero(wacc);
      gc_mma<Arch, kGcChunk, true, kGcBN>(wacc, tw + 16 * rt * kGcTPitch, kGcTPitch, 1,
                                          ks + 16 * ct, kGcKPitch, 1);
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int r = 16 * rt + Tile::row(lane, i);
        if (r < len) {
          const int64_t off = ((int64_t)(c0 + r) * row_stride + hv) * kGcDv + 16 * ct +
                              Tile::col(lane, i);
          *reinterpret_cast<__half2*>(sc.u + off) = __floats2half2_rn(acc[i], acc[i + 1]);
          *reinterpret_cast<__half2*>(sc.w + off) = __floats2half2_rn(wacc[i], wacc[i + 1]);
        }
      }
    }
  }
}

// Rows 0..63 of a scratch tensor [T, HV, width] fp16 for tokens c0 .. c0 + 63 of head hv
// (columns col0 .. col0 + cols - 1) into dst [64][pitch]; rows >= len are zeros. 8-byte
// pieces, the block's threads in turn.
__device__ __forceinline__ void g2_load_rows(const __half* src, int64_t num_v_heads, int width,
                                             int hv, int c0, int len, int col0, int cols,
                                             __half* dst, int pitch) {
  const int per_row = cols / 4;
  for (int e = threadIdx.x; e < kGcChunk * per_row; e += kGcThreads) {
    const int r = e / per_row;
    const int c = 4 * (e % per_row);
    uint2 w = make_uint2(0u, 0u);
    if (r < len)
      w = *reinterpret_cast<const uint2*>(src + ((int64_t)(c0 + r) * num_v_heads + hv) * width +
                                          col0 + c);
    *reinterpret_cast<uint2*>(dst + r * pitch + c) = w;
  }
}

// grid (kGcSlices, HV, N), kGcThreads threads, kG2StateSmemBytes of dynamic shared memory.
template <class Arch>
__global__ void __launch_bounds__(kGcThreads, 1)
    gdn_chunk_state_kernel(const GdnChunkParams p, const GdnTwoPassScratch sc) {
  extern __shared__ __align__(16) unsigned char g2_smem[];
  using Tile = GcTile<Arch>;
  __half* qs = reinterpret_cast<__half*>(g2_smem);
  __half* ks = reinterpret_cast<__half*>(g2_smem + kG2OffSK);
  __half* ws = reinterpret_cast<__half*>(g2_smem + kG2OffSW);
  __half* ps = reinterpret_cast<__half*>(g2_smem + kG2OffSP);
  __half* us = reinterpret_cast<__half*>(g2_smem + kG2OffSU);  // U, then V'
  __half* vdt = reinterpret_cast<__half*>(g2_smem + kG2OffSVd);
  __half* hs = reinterpret_cast<__half*>(g2_smem + kG2OffSH);
  float* gcum = reinterpret_cast<float*>(g2_smem + kG2OffSG);

  const int slice = blockIdx.x;
  const int hv = blockIdx.y;
  const int n = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int v0 = slice * kGcBV;
  const int bos = p.query_start_loc[n];
  const int eos = p.query_start_loc[n + 1];
  if (eos <= bos) return;
  const int64_t slot = p.state_indices[(int64_t)n * p.indices_stride];
  const int64_t out_tok = (int64_t)p.num_v_heads * kGcDv;
  __half* out = p.out + (int64_t)hv * kGcDv + v0;
  if (slot <= 0) {  // padding: zero output, no state
    for (int e = tid; e < (eos - bos) * kGcBV; e += kGcThreads)
      out[(int64_t)(bos + e / kGcBV) * out_tok + e % kGcBV] = __float2half(0.f);
    return;
  }
  const int h = hv / (p.num_v_heads / p.num_k_heads);
  float* state = p.state + slot * p.state_slot_stride + ((int64_t)hv * kGcDv + v0) * kGcDk;
  const bool init = p.has_initial_state != nullptr && p.has_initial_state[n];

  float hreg[2][8];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int d = 16 * warp + Tile::row(lane, i);
      const int v = 16 * c + Tile::col(lane, i);
      const float x = init ? state[v * kGcDk + d] : 0.f;
      hreg[c][i] = x;
      hs[v * kGcKPitch + d] = __float2half_rn(x);
    }

  for (int c0 = bos; c0 < eos; c0 += kGcChunk) {
    const int len = min(kGcChunk, eos - c0);
    gc_load_normed(p, c0, len, h * kGcDk, p.scale, qs);
    gc_load_normed(p, c0, len, (p.num_k_heads + h) * kGcDk, 1.f, ks);
    g2_load_rows(sc.w, p.num_v_heads, kGcDv, hv, c0, len, 0, kGcDv, ws, kGcKPitch);
    g2_load_rows(sc.pm, p.num_v_heads, kGcChunk, hv, c0, len, 0, kGcChunk, ps, kGcTPitch);
    g2_load_rows(sc.u, p.num_v_heads, kGcDv, hv, c0, len, v0, kGcBV, us, kGcVPitch);
    if (tid < kGcChunk)  // padding rows keep the last G (their g is 0)
      gcum[tid] = sc.gc[(int64_t)(c0 + min(tid, len - 1)) * p.num_v_heads + hv];
    __syncthreads();

    // V' = U - W H (one tile per warp, into U)
    {
      const int rt = warp >> 1;
      float acc[8];
      gc_zero(acc);
      gc_mma<Arch, kGcDk, true, kGcBK>(acc, ws + 16 * rt * kGcKPitch, kGcKPitch, 1,
                                      hs + 16 * (warp & 1) * kGcKPitch, 1, kGcKPitch);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        __half* u = us + (16 * rt + Tile::row(lane, i)) * kGcVPitch + 16 * (warp & 1) +
                    Tile::col(lane, i);
        *u = __float2half_rn(__half2float(*u) - acc[i]);
      }
    }
    __syncthreads();

    // O = diag(e^G) Q H + P V'; V' decayed to the chunk's end, transposed
    {
      const int rt = warp >> 1;
      const int ct = warp & 1;
      float acc[8];
      gc_zero(acc);
      gc_mma<Arch, kGcDk, true, kGcBK>(acc, qs + 16 * rt * kGcKPitch, kGcKPitch, 1,
                                      hs + 16 * ct * kGcKPitch, 1, kGcKPitch);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] *= expf(gcum[16 * rt + Tile::row(lane, i)]);
      gc_mma<Arch, kGcChunk, true, kGcBN>(acc, ps + 16 * rt * kGcTPitch, kGcTPitch, 1,
                                          us + 16 * ct, kGcVPitch, 1);
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int r = 16 * rt + Tile::row(lane, i);
        if (r < len)
          *reinterpret_cast<__half2*>(out + (int64_t)(c0 + r) * out_tok + 16 * ct +
                                      Tile::col(lane, i)) = __floats2half2_rn(acc[i], acc[i + 1]);
      }
      const float g_last = gcum[kGcChunk - 1];
      for (int e = tid; e < kGcChunk * kGcBV; e += kGcThreads) {
        const int j = e / kGcBV;
        const int v = e % kGcBV;
        vdt[v * kGcVtPitch + j] =
            __float2half_rn(__half2float(us[j * kGcVPitch + v]) * expf(g_last - gcum[j]));
      }
    }
    __syncthreads();

    // H = e^(G_last) H + K^T (V' decayed)
    {
      const float decay = expf(gcum[kGcChunk - 1]);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int i = 0; i < 8; ++i) hreg[c][i] *= decay;
        gc_mma<Arch, kGcChunk, false, kGcBK>(hreg[c], ks + 16 * warp, 1, kGcKPitch,
                                            vdt + 16 * c * kGcVtPitch, 1, kGcVtPitch);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          hs[(16 * c + Tile::col(lane, i)) * kGcKPitch + 16 * warp + Tile::row(lane, i)] =
              __float2half_rn(hreg[c][i]);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      state[(16 * c + Tile::col(lane, i)) * kGcDk + 16 * warp + Tile::row(lane, i)] = hreg[c][i];
}

#ifndef __CUDACC_RTC__
template <class Arch>
inline cudaError_t launch_gdn_chunk_two_pass(const GdnChunkParams& p,
                                             const GdnTwoPassScratch& sc, int num_chunks,
                                             int num_seqs, cudaStream_t stream) {
  if (num_seqs == 0 || num_chunks == 0) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(gdn_chunk_wy_kernel<Arch>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kG2WySmemBytes);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(gdn_chunk_state_kernel<Arch>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kG2StateSmemBytes);
  if (e != cudaSuccess) return e;
  gdn_chunk_wy_kernel<Arch>
      <<<dim3(num_chunks, p.num_v_heads), kGcThreads, kG2WySmemBytes, stream>>>(p, sc);
  gdn_chunk_state_kernel<Arch><<<dim3(kGcSlices, p.num_v_heads, num_seqs), kGcThreads,
                                 kG2StateSmemBytes, stream>>>(p, sc);
  return cudaGetLastError();
}
#endif

}  // namespace sm70
