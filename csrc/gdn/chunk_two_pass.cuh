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

#include "gdn/chunk_common.cuh"

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
  const GdnHeadGate hg = gdn_head_gate(p, hv);

  gc_load_qk(p, c0, len, h, qs, ks);
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
  gc_chunk_gates(p, hg, c0, len, hv, gcum, bet);
  if (tid < len) sc.gc[(int64_t)(c0 + tid) * p.num_v_heads + hv] = gcum[tid];

  gc_build_a<Arch>(ks, gcum, bet, len, as);
  __syncthreads();

  const int64_t row_stride = (int64_t)p.num_v_heads;  // scratch rows: token, then head
  if (warp < 2) {
    // T = (I + A)^-1, one column per thread, into Tw and Tu
    gc_solve_t(as, gcum, bet, tid, tw, tu);
  } else {
    // meanwhile warps 2..7: P = Q K^T e^(G_i - G_j) for j <= i, zeros above, to scratch;
    // the 16 tiles of 64 x 64 go round the six warps
    for (int t = warp - 2; t < 16; t += kGcWarps - 2) {
      const int rt = t >> 2;
      const int ct = t & 3;
      float acc[8];
      gc_lower_tile<Arch>(acc, qs, ks, rt, ct);
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
  const int v0 = slice * kGcBV;
  const int bos = p.query_start_loc[n];
  const int eos = p.query_start_loc[n + 1];
  if (eos <= bos) return;
  const int64_t slot = p.state_indices[(int64_t)n * p.indices_stride];
  const int64_t out_tok = (int64_t)p.num_v_heads * kGcDv;
  __half* out = p.out + (int64_t)hv * kGcDv + v0;
  if (slot <= 0) {  // padding: zero output, no state
    gc_zero_outputs(out, bos, eos, out_tok);
    return;
  }
  const int h = hv / (p.num_v_heads / p.num_k_heads);
  float* state = p.state + slot * p.state_slot_stride + ((int64_t)hv * kGcDv + v0) * kGcDk;
  const bool init = p.has_initial_state != nullptr && p.has_initial_state[n];

  float hreg[2][8];
  gc_state_load<Arch>(state, init, hreg, hs);

  for (int c0 = bos; c0 < eos; c0 += kGcChunk) {
    const int len = min(kGcChunk, eos - c0);
    gc_load_qk(p, c0, len, h, qs, ks);
    g2_load_rows(sc.w, p.num_v_heads, kGcDv, hv, c0, len, 0, kGcDv, ws, kGcKPitch);
    g2_load_rows(sc.pm, p.num_v_heads, kGcChunk, hv, c0, len, 0, kGcChunk, ps, kGcTPitch);
    g2_load_rows(sc.u, p.num_v_heads, kGcDv, hv, c0, len, v0, kGcBV, us, kGcVPitch);
    if (tid < kGcChunk)  // padding rows keep the last G (their g is 0)
      gcum[tid] = sc.gc[(int64_t)(c0 + min(tid, len - 1)) * p.num_v_heads + hv];
    __syncthreads();

    gc_v_new<Arch>(ws, hs, us);  // V' = U - W H
    __syncthreads();

    // O = diag(e^G) Q H + P V'; V' decayed to the chunk's end, transposed
    gc_outputs<Arch>(qs, hs, ps, us, gcum, c0, len, out, out_tok, vdt);
    __syncthreads();

    gc_state_update<Arch>(ks, vdt, gcum, hreg, hs);  // H = e^(G_last) H + K^T (V' decayed)
    __syncthreads();
  }

  gc_state_store<Arch>(state, hreg);
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
