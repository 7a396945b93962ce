// The device code both Gated DeltaNet chunked prefills share (chunk_prefill.cuh, one pass;
// chunk_two_pass.cuh, two passes): the chunk geometry, the parameters, the warp tile and its
// mma on either architecture tag, and the steps of the chunk recurrence both run alike
// (loads, gates and their cumsum, A, T, V' = U - W H, the outputs, the state update).
// chunk_prefill.cuh's header comment describes the algorithm and the work split.
//
// Every step is a block-wide piece of the kernels' bodies, forceinline so that each kernel
// compiles to the code it had with the step written in place; a step that ends at a barrier
// says so, the others leave the barrier to the caller.
#pragma once

#include "common/arch.cuh"
#include "common/mma.cuh"
#include "common/sm70.cuh"
#include "gdn/inputs.cuh"

namespace sm70 {

constexpr int kGcChunk = 64;   // tokens per chunk
constexpr int kGcDk = 128;     // key head size
constexpr int kGcDv = 128;     // value head size
constexpr int kGcBV = 32;      // value columns per state block
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
static_assert(kGcChunk * kGcAPitch * 4 <= kGcR1Bytes, "A fits where W goes");
static_assert(kGcBV * kGcVtPitch * 2 <= kGcVBytes, "V' transposed fits where V was");

struct GdnChunkParams : GdnInputs {
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

// The chunk's q (normalised, times scale) into qs and k (normalised) into ks, key head h.
__device__ __forceinline__ void gc_load_qk(const GdnChunkParams& p, int c0, int len, int h,
                                           __half* qs, __half* ks) {
  gc_load_normed(p, c0, len, h * kGcDk, p.scale, qs);
  gc_load_normed(p, c0, len, (p.num_k_heads + h) * kGcDk, 1.f, ks);
}

// The chunk's gates of value head hv: beta into bet [64] and G, the inclusive cumsum of g
// within the chunk, into gcum [64] (rows >= len: g = 0, beta = 0, so G keeps its last value).
// Threads 0..63 compute a token each; then warp 0 scans, two values per lane. Ends at a
// barrier after the scan; the one before it also covers the caller's loads.
__device__ __forceinline__ void gc_chunk_gates(const GdnChunkParams& p, const GdnHeadGate& hg,
                                               int c0, int len, int hv, float* gcum,
                                               float* bet) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  if (tid < kGcChunk) {
    float g = 0.f, beta = 0.f;
    if (tid < len) gdn_gate(p, hg, c0 + tid, hv, g, beta);
    gcum[tid] = g;
    bet[tid] = beta;
  }
  __syncthreads();
  if ((tid >> 5) == 0) {  // inclusive cumsum of g: two values per lane, then a warp scan
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
}

// acc = rows rt of X times rows ct of K, transposed (16 x 16, over dk), for the tiles on or
// below the diagonal (ct <= rt); zeros above it. X is Q or K in shared memory.
template <class Arch>
__device__ __forceinline__ void gc_lower_tile(float (&acc)[8], const __half* xs,
                                              const __half* ks, int rt, int ct) {
  gc_zero(acc);
  if (ct <= rt)
    gc_mma<Arch, kGcDk, true, kGcBK>(acc, xs + 16 * rt * kGcKPitch, kGcKPitch, 1,
                                    ks + 16 * ct * kGcKPitch, 1, kGcKPitch);
}

// A = beta_i k_i.k_j exp(G_i - G_j) below the diagonal, 1 on it, 0 above, fp32 into as
// [64][kGcAPitch]: warp w takes row tile w / 2 and column tiles 2 (w % 2) .. + 1.
template <class Arch>
__device__ __forceinline__ void gc_build_a(const __half* ks, const float* gcum, const float* bet,
                                           int len, float* as) {
  using Tile = GcTile<Arch>;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int rt = warp >> 1;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int ct = 2 * (warp & 1) + e;
    float acc[8];
    gc_lower_tile<Arch>(acc, ks, ks, rt, ct);
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

// T = (I + A)^-1 by forward substitution, column c (0..63) by this thread: column c of T
// solves (I + A) x = e_c, x_i = [i == c] - sum_{j < i} A[i][j] x_j (which leaves x_i = 0
// above the diagonal), in registers with no barrier; then the thread writes its column of
// Tw = T diag(beta exp(G)) and Tu = T diag(beta) in fp16 ([64][kGcTPitch] each).
__device__ __forceinline__ void gc_solve_t(const float* as, const float* gcum, const float* bet,
                                           int c, __half* tw, __half* tu) {
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

// The state blocks' slice of H [dk rows, kGcBV columns]: warp w owns rows 16 w .. + 15 as
// two tiles (columns 0..15, 16..31) in hreg, with its fp16 copy in hs ([v][kGcKPitch], h's
// layout, so it is a k-contiguous B operand). state points at the slice's first row v0.
template <class Arch>
__device__ __forceinline__ void gc_state_load(const float* state, bool init,
                                              float (&hreg)[2][8], __half* hs) {
  using Tile = GcTile<Arch>;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
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
}

template <class Arch>
__device__ __forceinline__ void gc_state_store(float* state, const float (&hreg)[2][8]) {
  using Tile = GcTile<Arch>;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      state[(16 * c + Tile::col(lane, i)) * kGcDk + 16 * warp + Tile::row(lane, i)] = hreg[c][i];
}

// A padding sequence's (slot <= 0) outputs: zeros in the block's kGcBV columns of its rows
// bos .. eos - 1 (out at the block's first column, out_tok halves per token).
__device__ __forceinline__ void gc_zero_outputs(__half* out, int bos, int eos, int64_t out_tok) {
  for (int e = threadIdx.x; e < (eos - bos) * kGcBV; e += kGcThreads)
    out[(int64_t)(bos + e / kGcBV) * out_tok + e % kGcBV] = __float2half(0.f);
}

// V' = U - W H in fp16, into us (U [64][kGcVPitch], W [64][kGcKPitch], H from hs): one tile
// per warp, row tile w / 2, column tile w % 2.
template <class Arch>
__device__ __forceinline__ void gc_v_new(const __half* ws, const __half* hs, __half* us) {
  using Tile = GcTile<Arch>;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
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

// O = diag(exp(G)) Q H + P V' for rows < len (one tile per warp) into out (at the block's
// first column, row c0 + r at out_tok halves per token); then V' (us) decayed to the
// chunk's end, exp(G_last - G_j), and transposed into vdt [kGcBV][kGcVtPitch] (padding rows
// have g = 0, so G_last is gcum[63]). P: [64][kGcTPitch], zeros above the diagonal.
template <class Arch>
__device__ __forceinline__ void gc_outputs(const __half* qs, const __half* hs, const __half* ps,
                                           const __half* us, const float* gcum, int c0, int len,
                                           __half* out, int64_t out_tok, __half* vdt) {
  using Tile = GcTile<Arch>;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
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
  const float g_last = gcum[kGcChunk - 1];
  for (int e = tid; e < kGcChunk * kGcBV; e += kGcThreads) {
    const int j = e / kGcBV;
    const int v = e % kGcBV;
    vdt[v * kGcVtPitch + j] =
        __float2half_rn(__half2float(us[j * kGcVPitch + v]) * expf(g_last - gcum[j]));
  }
}

// H = exp(G_last) H + K^T (V' decayed): warp w's rows 16 w .. + 15 in hreg, and their fp16
// copy in hs.
template <class Arch>
__device__ __forceinline__ void gc_state_update(const __half* ks, const __half* vdt,
                                                const float* gcum, float (&hreg)[2][8],
                                                __half* hs) {
  using Tile = GcTile<Arch>;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
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

}  // namespace sm70
