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

#include "common/arch.cuh"
#include "common/mma.cuh"
#include "common/sm70.cuh"

namespace sm70 {

constexpr int kGcChunk = 64;   // tokens per chunk
constexpr int kGcDk = 128;     // key head size
constexpr int kGcDv = 128;     // value head size
constexpr int kGcBV = 32;      // value columns per block
constexpr int kGcSlices = kGcDv / kGcBV;
constexpr int kGcWarps = 8;
constexpr int kGcThreads = kGcWarps * 32;
constexpr int kGcKPitch = 132;  // halves per Q / K / W row
constexpr int kGcTPitch = 72;   // halves per row of the 64 x 64 fp16 matrices
constexpr int kGcAPitch = 66;   // floats per row of A (8-byte aligned rows)
constexpr int kGcVPitch = 40;   // halves per row of V, U, V' (64 x 32)
constexpr int kGcVtPitch = 72;  // halves per row of V' transposed (32 x 64)

constexpr int kGcQBytes = kGcChunk * kGcKPitch * 2;
constexpr int kGcR1Bytes = kGcQBytes;  // A fp32 (64 x 66 x 4 fits), then W fp16
constexpr int kGcTBytes = kGcChunk * kGcTPitch * 2;
constexpr int kGcVBytes = kGcChunk * kGcVPitch * 2;  // >= kGcBV * kGcVtPitch * 2
constexpr int kGcHBytes = kGcBV * kGcKPitch * 2;
constexpr int kGcOffK = kGcQBytes;
constexpr int kGcOffR1 = kGcOffK + kGcQBytes;
constexpr int kGcOffR2 = kGcOffR1 + kGcR1Bytes;  // Tw, Tu; later P (in Tw's place)
constexpr int kGcOffV = kGcOffR2 + 2 * kGcTBytes;
constexpr int kGcOffU = kGcOffV + kGcVBytes;
constexpr int kGcOffH = kGcOffU + kGcVBytes;
constexpr int kGcOffG = kGcOffH + kGcHBytes;  // G [64], beta [64]
constexpr int kGcSmemBytes = kGcOffG + 2 * kGcChunk * 4;
static_assert(kGcChunk * kGcAPitch * 4 <= kGcR1Bytes, "A fits where W goes");
static_assert(kGcBV * kGcVtPitch * 2 <= kGcVBytes, "V' transposed fits where V was");
static_assert(kGcSmemBytes <= 96 * 1024, "Volta: at most 96 KB of shared memory per block");
static_assert(kGcOffK % 16 == 0 && kGcOffR1 % 16 == 0 && kGcOffR2 % 16 == 0 &&
                  kGcOffV % 16 == 0 && kGcOffU % 16 == 0 && kGcOffH % 16 == 0 &&
                  kGcOffG % 16 == 0,
              "16-byte aligned sub-buffers");

struct GdnChunkParams {
  const __half* qkv;  // [T, 2 H dk + HV dv], token stride qkv_stride (elements)
  int64_t qkv_stride;
  const __half* a;  // [T, HV], token stride a_stride
  int64_t a_stride;
  const __half* b;
  int64_t b_stride;
  const float* A_log;         // [HV]
  const float* dt_bias_f32;   // [HV], one of the two is set
  const __half* dt_bias_f16;  // [HV]
  float* state;               // [slots, HV, dv, dk] float32, slot stride below
  int64_t state_slot_stride;  // elements
  const int32_t* query_start_loc;    // [N + 1]
  const int32_t* state_indices;      // [N, ...], row stride indices_stride, column 0 used
  int64_t indices_stride;
  const bool* has_initial_state;     // [N] or null (all start from zeros)
  __half* out;                       // [T, HV, dv]
  int num_k_heads;
  int num_v_heads;
  float scale;
};

__device__ __forceinline__ uint32_t gc_pack(__half lo, __half hi) {
  const __half2 h = __halves2half2(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// One warp's 16 x 16 fp32 tile: 8 accumulators per lane on both tags; row(i) / col(i) give
// the tile coordinates of accumulator i (common/mma.cuh's fragment layouts: for m8n8k4,
// quad pair qp takes rows 8 (qp & 1) and columns 8 (qp >> 1); for m16n8k16, accumulators
// 4 j .. 4 j + 3 are the n8 tile j).
template <class Arch>
struct GcTile {
  static __device__ __forceinline__ int row(int lane, int i) {
    if constexpr (Arch::kM16n8k16) {
      return (lane >> 2) + 8 * ((i & 3) >> 1);
    } else {
      return 8 * ((lane >> 2) & 1) + (lane & 1) + (i & 2) + 4 * (lane >> 4);
    }
  }
  static __device__ __forceinline__ int col(int lane, int i) {
    if constexpr (Arch::kM16n8k16) {
      return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    } else {
      return 8 * (((lane >> 2) & 3) >> 1) + (lane & 2) + (i & 4) + (i & 1);
    }
  }
};

// How a B operand lies in shared memory: contiguous along k (b_ks = 1), along n (b_cs = 1),
// or neither (element loads).
constexpr int kGcBK = 1;
constexpr int kGcBN = 2;

// acc (a 16 x 16 tile) += A [16 x K] B [K x 16], fp16 in shared memory: A element (r, k)
// at a[r * a_rs + k * a_ks], B element (k, c) at b[k * b_ks + c * b_cs] (a, b already at
// the tile's first row / column). AK: A is contiguous along k; BL: kGcBK or kGcBN. A k run
// (or, with kGcBN on m8n8k4, the 4 columns of one k row that the row.row form takes) is one
// vector load: 8 bytes for m8n8k4, 4 for m16n8k16.
template <class Arch, int K, bool AK, int BL>
__device__ __forceinline__ void gc_mma(float (&acc)[8], const __half* a, int a_rs, int a_ks,
                                       const __half* b, int b_ks, int b_cs) {
  constexpr bool BK = BL == kGcBK;
  const int lane = threadIdx.x & 31;
  if constexpr (Arch::kM16n8k16) {
    const int g = lane >> 2;
    const int t2 = 2 * (lane & 3);
#pragma unroll 4
    for (int k0 = 0; k0 < K; k0 += 16) {
      uint32_t af[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r & 1);
        const int k = k0 + t2 + 8 * (r >> 1);
        if constexpr (AK) {
          af[r] = *reinterpret_cast<const uint32_t*>(a + row * a_rs + k);
        } else {
          af[r] = gc_pack(a[row * a_rs + k * a_ks], a[row * a_rs + (k + 1) * a_ks]);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = 8 * j + g;
        uint32_t bf[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int k = k0 + t2 + 8 * r;
          if constexpr (BK) {
            bf[r] = *reinterpret_cast<const uint32_t*>(b + c * b_cs + k);
          } else {
            bf[r] = gc_pack(b[k * b_ks + c * b_cs], b[(k + 1) * b_ks + c * b_cs]);
          }
        }
        mma_m16n8k16(*reinterpret_cast<float(*)[4]>(&acc[4 * j]), af, bf);
      }
    }
  } else {
    const int qp = (lane >> 2) & 3;
    const int q4 = (lane & 3) + 4 * (lane >> 4);
    const int ar = 8 * (qp & 1) + q4;   // this lane's A row
    const int bc = 8 * (qp >> 1) + q4;  // this lane's B column
#pragma unroll 4
    for (int k0 = 0; k0 < K; k0 += 4) {
      uint32_t af[2], bf[2];
      if constexpr (AK) {
        const uint2 w = *reinterpret_cast<const uint2*>(a + ar * a_rs + k0);
        af[0] = w.x;
        af[1] = w.y;
      } else {
        const __half* p = a + ar * a_rs + k0 * a_ks;
        af[0] = gc_pack(p[0], p[a_ks]);
        af[1] = gc_pack(p[2 * a_ks], p[3 * a_ks]);
      }
      if constexpr (BL == kGcBN) {
        // row.row form (common/mma.cuh): this lane's k is k0 + lane % 4, its columns the
        // quad pair's 8 (qp >> 1) + 4 (lane >= 16) .. + 3
        const uint2 w = *reinterpret_cast<const uint2*>(b + (k0 + (lane & 3)) * b_ks +
                                                        8 * (qp >> 1) + 4 * (lane >> 4));
        bf[0] = w.x;
        bf[1] = w.y;
        mma_m8n8k4_rr(acc, af, bf);
      } else {
        if constexpr (BK) {
          const uint2 w = *reinterpret_cast<const uint2*>(b + bc * b_cs + k0);
          bf[0] = w.x;
          bf[1] = w.y;
        } else {
          const __half* p = b + bc * b_cs + k0 * b_ks;
          bf[0] = gc_pack(p[0], p[b_ks]);
          bf[1] = gc_pack(p[2 * b_ks], p[3 * b_ks]);
        }
        mma_m8n8k4(acc, af, bf);
      }
    }
  }
}

__device__ __forceinline__ void gc_zero(float (&acc)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
}

// Rows 0..63 of a 128-wide fp16 head (token c0 + r, column offset col in the qkv row),
// L2-normalised (x / sqrt(sum x^2 + 1e-6)) and times mul, into dst [64][kGcKPitch];
// rows >= len are zeros. Each warp takes 8 rows, each lane 4 values of a row.
__device__ __forceinline__ void gc_load_normed(const GdnChunkParams& p, int c0, int len,
                                               int col, float mul, __half* dst) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll 2
  for (int i = 0; i < kGcChunk / kGcWarps; ++i) {
    const int r = warp + kGcWarps * i;
    uint2 w = make_uint2(0u, 0u);
    if (r < len) w = *reinterpret_cast<const uint2*>(p.qkv + (int64_t)(c0 + r) * p.qkv_stride +
                                                     col + 4 * lane);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
    float ss = lo.x * lo.x + lo.y * lo.y + hi.x * hi.x + hi.y * hi.y;
    ss = warp_sum(ss);
    const float s = rsqrtf(ss + 1e-6f) * mul;
    const __half2 o0 = __floats2half2_rn(lo.x * s, lo.y * s);
    const __half2 o1 = __floats2half2_rn(hi.x * s, hi.y * s);
    *reinterpret_cast<uint2*>(dst + r * kGcKPitch + 4 * lane) = make_uint2(
        *reinterpret_cast<const uint32_t*>(&o0), *reinterpret_cast<const uint32_t*>(&o1));
  }
}

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
    for (int e = tid; e < (eos - bos) * kGcBV; e += kGcThreads)
      out[(int64_t)(bos + e / kGcBV) * out_tok + e % kGcBV] = __float2half(0.f);
    return;
  }
  const int h = hv / (p.num_v_heads / p.num_k_heads);
  const int q_col = h * kGcDk;
  const int k_col = (p.num_k_heads + h) * kGcDk;
  const int v_col = 2 * p.num_k_heads * kGcDk + hv * kGcDv + v0;
  const float neg_a = -expf(p.A_log[hv]);
  const float dt_bias = p.dt_bias_f32 ? p.dt_bias_f32[hv] : __half2float(p.dt_bias_f16[hv]);
  float* state = p.state + slot * p.state_slot_stride + ((int64_t)hv * kGcDv + v0) * kGcDk;
  const bool init = p.has_initial_state != nullptr && p.has_initial_state[n];

  // the block's state slice H [dk rows, kGcBV columns]: warp w owns rows 16 w .. + 15,
  // tiles of columns 0..15 and 16..31
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
    // ---- loads: q, k normalised (q times scale), the value slice, the gates
    gc_load_normed(p, c0, len, q_col, p.scale, qs);
    gc_load_normed(p, c0, len, k_col, 1.f, ks);
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
    if (warp == 0) {  // inclusive cumsum of g: two values per lane, then a warp scan
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

    // ---- A = beta_i k_i.k_j exp(G_i - G_j) below the diagonal, 1 on it, 0 above
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

    // ---- T = (I + A)^-1 by forward substitution, one column per thread of warps 0 and 1:
    // column c of T solves (I + A) x = e_c, x_i = [i == c] - sum_{j < i} A[i][j] x_j (which
    // leaves x_i = 0 above the diagonal), in registers with no barrier; the thread then
    // writes its column of Tw = T diag(beta exp(G)) and Tu = T diag(beta) in fp16
    if (tid < kGcChunk) {
      const int c = tid;
      float x[kGcChunk];
#pragma unroll
      for (int i = 0; i < kGcChunk; ++i) {
        const float* arow = as + i * kGcAPitch;  // read by every lane: a broadcast
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
    }
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
        gc_zero(acc);
        if (ct <= rt)
          gc_mma<Arch, kGcDk, true, kGcBK>(acc, qs + 16 * rt * kGcKPitch, kGcKPitch, 1,
                                          ks + 16 * ct * kGcKPitch, 1, kGcKPitch);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = 16 * rt + Tile::row(lane, i);
          const int c = 16 * ct + Tile::col(lane, i);
          const float x = c <= r ? acc[i] * expf(gcum[r] - gcum[c]) : 0.f;
          ps[r * kGcTPitch + c] = __float2half_rn(x);
        }
      }
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

    // ---- O = diag(exp(G)) Q H + P V' (one tile per warp); V' decayed, transposed
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
      for (int i = 0; i < 8; i += 2) {  // accumulators i, i + 1: one row, columns c, c + 1
        const int r = 16 * rt + Tile::row(lane, i);
        if (r < len)
          *reinterpret_cast<__half2*>(out + (int64_t)(c0 + r) * out_tok + 16 * ct +
                                      Tile::col(lane, i)) = __floats2half2_rn(acc[i], acc[i + 1]);
      }
      const float g_last = gcum[kGcChunk - 1];  // padding rows have g = 0
      for (int e = tid; e < kGcChunk * kGcBV; e += kGcThreads) {
        const int j = e / kGcBV;
        const int v = e % kGcBV;
        vdt[v * kGcVtPitch + j] =
            __float2half_rn(__half2float(us[j * kGcVPitch + v]) * expf(g_last - gcum[j]));
      }
    }
    __syncthreads();

    // ---- H = exp(G_last) H + K^T (V' decayed): warp w's rows 16 w .. + 15
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
