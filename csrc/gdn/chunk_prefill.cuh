// Gated DeltaNet chunked prefill on tensor cores: the gated delta rule forward over
// variable-length sequences (cu_seqlens = query_start_loc), 64 tokens per chunk, in the WY
// form, every matrix product on mma.sync (m8n8k4 on Volta), fp16 operands, fp32
// accumulators, fp32 state.
//
// What it computes (vllm_patch/ops/reference_gdn.py, gdn_prefill_reference, is the
// definition): per sequence n and value head hv (key head hv / (HV / H)), from the conv
// output qkv, gates a, b and the state slot state_indices[n] (its state if
// has_initial_state[n], else zeros), the same recurrence as recurrent_decode.cuh over all
// of the sequence's tokens; the final state goes back to the slot, the outputs to out
// [T, HV, 128] fp16. A sequence whose slot is <= 0 writes zero outputs and no state.
//
// Per chunk of L <= 64 tokens, G_i = sum_{j <= i} g_j within the chunk, H = h^T [dk, dv]:
//   A = strictly-lower(beta_i k_i.k_j exp(G_i - G_j)),  T = (I + A)^-1 (fp32, CUDA cores:
//   forward substitution, one column of T per thread, in registers)
//   W = T diag(beta exp(G)) K,  U = T diag(beta) V,  V' = U - W H
//   O = diag(exp(G)) Q H + (Q K^T exp(G_i - G_j), j <= i) V'
//   H <- exp(G_last) H + K^T diag(exp(G_last - G_j)) V'
// Padding rows of a short chunk have q = k = v = 0, g = 0, beta = 0, so they add nothing.
//
// Work split: one block of 8 warps per (32 value columns of one head, head, sequence).
// The value columns of H evolve independently given K, W and the gates, so the four
// blocks of a head split the state and the value-side products; each recomputes the
// chunk's key-side matrices (A, T, W, Q K^T), which keeps the kernel single-pass and
// gives the grid 4 HV blocks per sequence. The block's slice of H stays in registers
// (16 rows of dk x 16 columns per tile, two tiles per warp) for the whole sequence, with an
// fp16 copy in shared memory (stored as h, [v][dk], so it is a k-contiguous B operand).
//
// Shared memory (dynamic; Volta allows 96 KB per block): Q, K and a region that holds
// A in fp32 and then W in fp16 (64 x 128 fp16 each, pitch 132); T diag(beta exp(G))
// and T diag(beta) in fp16, later Q K^T masked; the value slice V then V' decayed and
// transposed; U then V'; the fp16 state copy; the gates.
//
// Architecture tags (common/arch.cuh): arch::Sm70 issues m8n8k4, arch::Sm80 the same
// products as m16n8k16 (the sm_80+ test GPU, where m8n8k4 is emulated).
#pragma once

#include "gdn/chunk_common.cuh"

namespace sm70 {

constexpr int kGcOffK = kGcQBytes;
constexpr int kGcOffR1 = kGcOffK + kGcQBytes;
constexpr int kGcOffR2 = kGcOffR1 + kGcR1Bytes;  // Tw, Tu; later P (in Tw's place)
constexpr int kGcOffV = kGcOffR2 + 2 * kGcTBytes;
constexpr int kGcOffU = kGcOffV + kGcVBytes;
constexpr int kGcOffH = kGcOffU + kGcVBytes;
constexpr int kGcOffG = kGcOffH + kGcHBytes;  // G [64], beta [64]
constexpr int kGcSmemBytes = kGcOffG + 2 * kGcChunk * 4;
static_assert(kGcSmemBytes <= 96 * 1024, "Volta: at most 96 KB of shared memory per block");
static_assert(kGcOffK % 16 == 0 && kGcOffR1 % 16 == 0 && kGcOffR2 % 16 == 0 &&
                  kGcOffV % 16 == 0 && kGcOffU % 16 == 0 && kGcOffH % 16 == 0 &&
                  kGcOffG % 16 == 0,
              "16-byte aligned sub-buffers");

// grid (kGcSlices, HV, N), kGcThreads threads, kGcSmemBytes of dynamic shared memory.
template <class Arch>
__global__ void __launch_bounds__(kGcThreads, 1) gdn_chunk_prefill_kernel(const GdnChunkParams p) {
  extern __shared__ __align__(16) unsigned char gc_smem[];
  using Tile = GcTile<Arch>;
  __half* qs = reinterpret_cast<__half*>(gc_smem);
  __half* ks = reinterpret_cast<__half*>(gc_smem + kGcOffK);
  float* as = reinterpret_cast<float*>(gc_smem + kGcOffR1);  // A (fp32)
  __half* ws = reinterpret_cast<__half*>(gc_smem + kGcOffR1);
  __half* tw = reinterpret_cast<__half*>(gc_smem + kGcOffR2);  // T diag(beta exp(G))
  __half* tu = reinterpret_cast<__half*>(gc_smem + kGcOffR2 + kGcTBytes);  // T diag(beta)
  __half* ps = tw;  // masked, decayed Q K^T once W and U are made
  __half* vs = reinterpret_cast<__half*>(gc_smem + kGcOffV);  // V slice
  __half* vdt = vs;  // V' decayed to the chunk's end, transposed [kGcBV][kGcVtPitch]
  __half* us = reinterpret_cast<__half*>(gc_smem + kGcOffU);  // U, then V'
  __half* hs = reinterpret_cast<__half*>(gc_smem + kGcOffH);  // h fp16 [kGcBV][kGcKPitch]
  float* gcum = reinterpret_cast<float*>(gc_smem + kGcOffG);  // G (inclusive cumsum)
  float* bet = gcum + kGcChunk;

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
    gc_zero_outputs(out, bos, eos, out_tok);
    return;
  }
  const int h = hv / (p.num_v_heads / p.num_k_heads);
  const int v_col = 2 * p.num_k_heads * kGcDk + hv * kGcDv + v0;
  const GdnHeadGate hg = gdn_head_gate(p, hv);
  float* state = p.state + slot * p.state_slot_stride + ((int64_t)hv * kGcDv + v0) * kGcDk;
  const bool init = p.has_initial_state != nullptr && p.has_initial_state[n];

  float hreg[2][8];
  gc_state_load<Arch>(state, init, hreg, hs);

  for (int c0 = bos; c0 < eos; c0 += kGcChunk) {
    const int len = min(kGcChunk, eos - c0);
    // ---- loads: q, k normalised (q times scale), the value slice, the gates
    gc_load_qk(p, c0, len, h, qs, ks);
    {
      const int r = tid >> 2;
      const int cc = 8 * (tid & 3);
      uint2 w0 = make_uint2(0u, 0u), w1 = make_uint2(0u, 0u);
      if (r < len) {
        const uint2* src =
            reinterpret_cast<const uint2*>(p.qkv + (int64_t)(c0 + r) * p.qkv_stride + v_col + cc);
        w0 = src[0];
        w1 = src[1];
      }
      uint2* dst = reinterpret_cast<uint2*>(vs + r * kGcVPitch + cc);
      dst[0] = w0;
      dst[1] = w1;
    }
    gc_chunk_gates(p, hg, c0, len, hv, gcum, bet);

    gc_build_a<Arch>(ks, gcum, bet, len, as);
    __syncthreads();

    // ---- T = (I + A)^-1 (one column per thread of warps 0 and 1) into Tw and Tu
    if (tid < kGcChunk) gc_solve_t(as, gcum, bet, tid, tw, tu);
    __syncthreads();

    // ---- U = Tu V [64 x 32] (one tile per warp), W = Tw K [64 x 128] (four per warp)
    {
      const int rt = warp >> 1;
      float acc[8];
      gc_zero(acc);
      gc_mma<Arch, kGcChunk, true, kGcBN>(acc, tu + 16 * rt * kGcTPitch, kGcTPitch, 1,
                                          vs + 16 * (warp & 1), kGcVPitch, 1);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        us[(16 * rt + Tile::row(lane, i)) * kGcVPitch + 16 * (warp & 1) + Tile::col(lane, i)] =
            __float2half_rn(acc[i]);
      // W goes where A was: A's last reads (the solve) ended at the barrier above
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ct = 4 * (warp & 1) + e;
        gc_zero(acc);
        gc_mma<Arch, kGcChunk, true, kGcBN>(acc, tw + 16 * rt * kGcTPitch, kGcTPitch, 1,
                                            ks + 16 * ct, kGcKPitch, 1);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          ws[(16 * rt + Tile::row(lane, i)) * kGcKPitch + 16 * ct + Tile::col(lane, i)] =
              __float2half_rn(acc[i]);
      }
    }
    __syncthreads();

    // ---- P = Q K^T exp(G_i - G_j) for j <= i (into Tw's place); V' = U - W H (into U)
    {
      const int rt = warp >> 1;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int ct = 2 * (warp & 1) + e;
        float acc[8];
        gc_lower_tile<Arch>(acc, qs, ks, rt, ct);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = 16 * rt + Tile::row(lane, i);
          const int c = 16 * ct + Tile::col(lane, i);
          const float x = c <= r ? acc[i] * expf(gcum[r] - gcum[c]) : 0.f;
          ps[r * kGcTPitch + c] = __float2half_rn(x);
        }
      }
      gc_v_new<Arch>(ws, hs, us);
    }
    __syncthreads();

    // ---- O = diag(exp(G)) Q H + P V' (one tile per warp); V' decayed, transposed
    gc_outputs<Arch>(qs, hs, ps, us, gcum, c0, len, out, out_tok, vdt);
    __syncthreads();

    // ---- H = exp(G_last) H + K^T (V' decayed)
    gc_state_update<Arch>(ks, vdt, gcum, hreg, hs);
    __syncthreads();
  }

  gc_state_store<Arch>(state, hreg);
}

#ifndef __CUDACC_RTC__
template <class Arch>
inline cudaError_t launch_gdn_chunk_prefill(const GdnChunkParams& p, int num_seqs,
                                            cudaStream_t stream) {
  if (num_seqs == 0) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(gdn_chunk_prefill_kernel<Arch>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             kGcSmemBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(kGcSlices, p.num_v_heads, num_seqs);
  gdn_chunk_prefill_kernel<Arch><<<grid, kGcThreads, kGcSmemBytes, stream>>>(p);
  return cudaGetLastError();
}
#endif

}  // namespace sm70
