// Paged decode attention, the main kernel and its pieces (attention/paged_decode.cuh says
// what it computes): the prologue (the block's tokens from seq_lens, the block-table
// mapping, the first tile's loads, Q into registers), the tile loop (QK^T, online softmax,
// PV) and the split epilogue (the output or the split's partial).
//
// Each warp computes the scores of all 32 tokens of a tile over its own 64 head dims, with
// its slice of Q held in registers for the whole kernel (re-reading Q from shared memory
// for every 8 tokens made shared-memory traffic the bottleneck). The four partial score
// tiles meet in shared memory, where the softmax threads add them. PV keeps the same split:
// warp w accumulates O for its 64 dims.
#pragma once

#include "attention/decode_common.cuh"
#include "attention/decode_schedule.cuh"
#include "common/arch.cuh"
#include "common/mma.cuh"

namespace sm70 {

// Resident blocks per SM the register budget is capped for. arch::Sm70 (V100): 2 (47 KB of
// static shared memory per block, 96 KB per SM). arch::Sm80: 4 with one m16 row tile
// (QN <= 2), 3 with two (QN = 4; QN = 3 spills at 168 registers, so 2). The split count
// should fill exactly those slots (one wave): the launcher's caller asks the driver
// (torch.ops.sm70.paged_decode_blocks_per_sm).
template <int G, int QN, class Arch>
struct PdMinBlocks {
  static constexpr int value =
      !Arch::kM16n8k16 ? 2 : (G * QN <= 16 ? 4 : (QN == 3 ? 2 : 3));
};

// The compile-time shape of one instantiation.
template <int G, int QN, class Arch>
struct PdShape {
  static constexpr bool kTc16 = Arch::kM16n8k16;  // m16n8k16 fragments, else m8n8k4
  static constexpr int R = G * QN;                // query rows of the block
  static constexpr int KP = PdKPitch<Arch>::value;
  static constexpr int MT = (R + 15) / 16;  // m16 row tiles the m16n8k16 path needs
  static_assert(R <= kPdRows, "at most 32 query rows per KV head");
  // partial-score rows kept: one m16 row tile (QN <= 2) writes only the 8-row halves
  // holding real rows, which keeps static shared memory under 48 KB with V double-buffered;
  // the rest keep all 32 (skipping the padding half at QN = 4 spills more in the loop at
  // the 168-register cap, which costs more than the shared memory saves)
  static constexpr int SR = kTc16 && MT == 1 ? (R + 7) / 8 * 8 : kPdRows;
  // PV of tile i - 1 beside QK^T of tile i (one barrier fewer, two independent chains per
  // phase); not for two m16 row tiles (QN = 3, 4) on m16n8k16, where it spills at the
  // 168-register cap of 3 blocks per SM
  static constexpr bool PIPE = !kTc16 || MT == 1;
  static constexpr int QREGS = kTc16 ? MT * 16 : 32;  // Q slice registers per lane
  // softmax thread layout: TPR threads per query row (rows padded to RP), TPT tokens each;
  // warps whose rows are all padding skip the softmax (warp 3 always does)
  static constexpr int RP = R <= 8 ? 8 : (R <= 16 ? 16 : 32);
  static constexpr int TPR = kPdWarps * 32 / RP;
  static constexpr int TPT = kPdTile / TPR;
};

// The block's shared memory, as references to the kernel's own __shared__ arrays: the
// pieces below address them exactly as the kernel would (one struct-typed __shared__
// variable instead changes the generated code and its registers).
template <class S>
struct PdSmem {
  int8_t (&ks)[kPdTile * S::KP];
  // V is double-buffered when PV of the previous tile runs beside QK^T of this one
  int8_t (&vs)[S::PIPE ? 2 : 1][kPdTile * kPdVPitch];
  float (&ssp)[kPdWarps][S::SR * kPdSPitch];  // partial scores
  __half (&ps)[kPdRows * kPdPPitch];
  float (&ksc)[kPdTile];
  float (&vsc)[kPdTile];
  float (&row_m)[kPdRows];
  float (&row_l)[kPdRows];
  float (&row_a)[kPdRows];
  float (&qpart)[kPdWarps][kPdRows];  // per-warp sums of the Q slice, per row
  float (&row_q)[kPdRows];            // the K offset of each row's scores
};

// A thread's coordinates: its warp's head dims and its tensor-core fragment positions.
// This and the other context structs below hold references to the kernel's own locals,
// as a lambda's captures would: the pieces then compile to what one function body would
// (values copied into structs, or a struct-typed __shared__ variable, change the
// generated code and its registers).
struct PdLane {
  const int& tid;
  const int& lane;
  const int& warp;
  const int& dbase;  // this warp's head dims: dbase .. dbase + 63
  const int& gq;     // m16n8k16 fragment coordinates (row g, k / column t)
  const int& t4;
  const int& qp;  // m8n8k4: quad pair (= row block), lane half, lane in quad
  const int& hi;
  const int& l4;
  const int& arow;  // m8n8k4 A fragment row, B fragment column (token in 8)
  const int& bcol;
};

// ---- prologue

// The block's sequence and token range. BATCHED: one block per slot of the batch's shared
// chunks (pd_work_batch, batch > 1 with splits); otherwise one block per (split, sequence),
// each sequence cut into num_splits equal parts: batch 1, or one part per sequence.
template <bool BATCHED>
__device__ __forceinline__ PdWork pd_block_work(const PagedDecodeParams& p, const int& kvh) {
  if constexpr (BATCHED) {
    return pd_work_batch(p.seq_lens, p.num_splits, p.batch, blockIdx.x,
                         blockIdx.x == 0 && kvh == 0 ? p.sched : nullptr);
  } else {
    PdWork w;
    w.b = blockIdx.y;
    w.ctx = p.seq_lens[w.b];
    const int per_split = pd_chunk_for(w.ctx, p.num_splits);
    w.t_begin = blockIdx.x * per_split;
    w.t_end = min(w.ctx, w.t_begin + per_split);
    return w;
  }
}

// The K/V tile loader: 16 threads per token row of 256 bytes, 8 token rows per pass, the
// next tile's rows held in registers (kreg, vreg, kscr, vscr) while this one is computed.
// Rows are addressed through the cache's block, token and head strides (decode_common.cuh).
struct PdKvLoader {
  const int& lane;
  const int& warp;
  const int& ld_tok;  // 0..7
  const int& ld_piece;
  const int64_t& kv_head;  // this block's KV head times the head strides
  const int64_t& sc_head;
  const int* const& bt;  // the sequence's block table
  const int& bsz;
  const float& inv_bs;
  const int& t_end;
  uint4 (&kreg)[kPdTile / 8];
  uint4 (&vreg)[kPdTile / 8];
  float& kscr;
  float& vscr;

  // (physical block, offset in it) of token t0 + lane. Each lane maps one token and the
  // loaders fetch their 4 rows' offsets by shuffle: one mapping per token per warp instead
  // of 5 per thread (the per-thread version was a quarter of the kernel's instructions).
  // Tokens past the split read the split's last token instead: always a valid address, no
  // predicates, and their scores are masked (P = 0) whatever they hold. The division is a
  // float reciprocal, exact after one correction step.
  __device__ __forceinline__ int2 slot(int t0) const {
    const int t = min(t0 + lane, t_end - 1);
    int blk_i = __float2int_rz((float)t * inv_bs);
    int off = t - blk_i * bsz;
    if (off < 0) {
      --blk_i;
      off += bsz;
    } else if (off >= bsz) {
      ++blk_i;
      off -= bsz;
    }
    return make_int2(__ldg(bt + blk_i), off);
  }

  __device__ __forceinline__ void load(const PagedDecodeParams& p, int t0) const {
    const int2 s = slot(t0);
    const int64_t my_row =
        (int64_t)s.x * p.kv_blk_stride + (int64_t)s.y * p.kv_tok_stride + kv_head;
    if (p.vec16) {
#pragma unroll
      for (int j = 0; j < kPdTile / 8; ++j) {
        const int64_t rowb = __shfl_sync(0xffffffffu, my_row, ld_tok + 8 * j) + 16 * ld_piece;
        kreg[j] = __ldg(reinterpret_cast<const uint4*>(p.k_cache + rowb));
        vreg[j] = __ldg(reinterpret_cast<const uint4*>(p.v_cache + rowb));
      }
    } else {  // rows 4-byte aligned only: the same 16 bytes as four words
#pragma unroll
      for (int j = 0; j < kPdTile / 8; ++j) {
        const int64_t rowb = __shfl_sync(0xffffffffu, my_row, ld_tok + 8 * j) + 16 * ld_piece;
        const unsigned* kw = reinterpret_cast<const unsigned*>(p.k_cache + rowb);
        const unsigned* vw = reinterpret_cast<const unsigned*>(p.v_cache + rowb);
        kreg[j] = make_uint4(__ldg(kw), __ldg(kw + 1), __ldg(kw + 2), __ldg(kw + 3));
        vreg[j] = make_uint4(__ldg(vw), __ldg(vw + 1), __ldg(vw + 2), __ldg(vw + 3));
      }
    }
    if (warp == 0) {  // the tile's 32 scales; the softmax scale rides on the K scale
      const int64_t sc =
          (int64_t)s.x * p.sc_blk_stride + (int64_t)s.y * p.sc_tok_stride + sc_head;
      kscr = __ldg(p.k_scale + sc) * p.scale_log2;
      vscr = __ldg(p.v_scale + sc);
    }
  }

  // The loaded tile into shared memory, sign bits flipped (decode_common.cuh: kPdBias).
  template <int KP>
  __device__ __forceinline__ void store(int8_t* ks, int8_t* vs, float* ksc, float* vsc,
                                        int tid) const {
#pragma unroll
    for (int j = 0; j < kPdTile / 8; ++j) {
      const uint4 kf = make_uint4(kreg[j].x ^ kPdSignFlip, kreg[j].y ^ kPdSignFlip,
                                  kreg[j].z ^ kPdSignFlip, kreg[j].w ^ kPdSignFlip);
      const uint4 vf = make_uint4(vreg[j].x ^ kPdSignFlip, vreg[j].y ^ kPdSignFlip,
                                  vreg[j].z ^ kPdSignFlip, vreg[j].w ^ kPdSignFlip);
      *reinterpret_cast<uint4*>(&ks[(ld_tok + 8 * j) * KP + ld_piece * 16]) = kf;
      *reinterpret_cast<uint4*>(&vs[(ld_tok + 8 * j) * kPdVPitch + ld_piece * 16]) = vf;
    }
    if (tid < kPdTile) {
      ksc[tid] = kscr;
      vsc[tid] = vscr;
    }
  }
};

// The warp's Q slice into registers, and its per-row sums (fp32 over the fp16 values) into
// qpart for the K offset. m8n8k4: row arow, dims dbase + 4kk .. +3 (kk = 0..15).
// m16n8k16: the reduction order over the warp's 64 dims is free, so lane t's four k values
// of step s are the contiguous dims dbase + 16t + 4s .. +3, which makes its K fragments for
// all four steps one 16-byte shared-memory read.
template <int G, int QN, class S>
__device__ __forceinline__ void pd_load_q(const PagedDecodeParams& p, const int& b, const int& kvh,
                                          const PdLane& l, uint32_t (&qa)[S::QREGS],
                                          float (&qpart)[kPdWarps][kPdRows]) {
  constexpr int R = S::R;
  constexpr int MT = S::MT;
  if constexpr (!S::kTc16) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (l.arow < R)
        v = *reinterpret_cast<const uint4*>(pd_qrow<G, QN>(p, b, kvh, l.arow) + l.dbase + 8 * j);
      qa[4 * j + 0] = v.x;
      qa[4 * j + 1] = v.y;
      qa[4 * j + 2] = v.z;
      qa[4 * j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t w[2][8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * mt + l.gq + 8 * h;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if (r < R)
            v = *reinterpret_cast<const uint4*>(pd_qrow<G, QN>(p, b, kvh, r) + l.dbase +
                                                16 * l.t4 + 8 * j);
          w[h][4 * j + 0] = v.x;
          w[h][4 * j + 1] = v.y;
          w[h][4 * j + 2] = v.z;
          w[h][4 * j + 3] = v.w;
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        qa[16 * mt + 4 * s + 0] = w[0][2 * s];      // row g,   dims 4s, 4s+1
        qa[16 * mt + 4 * s + 1] = w[1][2 * s];      // row g+8
        qa[16 * mt + 4 * s + 2] = w[0][2 * s + 1];  // row g,   dims 4s+2, 4s+3
        qa[16 * mt + 4 * s + 3] = w[1][2 * s + 1];
      }
    }
  }

  auto h2sum = [](uint32_t w) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    return f.x + f.y;
  };
  if constexpr (!S::kTc16) {
    float qs_ = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) qs_ += h2sum(qa[i]);
    qpart[l.warp][l.arow] = qs_;  // one lane per row
  } else {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        s0 += h2sum(qa[16 * mt + 4 * st]) + h2sum(qa[16 * mt + 4 * st + 2]);
        s1 += h2sum(qa[16 * mt + 4 * st + 1]) + h2sum(qa[16 * mt + 4 * st + 3]);
      }
      s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
      s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
      if (l.t4 == 0) {
        qpart[l.warp][16 * mt + l.gq] = s0;
        qpart[l.warp][16 * mt + l.gq + 8] = s1;
      }
    }
    if (MT == 1 && l.t4 == 0) {  // rows 16..31 hold no query: keep their sums defined
      qpart[l.warp][16 + l.gq] = 0.f;
      qpart[l.warp][24 + l.gq] = 0.f;
    }
  }
}

// ---- the tile loop

// Partial S = Q K^T over this warp's 64 dims, all 32 tokens of the tile, unscaled, into
// my_s (the warp's partial-score tile).
template <class S>
__device__ __forceinline__ void pd_qk(const uint32_t (&qa)[S::QREGS], const int8_t* ks,
                                      float* my_s, const PdLane& l) {
  constexpr int KP = S::KP;
  constexpr int MT = S::MT;
  if constexpr (!S::kTc16) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float sacc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) sacc[i] = 0.f;
      const int8_t* krow = &ks[(8 * nt + l.bcol) * KP + l.dbase];
#pragma unroll
      for (int kq = 0; kq < 4; ++kq) {
        const uint4 kv = *reinterpret_cast<const uint4*>(krow + 16 * kq);
        const uint32_t kw[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kk = 4 * kq + e;
          const uint32_t a[2] = {qa[2 * kk], qa[2 * kk + 1]};
          uint32_t bb[2];
          u8x4_biased(kw[e], bb);
          mma_m8n8k4(sacc, a, bb);
        }
      }
      // C: row qp*8 + (lane&1) + (i&2) + 4hi, col (i&4) + (lane&2) + (i&1)
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int row = l.qp * 8 + (l.lane & 1) + (i & 2) + 4 * l.hi;
        const int col = 8 * nt + (i & 4) + (l.lane & 2);
        *reinterpret_cast<float2*>(&my_s[row * kPdSPitch + col]) =
            make_float2(sacc[i], sacc[i + 1]);
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const uint4 kv =
          *reinterpret_cast<const uint4*>(&ks[(8 * nt + l.gq) * KP + l.dbase + 16 * l.t4]);
      const uint32_t kw[4] = {kv.x, kv.y, kv.z, kv.w};
      float sacc[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) sacc[mt][j] = 0.f;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t bb[2];
        u8x4_biased(kw[s], bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t a[4] = {qa[16 * mt + 4 * s], qa[16 * mt + 4 * s + 1],
                                 qa[16 * mt + 4 * s + 2], qa[16 * mt + 4 * s + 3]};
          mma_m16n8k16(sacc[mt], a, bb);
        }
      }
      // C: c0, c1 row g, cols 2t, 2t+1; c2, c3 row g+8
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (16 * mt + 8 * h < S::SR)  // compile-time: halves of padding rows are not kept
            *reinterpret_cast<float2*>(
                &my_s[(16 * mt + l.gq + 8 * h) * kPdSPitch + 8 * nt + 2 * l.t4]) =
                make_float2(sacc[mt][2 * h], sacc[mt][2 * h + 1]);
    }
  }
}

// O = O * alpha + P V for dims 64*warp .. +63 of the tile whose V is in vb and whose P and
// alpha the last softmax left in ps / row_a.
template <class S>
__device__ __forceinline__ void pd_pv(float (&oacc)[8][8], const int8_t* vb,
                                      const PdSmem<S>& sm, const PdLane& l) {
  constexpr int MT = S::MT;
  if constexpr (!S::kTc16) {
    const int r0 = l.qp * 8 + (l.lane & 1) + 4 * l.hi;
    const float a0 = sm.row_a[r0], a1 = sm.row_a[r0 + 2];
    // once the running maxima settle, alpha is 1 for every row: skip the 64 multiplies
    if (__builtin_expect(__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f), 0)) {
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int i = 0; i < 8; ++i) oacc[nb][i] *= (i & 2) ? a1 : a0;
    }
    const __half* prow = &sm.ps[l.arow * kPdPPitch];
#pragma unroll
    for (int kk = 0; kk < kPdTile / 4; ++kk) {
      const uint2 a2 = *reinterpret_cast<const uint2*>(prow + 4 * kk);
      const uint32_t a[2] = {a2.x, a2.y};
      const int8_t* vrow = &vb[(4 * kk + l.l4) * kPdVPitch + l.dbase + 4 * l.hi];
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        uint32_t bb[2];
        u8x4_biased(*reinterpret_cast<const uint32_t*>(vrow + 8 * nb), bb);
        bb[0] = pd_unbias(bb[0]);
        bb[1] = pd_unbias(bb[1]);
        mma_m8n8k4_rr(oacc[nb], a, bb);
      }
    }
  } else {
    // n-tile nt = 4h + jj, fragment column c -> head dim dbase + 32h + 4c + jj, so one
    // 4-byte V read (4 dims of one token) feeds 4 n-tiles: 8 reads per 16 tokens instead
    // of 32 single bytes. oacc[nt][4 mt + j]: row 16 mt + g + 8 (j >> 1), column 2t + (j & 1)
    float al[2 * MT];
    bool rescale = false;
#pragma unroll
    for (int q = 0; q < 2 * MT; ++q) {
      al[q] = sm.row_a[8 * q + l.gq];
      rescale |= al[q] != 1.f;
    }
    if (__builtin_expect(__any_sync(0xffffffffu, rescale), 0)) {  // rare: the max is lazy
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4 * MT; ++i) oacc[nt][i] *= al[i >> 1];
    }
#pragma unroll
    for (int kk = 0; kk < kPdTile / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const __half* p0 = &sm.ps[(16 * mt + l.gq) * kPdPPitch + 16 * kk + 2 * l.t4];
        a[mt][0] = *reinterpret_cast<const uint32_t*>(p0);
        a[mt][1] = *reinterpret_cast<const uint32_t*>(p0 + 8 * kPdPPitch);
        a[mt][2] = *reinterpret_cast<const uint32_t*>(p0 + 8);
        a[mt][3] = *reinterpret_cast<const uint32_t*>(p0 + 8 * kPdPPitch + 8);
      }
      // B rows (tokens) 2t, 2t+1, 2t+8, 2t+9 of this 16-token step
      const int8_t* v0 = &vb[(16 * kk + 2 * l.t4) * kPdVPitch + l.dbase + 4 * l.gq];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t r0 = *reinterpret_cast<const uint32_t*>(v0 + 32 * h);
        const uint32_t r1 = *reinterpret_cast<const uint32_t*>(v0 + kPdVPitch + 32 * h);
        const uint32_t r8 = *reinterpret_cast<const uint32_t*>(v0 + 8 * kPdVPitch + 32 * h);
        const uint32_t r9 = *reinterpret_cast<const uint32_t*>(v0 + 9 * kPdVPitch + 32 * h);
        // interleave token pairs byte by byte, then each dim's pair becomes a half2
        const uint32_t p01[2] = {__byte_perm(r0, r1, 0x5140), __byte_perm(r0, r1, 0x7362)};
        const uint32_t p89[2] = {__byte_perm(r8, r9, 0x5140), __byte_perm(r8, r9, 0x7362)};
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const uint32_t sel = (jj & 1) ? 0x7362u : 0x5140u;
          const uint32_t bb[2] = {pd_unbias(__byte_perm(p01[jj >> 1], 0x64646464u, sel)),
                                  pd_unbias(__byte_perm(p89[jj >> 1], 0x64646464u, sel))};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            float* acc = &oacc[4 * h + jj][4 * mt];
            mma_m16n8k16(*reinterpret_cast<float(*)[4]>(acc), a[mt], bb);
          }
        }
      }
    }
  }
}

// Online softmax over one tile: the 4 warps' partial scores are summed here, then offset,
// scaled by the token's K scale (times the softmax scale) and masked past the split, past
// the context or in the row's causal future. The running maximum is lazy: it moves only
// when a tile's maximum exceeds it by more than kPdLazy (P then stays <= 2^kPdLazy, far
// inside fp16), so the O rescale in PV runs on a handful of tiles instead of most.
template <int QN, class S>
__device__ __forceinline__ void pd_softmax(const PdSmem<S>& sm, const PdLane& l, const int& t0,
                                           const int& t_end, const int& ctx) {
  constexpr int R = S::R;
  constexpr int TPR = S::TPR;
  constexpr int TPT = S::TPT;
  if (l.warp * (32 / TPR) < R) {
    const int sm_row = l.tid / TPR;
    const int sm_sub = l.tid % TPR;
    float sv[TPT];
#pragma unroll
    for (int j = 0; j < TPT; ++j) sv[j] = 0.f;
#pragma unroll
    for (int w = 0; w < kPdWarps; ++w) {
      const float* src = &sm.ssp[w][sm_row * kPdSPitch + sm_sub * TPT];
#pragma unroll
      for (int j = 0; j < TPT; j += 2) {
        const float2 x = *reinterpret_cast<const float2*>(src + j);
        sv[j] += x.x;
        sv[j + 1] += x.y;
      }
    }
    // keys row r may see: up to ctx - QN + r % QN (causal among the QN new tokens)
    const bool full = t0 + kPdTile <= min(t_end, ctx - QN + 1);  // block-uniform: no mask
    const int limit = sm_row < R ? min(t_end - 1, ctx - QN + (sm_row % QN)) : -1;
    const float qoff = sm.row_q[sm_row];
    float mx = kNegInf;
#pragma unroll
    for (int j = 0; j < TPT; ++j) {
      const int tl = sm_sub * TPT + j;
      sv[j] = (sv[j] - qoff) * sm.ksc[tl];
      if (!full) sv[j] = t0 + tl <= limit ? sv[j] : kNegInf;
      mx = fmaxf(mx, sv[j]);
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_old = sm.row_m[sm_row];
    const float m_new = mx > m_old + kPdLazy ? mx : m_old;
    const float m_use = m_new == kNegInf ? 0.f : m_new;
    const float alpha = exp2f(m_old - m_use);
    float sum = 0.f;
    uint32_t pw[TPT / 2];
#pragma unroll
    for (int j = 0; j < TPT; j += 2) {
      const int tl = sm_sub * TPT + j;
      const float e0 = exp2f(sv[j] - m_use), e1 = exp2f(sv[j + 1] - m_use);
      sum += e0 + e1;
      const __half2 h = __floats2half2_rn(e0 * sm.vsc[tl], e1 * sm.vsc[tl + 1]);
      pw[j / 2] = *reinterpret_cast<const uint32_t*>(&h);
    }
    __half* dst = &sm.ps[sm_row * kPdPPitch + sm_sub * TPT];
    if constexpr (TPT == 2) {
      *reinterpret_cast<uint32_t*>(dst) = pw[0];
    } else {
#pragma unroll
      for (int j = 0; j < TPT / 2; j += 2)
        *reinterpret_cast<uint2*>(dst + 2 * j) = make_uint2(pw[j], pw[j + 1]);
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sm_sub == 0 && sm_row < R) {  // padding rows keep alpha = 1 (no rescale)
      sm.row_l[sm_row] = sm.row_l[sm_row] * alpha + sum;
      sm.row_m[sm_row] = m_new;
      sm.row_a[sm_row] = alpha;
    }
  }
}

// Tiles of 32 tokens: the next tile's K/V rows are loaded into registers while this one is
// computed; per tile QK^T (and, with PIPE, PV of the previous tile beside it), then the
// online softmax: three barriers. Ends with O complete for the block's tokens.
template <int QN, class S>
__device__ __forceinline__ void pd_tile_loop(const PagedDecodeParams& p, const int& t_begin,
                                             const int& t_end, const int& ctx, const PdLane& l,
                                             const PdSmem<S>& sm, const PdKvLoader& ld,
                                             const uint32_t (&qa)[S::QREGS],
                                             float (&oacc)[8][8]) {
  constexpr bool PIPE = S::PIPE;
  int vbuf = 0;
  float* my_s = sm.ssp[l.warp];
  for (int t0 = t_begin; t0 < t_end; t0 += kPdTile) {
    __syncthreads();  // the previous tile's QK^T, PV and softmax are done
    ld.store<S::KP>(sm.ks, sm.vs[vbuf], sm.ksc, sm.vsc, l.tid);
    __syncthreads();
    // next tile's loads fly while this one is computed
    if (t0 + kPdTile < t_end) ld.load(p, t0 + kPdTile);
    pd_qk<S>(qa, sm.ks, my_s, l);
    // PV of the previous tile (its V in the other buffer) is independent of the QK^T
    // above: the two overlap, and one barrier per tile goes
    if constexpr (PIPE) {
      if (t0 > t_begin) pd_pv<S>(oacc, sm.vs[vbuf ^ 1], sm, l);
    }
    __syncthreads();
    pd_softmax<QN, S>(sm, l, t0, t_end, ctx);
    if constexpr (!PIPE) {
      __syncthreads();
      pd_pv<S>(oacc, sm.vs[vbuf], sm, l);
    }
    if constexpr (PIPE) vbuf ^= 1;
  }
  if (PIPE && t_begin < t_end) {
    __syncthreads();  // the last softmax's P and alpha
    pd_pv<S>(oacc, sm.vs[vbuf ^ 1], sm, l);
  }
  __syncthreads();
}

// ---- the split epilogue

// Write back: the output (one split) or the split's partial, normalised by the split's own
// sum either way; with splits also the rows' (max, sum) for the reduce. Partials are
// [Hkv, num_splits * batch slots, R, D]: slot = blockIdx.x (batched) or the split of
// sequence 0 (batch 1; with one split per sequence there are no partials).
template <int G, int QN, class S>
__device__ __forceinline__ void pd_epilogue(const PagedDecodeParams& p, const int& b,
                                            const int& kvh,
                                            const PdLane& l, const PdSmem<S>& sm,
                                            const float (&oacc)[8][8]) {
  constexpr int D = kPdHeadDim;
  constexpr int R = S::R;
  constexpr int MT = S::MT;
  const int64_t base = ((int64_t)kvh * p.num_splits * p.batch + blockIdx.x) * R;
  auto emit = [&](int row, int dim, const float* v, int n) {  // n adjacent dims
    if (row >= R) return;
    // normalised either way: the output, or the split's partial in fp16 (bounded by the
    // largest |V|, so fp16 holds it, and half the bytes of an fp32 unnormalised partial)
    const float lsum = sm.row_l[row];
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    __half* dst;
    if (p.num_splits == 1) {
      const int g = row / QN, qi = row % QN;
      dst = p.out + (int64_t)(b * QN + qi) * p.out_tok_stride + (int64_t)(kvh * G + g) * D + dim;
    } else {
      dst = p.part_o + (base + row) * D + dim;
    }
    if (n == 4) {
      const __half2 h0 = __floats2half2_rn(v[0] * inv, v[1] * inv);
      const __half2 h1 = __floats2half2_rn(v[2] * inv, v[3] * inv);
      *reinterpret_cast<uint2*>(dst) = make_uint2(*reinterpret_cast<const uint32_t*>(&h0),
                                                  *reinterpret_cast<const uint32_t*>(&h1));
    } else {
      *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v[0] * inv, v[1] * inv);
    }
  };
  if constexpr (!S::kTc16) {
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
      for (int pr = 0; pr < 4; ++pr) {
        // i = 4 (pr >> 1) + 2 (pr & 1): rows r0 + (i & 2), cols (i & 4) + (lane & 2) + {0, 1}
        const int i = 4 * (pr >> 1) + 2 * (pr & 1);
        const int row = l.qp * 8 + (l.lane & 1) + (i & 2) + 4 * l.hi;
        const int dim = l.dbase + 8 * nb + (i & 4) + (l.lane & 2);
        const float v[2] = {oacc[nb][i], oacc[nb][i + 1]};
        emit(row, dim, v, 2);
      }
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int j = 2 * rh + cc;
            const float v[4] = {oacc[4 * h][4 * mt + j], oacc[4 * h + 1][4 * mt + j],
                                oacc[4 * h + 2][4 * mt + j], oacc[4 * h + 3][4 * mt + j]};
            emit(16 * mt + l.gq + 8 * rh, l.dbase + 32 * h + 4 * (2 * l.t4 + cc), v, 4);
          }
  }
  if (p.num_splits > 1 && l.tid < R) {
    p.part_ml[(base + l.tid) * 2] = sm.row_m[l.tid];
    p.part_ml[(base + l.tid) * 2 + 1] = sm.row_l[l.tid];
  }
}

// ---- the kernel

// Two instantiations per shape (here and in the reduce), BATCHED or not, keep the batch-1
// kernels free of the schedule's code: inline, it changes register allocation at the
// 128- and 168-register caps and slows batch 1.
template <int G, int QN, class Arch, bool BATCHED = false>
__global__ void __launch_bounds__(kPdWarps * 32, (PdMinBlocks<G, QN, Arch>::value))
    paged_decode_kernel(const PagedDecodeParams p) {
  using S = PdShape<G, QN, Arch>;
  __shared__ __align__(16) int8_t ks[kPdTile * S::KP];
  __shared__ __align__(16) int8_t vs[S::PIPE ? 2 : 1][kPdTile * kPdVPitch];
  __shared__ __align__(16) float ssp[kPdWarps][S::SR * kPdSPitch];
  __shared__ __align__(8) __half ps[kPdRows * kPdPPitch];
  __shared__ float ksc[kPdTile], vsc[kPdTile];
  __shared__ float row_m[kPdRows], row_l[kPdRows], row_a[kPdRows];
  __shared__ float qpart[kPdWarps][kPdRows];
  __shared__ float row_q[kPdRows];
  const PdSmem<S> sm{ks, vs, ssp, ps, ksc, vsc, row_m, row_l, row_a, qpart, row_q};

  // ---- prologue: the block's tokens (seq_lens), the block-table mapping and the first
  // tile's loads (in flight while Q is read and summed), Q, O = 0 and the K offsets. The
  // pieces see these locals through references; their order is part of what ptxas is given,
  // and reordering them moves registers (tests/test_kernels_compile.py pins them).
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int kvh = blockIdx.z;
  const PdWork work = pd_block_work<BATCHED>(p, kvh);
  if constexpr (BATCHED) {
    if (work.b < 0) return;  // more slots than chunks: nothing to read or write
  }
  const int b = work.b, ctx = work.ctx, t_begin = work.t_begin, t_end = work.t_end;
  const int dbase = 64 * warp;
  if (tid < kPdRows) {
    row_m[tid] = kNegInf;
    row_l[tid] = 0.f;
    row_a[tid] = 1.f;
  }
  const int ld_tok = tid >> 4;
  const int ld_piece = tid & 15;
  const int64_t kv_head = (int64_t)kvh * p.kv_head_stride;
  const int64_t sc_head = (int64_t)kvh * p.sc_head_stride;
  const int* const bt = p.block_tables + (int64_t)b * p.bt_stride;
  const int bsz = p.block_size;
  const float inv_bs = 1.f / (float)bsz;
  uint4 kreg[kPdTile / 8], vreg[kPdTile / 8];
  float kscr = 0.f, vscr = 0.f;
  const PdKvLoader ld{lane, warp,   ld_tok, ld_piece, kv_head, sc_head, bt,  bsz,
                      inv_bs, t_end, kreg,  vreg,     kscr,    vscr};
  if (t_begin < t_end) ld.load(p, t_begin);

  const int gq = lane >> 2, t4 = lane & 3;
  const int qp = (lane >> 2) & 3;
  const int hi = lane >> 4;
  const int l4 = lane & 3;
  const int arow = qp * 8 + l4 + 4 * hi;
  const int bcol = l4 + 4 * hi;
  const PdLane l{tid, lane, warp, dbase, gq, t4, qp, hi, l4, arow, bcol};
  uint32_t qa[S::QREGS];
  pd_load_q<G, QN, S>(p, b, kvh, l, qa, qpart);
  float oacc[8][8];  // the warp's O slice: 32 x 64 (m8n8k4) or MT x 16 x 64 (m16n8k16)
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int i = 0; i < 8; ++i) oacc[nb][i] = 0.f;
  __syncthreads();  // qpart complete
  if (tid < kPdRows)
    row_q[tid] = kPdBias * (qpart[0][tid] + qpart[1][tid] + qpart[2][tid] + qpart[3][tid]);

  pd_tile_loop<QN, S>(p, t_begin, t_end, ctx, l, sm, ld, qa, oacc);
  pd_epilogue<G, QN, S>(p, b, kvh, l, sm, oacc);
}

}  // namespace sm70
