// Paged decode attention over the int8 KV cache (kv_int8.cuh layout), head_dim 256,
// GQA G:1 (6:1 for Qwen3.8-27B: 12 query and 2 KV heads per GPU at TP=2), QN = 1..4
// query rows per sequence (MTP verification), causal among those rows.
//
// One block per (split, sequence, KV head); the block's G*QN query rows (at most 24,
// padded to 32) share every K/V token it reads, so QK^T and PV run on the Volta tensor
// cores: mma.m8n8k4 with quad pair p holding query rows 8p..8p+7. K and V stay int8 in
// shared memory and turn into exact fp16 integers when loaded into fragments; the
// per-token K scale multiplies the scores, the per-token V scale is folded into P.
// Flash-decoding: each split covers a contiguous token range and writes an unnormalised
// partial output plus (max, sum); paged_decode_reduce_kernel combines the splits.
// Query row r of a block is query head kvh*G + r / QN at token offset r % QN.
// NATIVE = true swaps the two products for mma.m16n8k16 (sm_80+ only), everything else
// unchanged: on Hopper m8n8k4 is emulated, so the test GPU measures the memory pipeline
// through that variant and checks the Volta variant for correctness.
#pragma once

#include "sm70_common.cuh"

namespace sm70 {

constexpr int kPdHeadDim = 256;
constexpr int kPdTile = 32;       // tokens per tile
constexpr int kPdRows = 32;       // padded query rows per block (4 quad pairs x 8)
constexpr int kPdWarps = 4;       // 128 threads
constexpr int kPdQPitch = kPdHeadDim + 4;  // halves; conflict-free 8-byte fragment reads
constexpr int kPdKvPitch = kPdHeadDim + 16;  // bytes; 16-byte aligned rows
constexpr int kPdPPitch = kPdTile + 4;       // halves
constexpr int kPdSPitch = kPdTile + 1;       // floats

struct PagedDecodeParams {
  const __half* q;          // [B*QN, Hq, D], token stride q_tok_stride (elements)
  const int8_t* k_cache;    // [num_blocks, Hkv, block_size, D]
  const int8_t* v_cache;
  const float* k_scale;     // [num_blocks, Hkv, block_size]
  const float* v_scale;
  const int* block_tables;  // [B, bt_stride]
  const int* seq_lens;      // [B], context length including the QN new tokens
  __half* out;              // [B*QN, Hq, D], token stride out_tok_stride
  float* part_o;            // [B, Hkv, S, G*QN, D] (only when num_splits > 1)
  float* part_ml;           // [B, Hkv, S, G*QN, 2]
  int64_t q_tok_stride;
  int64_t out_tok_stride;
  int bt_stride;
  int num_kv_heads;
  int block_size;
  int num_splits;
  float scale_log2;  // softmax scale * log2(e)
};

// Scaled score of (row, token-in-tile) or -inf where the token is past the split, past
// the context, or in the row's causal future (row r of QN may see keys <= ctx - QN + r%QN).
template <int G, int QN>
__device__ __forceinline__ void store_score_impl(float* ss, const float* ksc, int row, int tl,
                                                 int t0, int t_end, int ctx, float scale_log2,
                                                 float acc) {
  constexpr int R = G * QN;
  const int t = t0 + tl;
  const int limit = ctx - QN + (row % QN);
  const bool ok = row < R && t < t_end && t <= limit;
  ss[row * kPdSPitch + tl] = ok ? acc * ksc[tl] * scale_log2 : kNegInf;
}

template <int G, int QN, bool NATIVE>
__global__ void __launch_bounds__(kPdWarps * 32)
    paged_decode_kernel(const PagedDecodeParams p) {
  constexpr int D = kPdHeadDim;
  constexpr int R = G * QN;
  static_assert(R <= kPdRows, "at most 32 query rows per KV head");
  __shared__ __align__(16) __half qs[kPdRows * kPdQPitch];
  __shared__ __align__(16) int8_t ks[kPdTile * kPdKvPitch];
  __shared__ __align__(16) int8_t vs[kPdTile * kPdKvPitch];
  __shared__ float ss[kPdRows * kPdSPitch];
  __shared__ __align__(8) __half ps[kPdRows * kPdPPitch];
  __shared__ float ksc[kPdTile], vsc[kPdTile];
  __shared__ float row_m[kPdRows], row_l[kPdRows], row_a[kPdRows];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int split = blockIdx.x;
  const int b = blockIdx.y;
  const int kvh = blockIdx.z;
  const int Hkv = p.num_kv_heads;
  const int ctx = p.seq_lens[b];
  const int per_split_raw = (ctx + p.num_splits - 1) / p.num_splits;
  const int per_split = (per_split_raw + kPdTile - 1) / kPdTile * kPdTile;
  const int t_begin = split * per_split;
  const int t_end = min(ctx, t_begin + per_split);

  // Q rows into shared memory (rows >= R are zero), 8 bytes per store
  for (int i = tid; i < kPdRows * (D / 4); i += kPdWarps * 32) {
    const int r = i / (D / 4);
    const int c = (i % (D / 4)) * 4;
    uint2 val = make_uint2(0u, 0u);
    if (r < R) {
      const int g = r / QN, qi = r % QN;
      const __half* src = p.q + (int64_t)(b * QN + qi) * p.q_tok_stride +
                          (int64_t)(kvh * G + g) * D + c;
      val = *reinterpret_cast<const uint2*>(src);
    }
    *reinterpret_cast<uint2*>(&qs[r * kPdQPitch + c]) = val;
  }
  if (tid < kPdRows) {
    row_m[tid] = kNegInf;
    row_l[tid] = 0.f;
    row_a[tid] = 1.f;
  }

  const int gq = lane >> 2, t4 = lane & 3;  // m16n8k16 fragment coordinates
  const int qp = (lane >> 2) & 3;  // quad pair = row block
  const int hi = lane >> 4;
  const int l4 = lane & 3;
  const int arow = qp * 8 + l4 + 4 * hi;  // A fragment row
  const int bcol = l4 + 4 * hi;           // B fragment column (token in the warp's 8)

  float oacc[8][8];  // 8 column blocks of 8 dims: the warp owns dims 64*warp .. +63
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int i = 0; i < 8; ++i) oacc[nb][i] = 0.f;

  // loader mapping: 16 threads per token row of 256 bytes, 8 token rows per pass
  const int ld_tok = tid >> 4;  // 0..7
  const int ld_piece = tid & 15;
  const int64_t head_off = (int64_t)kvh * p.block_size;
  const int* bt = p.block_tables + (int64_t)b * p.bt_stride;
  auto store_score = [&](float* s_, const float* k_, int row, int tl, int t0_, int te_, int c_,
                         float sc_, float acc) {
    store_score_impl<G, QN>(s_, k_, row, tl, t0_, te_, c_, sc_, acc);
  };

  uint4 kreg[kPdTile / 8], vreg[kPdTile / 8];
  float kscr = 0.f, vscr = 0.f;
  auto load_tile = [&](int t0) {
#pragma unroll
    for (int j = 0; j < kPdTile / 8; ++j) {
      const int t = t0 + ld_tok + 8 * j;
      if (t < t_end) {
        const int blk = bt[t / p.block_size];
        const int64_t rowi = ((int64_t)blk * Hkv * p.block_size + head_off + t % p.block_size);
        kreg[j] = __ldg(reinterpret_cast<const uint4*>(p.k_cache + rowi * D) + ld_piece);
        vreg[j] = __ldg(reinterpret_cast<const uint4*>(p.v_cache + rowi * D) + ld_piece);
      } else {
        kreg[j] = make_uint4(0u, 0u, 0u, 0u);
        vreg[j] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (tid < kPdTile) {
      const int t = t0 + tid;
      if (t < t_end) {
        const int blk = bt[t / p.block_size];
        const int64_t rowi = ((int64_t)blk * Hkv * p.block_size + head_off + t % p.block_size);
        kscr = __ldg(p.k_scale + rowi);
        vscr = __ldg(p.v_scale + rowi);
      } else {
        kscr = 0.f;
        vscr = 0.f;
      }
    }
  };

  if (t_begin < t_end) load_tile(t_begin);

  for (int t0 = t_begin; t0 < t_end; t0 += kPdTile) {
    __syncthreads();  // previous tile's readers are done (and Q/row state are visible)
#pragma unroll
    for (int j = 0; j < kPdTile / 8; ++j) {
      *reinterpret_cast<uint4*>(&ks[(ld_tok + 8 * j) * kPdKvPitch + ld_piece * 16]) = kreg[j];
      *reinterpret_cast<uint4*>(&vs[(ld_tok + 8 * j) * kPdKvPitch + ld_piece * 16]) = vreg[j];
    }
    if (tid < kPdTile) {
      ksc[tid] = kscr;
      vsc[tid] = vscr;
    }
    __syncthreads();
    // next tile's loads fly while this one is computed
    if (t0 + kPdTile < t_end) load_tile(t0 + kPdTile);

    // S = Q K^T for tokens 8*warp .. +7, all 32 rows
    if constexpr (!NATIVE) {
      float sacc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) sacc[i] = 0.f;
      const __half* qrow = &qs[arow * kPdQPitch];
      const int8_t* krow = &ks[(8 * warp + bcol) * kPdKvPitch];
#pragma unroll 16
      for (int kk = 0; kk < D / 4; ++kk) {
        const uint2 a2 = *reinterpret_cast<const uint2*>(qrow + 4 * kk);
        const uint32_t a[2] = {a2.x, a2.y};
        uint32_t bb[2];
        s8x4_to_half2x2(*reinterpret_cast<const uint32_t*>(krow + 4 * kk), bb);
        mma_m8n8k4(sacc, a, bb);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int row = qp * 8 + (lane & 1) + (i & 2) + 4 * hi;
        const int col = (i & 4) + (lane & 2) + (i & 1);
        store_score(ss, ksc, row, 8 * warp + col, t0, t_end, ctx, p.scale_log2, sacc[i]);
      }
    } else {
      float sacc[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) sacc[mt][j] = 0.f;
      const int8_t* krow = &ks[(8 * warp + gq) * kPdKvPitch + 2 * t4];
#pragma unroll 4
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t lo = *reinterpret_cast<const uint16_t*>(krow + 16 * kk);
        const uint32_t hh = *reinterpret_cast<const uint16_t*>(krow + 16 * kk + 8);
        uint32_t bb[2];
        s8x4_to_half2x2(lo | (hh << 16), bb);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const __half* q0 = &qs[(16 * mt + gq) * kPdQPitch + 16 * kk + 2 * t4];
          const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(q0),
                                 *reinterpret_cast<const uint32_t*>(q0 + 8 * kPdQPitch),
                                 *reinterpret_cast<const uint32_t*>(q0 + 8),
                                 *reinterpret_cast<const uint32_t*>(q0 + 8 * kPdQPitch + 8)};
          mma_m16n8k16(sacc[mt], a, bb);
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          store_score(ss, ksc, 16 * mt + gq + 8 * (j >> 1), 8 * warp + 2 * t4 + (j & 1), t0,
                      t_end, ctx, p.scale_log2, sacc[mt][j]);
    }
    __syncthreads();

    // online softmax: 4 threads per row, 8 tokens each
    {
      const int row = tid >> 2;
      const int sub = tid & 3;
      float sv[8];
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        sv[j] = ss[row * kPdSPitch + sub * 8 + j];
        mx = fmaxf(mx, sv[j]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_old = row_m[row];
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      const float alpha = exp2f(m_old - m_use);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float e = exp2f(sv[j] - m_use);
        sum += e;
        ps[row * kPdPPitch + sub * 8 + j] = __float2half_rn(e * vsc[sub * 8 + j]);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      __syncwarp();
      if (sub == 0) {
        row_l[row] = row_l[row] * alpha + sum;
        row_m[row] = m_new;
        row_a[row] = alpha;
      }
    }
    __syncthreads();

    // O = O * alpha + P V for dims 64*warp .. +63
    if constexpr (!NATIVE) {
      const int r0 = qp * 8 + (lane & 1) + 4 * hi;
      const float a0 = row_a[r0], a1 = row_a[r0 + 2];
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int i = 0; i < 8; ++i) oacc[nb][i] *= (i & 2) ? a1 : a0;
      const __half* prow = &ps[arow * kPdPPitch];
#pragma unroll
      for (int kk = 0; kk < kPdTile / 4; ++kk) {
        const uint2 a2 = *reinterpret_cast<const uint2*>(prow + 4 * kk);
        const uint32_t a[2] = {a2.x, a2.y};
        const int8_t* vrow = &vs[(4 * kk + l4) * kPdKvPitch + 64 * warp + 4 * hi];
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
          uint32_t bb[2];
          s8x4_to_half2x2(*reinterpret_cast<const uint32_t*>(vrow + 8 * nb), bb);
          mma_m8n8k4_rr(oacc[nb], a, bb);
        }
      }
    } else {
      // oacc[nt][4 * mt + j]: row 16 mt + g + 8 (j >> 1), dim 64 warp + 8 nt + 2 t + (j & 1)
      float al[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) al[q] = row_a[8 * q + gq];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int i = 0; i < 8; ++i) oacc[nt][i] *= al[i >> 1];
#pragma unroll
      for (int kk = 0; kk < kPdTile / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const __half* p0 = &ps[(16 * mt + gq) * kPdPPitch + 16 * kk + 2 * t4];
          a[mt][0] = *reinterpret_cast<const uint32_t*>(p0);
          a[mt][1] = *reinterpret_cast<const uint32_t*>(p0 + 8 * kPdPPitch);
          a[mt][2] = *reinterpret_cast<const uint32_t*>(p0 + 8);
          a[mt][3] = *reinterpret_cast<const uint32_t*>(p0 + 8 * kPdPPitch + 8);
        }
        const uint8_t* v0 =
            reinterpret_cast<const uint8_t*>(&vs[(16 * kk + 2 * t4) * kPdKvPitch + 64 * warp + gq]);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const uint8_t* vp = v0 + 8 * nt;
          const uint32_t w = (uint32_t)vp[0] | ((uint32_t)vp[kPdKvPitch] << 8) |
                             ((uint32_t)vp[8 * kPdKvPitch] << 16) |
                             ((uint32_t)vp[9 * kPdKvPitch] << 24);
          uint32_t bb[2];
          s8x4_to_half2x2(w, bb);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            float* acc = &oacc[nt][4 * mt];
            mma_m16n8k16(*reinterpret_cast<float(*)[4]>(acc), a[mt], bb);
          }
        }
      }
    }
  }
  __syncthreads();

  // write back: normalised output (one split) or the unnormalised partial. Each thread
  // holds pairs of adjacent dims: (row, dim, v0, v1) enumerated per fragment layout.
  const int64_t base = (((int64_t)b * Hkv + kvh) * p.num_splits + split) * R;
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
    for (int pr = 0; pr < 4; ++pr) {
      int row, dim;
      float v0, v1;
      if constexpr (!NATIVE) {
        // i = 4 (pr >> 1) + 2 (pr & 1): rows r0 + (i & 2), cols (i & 4) + (lane & 2) + {0, 1}
        const int i = 4 * (pr >> 1) + 2 * (pr & 1);
        row = qp * 8 + (lane & 1) + (i & 2) + 4 * hi;
        dim = 64 * warp + 8 * nb + (i & 4) + (lane & 2);
        v0 = oacc[nb][i];
        v1 = oacc[nb][i + 1];
      } else {
        row = 16 * (pr >> 1) + gq + 8 * (pr & 1);
        dim = 64 * warp + 8 * nb + 2 * t4;
        v0 = oacc[nb][2 * pr];
        v1 = oacc[nb][2 * pr + 1];
      }
      if (row >= R) continue;
      if (p.num_splits == 1) {
        const float l = row_l[row];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int g = row / QN, qi = row % QN;
        __half* dst = p.out + (int64_t)(b * QN + qi) * p.out_tok_stride +
                      (int64_t)(kvh * G + g) * D + dim;
        *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v0 * inv, v1 * inv);
      } else {
        *reinterpret_cast<float2*>(p.part_o + (base + row) * D + dim) = make_float2(v0, v1);
      }
    }
  }
  if (p.num_splits > 1 && tid < R) {
    p.part_ml[(base + tid) * 2] = row_m[tid];
    p.part_ml[(base + tid) * 2 + 1] = row_l[tid];
  }
}

// Combine the splits: one block per (sequence, KV head, row), one thread per dim. The
// split weights go through shared memory first so the partial loads are independent.
constexpr int kPdMaxSplits = 1024;

template <int G, int QN>
__global__ void __launch_bounds__(kPdHeadDim)
    paged_decode_reduce_kernel(const PagedDecodeParams p) {
  constexpr int D = kPdHeadDim;
  constexpr int R = G * QN;
  __shared__ float wgt[kPdMaxSplits];
  __shared__ float red[kPdHeadDim / 32];
  const int row = blockIdx.x % R;
  const int kvh = (blockIdx.x / R) % p.num_kv_heads;
  const int b = blockIdx.x / (R * p.num_kv_heads);
  const int d = threadIdx.x;
  const int lane = d & 31, warp = d >> 5;
  const int S = p.num_splits;
  const int64_t base = ((int64_t)b * p.num_kv_heads + kvh) * S;
  float mx = kNegInf;
  for (int s = d; s < S; s += D) mx = fmaxf(mx, p.part_ml[((base + s) * R + row) * 2]);
  mx = warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < D / 32; ++w) mx = fmaxf(mx, red[w]);
  const float m_use = mx == kNegInf ? 0.f : mx;
  __syncthreads();
  float den = 0.f;
  for (int s = d; s < S; s += D) {
    const int64_t pr = (base + s) * R + row;
    const float w = exp2f(p.part_ml[pr * 2] - m_use);
    wgt[s] = w;
    den += w * p.part_ml[pr * 2 + 1];
  }
  den = warp_sum(den);
  if (lane == 0) red[warp] = den;
  __syncthreads();
  den = 0.f;
#pragma unroll
  for (int w = 0; w < D / 32; ++w) den += red[w];
  float num = 0.f;
  const float* po = p.part_o + (base * R + row) * D + d;
#pragma unroll 8
  for (int s = 0; s < S; ++s) num += wgt[s] * po[(int64_t)s * R * D];
  const int g = row / QN, qi = row % QN;
  p.out[(int64_t)(b * QN + qi) * p.out_tok_stride + (int64_t)(kvh * G + g) * D + d] =
      __float2half_rn(den > 0.f ? num / den : 0.f);
}

#ifndef __CUDACC_RTC__
template <int G, int QN, bool NATIVE>
inline void launch_paged_decode(const PagedDecodeParams& p, int batch, cudaStream_t stream) {
  dim3 grid(p.num_splits, batch, p.num_kv_heads);
  paged_decode_kernel<G, QN, NATIVE><<<grid, kPdWarps * 32, 0, stream>>>(p);
  if (p.num_splits > 1) {
    paged_decode_reduce_kernel<G, QN>
        <<<batch * p.num_kv_heads * G * QN, kPdHeadDim, 0, stream>>>(p);
  }
}
#endif

}  // namespace sm70
