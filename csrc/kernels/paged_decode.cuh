// Paged decode attention over the int8 KV cache (kv_int8.cuh layout), head_dim 256,
// GQA G:1 (6:1 for Qwen3.8-27B: 12 query and 2 KV heads per GPU at TP=2), QN = 1..4
// query rows per sequence (MTP verification), causal among those rows.
//
// One block per (split, sequence, KV head), or, in a batch with splits, per (slot, KV head)
// with the batch's tokens cut into equal chunks over its slots (pd_work_batch). A block's
// G*QN query rows (at most 24, padded to 32) share every K/V token it reads, so QK^T and
// PV run on the Volta tensor cores: mma.m8n8k4 with quad pair p holding query rows
// 8p..8p+7. K and V stay int8 in shared memory and turn into exact fp16 integers when
// loaded into fragments; the per-token K scale multiplies the scores, the per-token V
// scale is folded into P.
// Tiles of 32 tokens: the next tile's K/V rows are loaded into registers while this one is
// computed; per tile QK^T (and, for QN <= 2 and on Volta, PV of the previous tile beside
// it), then the online softmax: three barriers. Flash-decoding: each block covers a
// contiguous token range and writes its partial output normalised by its own sum (fp16)
// plus (max, sum); paged_decode_reduce_kernel combines the splits.
// Query row r of a block is query head kvh*G + r / QN at token offset r % QN.
// NATIVE = true swaps the two products for mma.m16n8k16 (sm_80+ only), everything else
// unchanged: on Hopper m8n8k4 is emulated, so the test GPU measures the memory pipeline
// through that variant and checks the Volta variant for correctness.
#pragma once

#include "sm70_common.cuh"

namespace sm70 {

constexpr int kPdHeadDim = 256;
constexpr int kPdTile = 32;   // tokens per tile
constexpr int kPdRows = 32;   // padded query rows per block (4 quad pairs x 8)
constexpr int kPdWarps = 4;   // 128 threads; warp w owns head dims 64w .. 64w+63
constexpr int kPdVPitch = kPdHeadDim + 16;  // bytes (68 words): conflict-free V fragment reads
constexpr int kPdSPitch = kPdTile + 4;      // floats; 16-byte aligned rows
constexpr int kPdPPitch = kPdTile + 4;      // halves
// K rows: the Volta fragment reads 16 bytes from 8 different token rows per quarter warp
// (pitch 68 words spreads them over the banks); the m16n8k16 reads take 64 contiguous bytes
// from 2 rows per quarter warp (pitch 80 words puts the two rows on disjoint halves).
template <bool NATIVE>
struct PdKPitch {
  static constexpr int value = NATIVE ? kPdHeadDim + 64 : kPdHeadDim + 16;
};

struct PagedDecodeParams {
  const __half* q;          // [B*QN, Hq, D], token stride q_tok_stride (elements)
  const int8_t* k_cache;    // [num_blocks, Hkv, block_size, D]
  const int8_t* v_cache;
  const float* k_scale;     // [num_blocks, Hkv, block_size]
  const float* v_scale;
  const int* block_tables;  // [B, bt_stride]
  const int* seq_lens;      // [B], context length including the QN new tokens
  __half* out;              // [B*QN, Hq, D], token stride out_tok_stride
  __half* part_o;           // [Hkv, W, G*QN, D] (num_splits > 1), O / l of the slot's chunk
  float* part_ml;           // [Hkv, W, G*QN, 2]: (max, sum)
  int64_t q_tok_stride;
  int64_t out_tok_stride;
  int* sched;               // [B, 2]: first slot and chunk count of each sequence (B > 1)
  int bt_stride;
  int num_kv_heads;
  int block_size;
  int batch;
  int num_splits;           // per sequence on average: W = num_splits * batch slots per KV head
  float scale_log2;  // softmax scale * log2(e)
};

// K and V bytes are stored in shared memory with the sign bit flipped (u = q + 128), so two
// codes become a half2 of 1024 + u with one prmt. For K that biased value goes straight
// into QK^T and the offset comes out once per row (1152 * sum(Q), an exact fp32 sum of the
// same fp16 Q values): the sums are only 16-64 products long, so the offset costs nothing
// in precision. For V the exact q is restored (one HSUB2 per pair) before PV: there the
// fp32 accumulators run over thousands of tokens per split and the tensor cores' truncating
// accumulation turned the 1152 offset into a 7 % output error at 262K (H200, m16n8k16).
constexpr float kPdBias = 1152.f;
constexpr float kPdLazy = 8.f;  // log2 units: the running max may trail a row's true max by 2^8
constexpr uint32_t kPdSignFlip = 0x80808080u;
__device__ __forceinline__ void u8x4_biased(uint32_t w, uint32_t (&h)[2]) {
  h[0] = __byte_perm(w, 0x64646464u, 0x5140);  // bytes 0, 1
  h[1] = __byte_perm(w, 0x64646464u, 0x7362);  // bytes 2, 3
}
__device__ __forceinline__ uint32_t pd_unbias(uint32_t h) {  // half2 (1024 + u) -> exact q
  const __half2 b = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&h), b);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Query row r of the block (r < G*QN) as a pointer to its 256 halves.
template <int G, int QN>
__device__ __forceinline__ const __half* pd_qrow(const PagedDecodeParams& p, int b, int kvh,
                                                 int r) {
  return p.q + (int64_t)(b * QN + r % QN) * p.q_tok_stride + (int64_t)(kvh * G + r / QN) *
                                                                     kPdHeadDim;
}

constexpr int kPdMaxSplits = 1024;  // chunks per sequence (the reduce's limit)

template <typename T, typename Op>
__device__ __forceinline__ T pd_block_reduce(T v, T* red, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // red is free
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  T r = red[0];
#pragma unroll
  for (int w = 1; w < kPdWarps; ++w) r = op(r, red[w]);
  return r;
}

// tokens / parts rounded up to whole tiles, at least one tile. I = int for one sequence
// (32-bit division), long long for a batch's total. The batch's longest context also goes
// through long long: as int, the batched QN = 4 kernel spilled 12 bytes more on sm_90.
template <typename I>
__device__ __forceinline__ int pd_chunk_for(I tokens, I parts) {
  const I per = (tokens + parts - 1) / parts;
  return (int)max((I)kPdTile, (per + kPdTile - 1) / kPdTile * kPdTile);
}

// The slot's work in a batched launch (batch > 1, num_splits > 1). The batch's tokens are
// cut into chunks of one size (whole tiles) and sequence b's chunks take slots first_b ..
// first_b + n_b - 1 of the W = num_splits * batch slots of a KV head: blocks get equal
// token counts whatever the mix of lengths (with the same split count for every sequence,
// a 262K context batched with seven 4K ones ran on 1/8 of the grid: 4.1-4.4x slower on the
// H200). The chunk is the smallest that fits W slots with at most kPdMaxSplits chunks per
// sequence; every block derives the same schedule from seq_lens (three block reductions
// and a scan), and the block given sched writes each sequence's (first, n) for the reduce.
struct PdWork {
  int b;    // sequence; -1: this slot has no chunk
  int ctx;  // its context length
  int t_begin, t_end;
};

__device__ __forceinline__ PdWork pd_work_batch(const int* seq_lens, int S, int B, int slot,
                                             int* sched) {
  PdWork w;
  __shared__ long long red64[kPdWarps];
  __shared__ int red32[kPdWarps];
  __shared__ int s_b, s_first;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long W = (long long)S * B;
  long long total = 0;
  int longest = 0;
  for (int i = tid; i < B; i += kPdWarps * 32) {
    const int c = seq_lens[i];
    total += c;
    longest = max(longest, c);
  }
  total = pd_block_reduce(total, red64, [](long long a, long long c) { return a + c; });
  longest = pd_block_reduce(longest, red32, [](int a, int c) { return max(a, c); });
  int chunk = max(pd_chunk_for(total, W), pd_chunk_for<long long>(longest, kPdMaxSplits));
  int count = 0;
  for (int i = tid; i < B; i += kPdWarps * 32) count += (seq_lens[i] + chunk - 1) / chunk;
  count = pd_block_reduce(count, red32, [](int a, int c) { return a + c; });
  // per-sequence rounding can overflow W; total / (W - B) per chunk cannot (S >= 2: W > B)
  if (count > W) chunk = max(chunk, pd_chunk_for(total, W - B));
  if (tid == 0) s_b = -1;
  int carry = 0;
  for (int base = 0; base < B; base += kPdWarps * 32) {  // exclusive scan of the counts
    const int i = base + tid;
    const int n = i < B ? (seq_lens[i] + chunk - 1) / chunk : 0;
    int x = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    __syncthreads();  // red32 is free
    if (lane == 31) red32[warp] = x;
    __syncthreads();
    int off = carry;
    for (int k = 0; k < warp; ++k) off += red32[k];
    const int first = off + x - n;
    if (i < B) {
      if (sched != nullptr) {
        sched[2 * i] = first;
        sched[2 * i + 1] = n;
      }
      if (slot >= first && slot < first + n) {
        s_b = i;
        s_first = first;
      }
    }
#pragma unroll
    for (int k = 0; k < kPdWarps; ++k) carry += red32[k];
  }
  __syncthreads();
  w.b = s_b;
  w.ctx = w.t_begin = w.t_end = 0;
  if (w.b >= 0) {
    w.ctx = seq_lens[w.b];
    w.t_begin = (slot - s_first) * chunk;
    w.t_end = min(w.ctx, w.t_begin + chunk);
  }
  return w;
}

// Each warp computes the scores of all 32 tokens of a tile over its own 64 head dims, with
// its slice of Q held in registers for the whole kernel (Q used to be re-read from shared
// memory for every 8 tokens: 2 KB of shared-memory traffic per token, the kernel's
// bottleneck on the H200). The four partial score tiles meet in shared memory, where the
// softmax threads add them. PV keeps the same split: warp w accumulates O for its 64 dims.
// Resident blocks per SM the register budget is capped for. V100: 2 (47 KB of static
// shared memory per block, 96 KB per SM). H200 m16n8k16: 4 with one row tile (QN <= 2),
// 3 with two (QN = 4; QN = 3 spills at 168 registers, so 2); the split count should fill
// exactly those slots (one wave): the launcher's caller asks the driver
// (torch.ops.sm70.paged_decode_blocks_per_sm).
template <int G, int QN, bool NATIVE>
struct PdMinBlocks {
  static constexpr int value = !NATIVE ? 2 : (G * QN <= 16 ? 4 : (QN == 3 ? 2 : 3));
};

// BATCHED: one block per slot of the batch's shared chunks (pd_work_batch, batch > 1 with
// splits); otherwise one block per (split, sequence), each sequence cut into num_splits
// equal parts: batch 1, or one part per sequence. Two instantiations (here and in the
// reduce) keep the batch-1 kernels free of the schedule's code (with it inline the H200 ran
// batch 1 4 % slower: register allocation at the 128- and 168-register caps).
template <int G, int QN, bool NATIVE, bool BATCHED = false>
__global__ void __launch_bounds__(kPdWarps * 32, (PdMinBlocks<G, QN, NATIVE>::value))
    paged_decode_kernel(const PagedDecodeParams p) {
  constexpr int D = kPdHeadDim;
  constexpr int R = G * QN;
  constexpr int KP = PdKPitch<NATIVE>::value;
  constexpr int MT = (R + 15) / 16;  // m16 row tiles the m16n8k16 path needs
  static_assert(R <= kPdRows, "at most 32 query rows per KV head");
  // partial-score rows kept: one m16 row tile (QN <= 2) writes only the 8-row halves
  // holding real rows, which keeps static shared memory under 48 KB with V double-buffered;
  // the rest keep all 32 (skipping the padding half at QN = 4 cost the H200 6 %: more
  // spills in the loop at the 168-register cap)
  constexpr int SR = NATIVE && MT == 1 ? (R + 7) / 8 * 8 : kPdRows;
  // PV of tile i - 1 beside QK^T of tile i (one barrier fewer, two independent chains per
  // phase); not for two m16 row tiles (QN = 3, 4) on m16n8k16, where the H200 ran 14 %
  // slower with it (spills at the 168-register cap of 3 blocks per SM)
  constexpr bool PIPE = !NATIVE || MT == 1;
  __shared__ __align__(16) int8_t ks[kPdTile * KP];
  // V is double-buffered when PV of the previous tile runs beside QK^T of this one
  __shared__ __align__(16) int8_t vs[PIPE ? 2 : 1][kPdTile * kPdVPitch];
  __shared__ __align__(16) float ssp[kPdWarps][SR * kPdSPitch];  // partial scores
  __shared__ __align__(8) __half ps[kPdRows * kPdPPitch];
  __shared__ float ksc[kPdTile], vsc[kPdTile];
  __shared__ float row_m[kPdRows], row_l[kPdRows], row_a[kPdRows];
  __shared__ float qpart[kPdWarps][kPdRows];  // per-warp sums of the Q slice, per row
  __shared__ float row_q[kPdRows];            // the K offset of each row's scores

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int kvh = blockIdx.z;
  const int Hkv = p.num_kv_heads;
  int b, ctx, t_begin, t_end;
  if constexpr (BATCHED) {
    const PdWork work = pd_work_batch(p.seq_lens, p.num_splits, p.batch, blockIdx.x,
                                      blockIdx.x == 0 && kvh == 0 ? p.sched : nullptr);
    if (work.b < 0) return;  // more slots than chunks: nothing to read or write
    b = work.b;
    ctx = work.ctx;
    t_begin = work.t_begin;
    t_end = work.t_end;
  } else {
    b = blockIdx.y;
    ctx = p.seq_lens[b];
    const int per_split = pd_chunk_for(ctx, p.num_splits);
    t_begin = blockIdx.x * per_split;
    t_end = min(ctx, t_begin + per_split);
  }
  const int dbase = 64 * warp;  // this warp's head dims

  if (tid < kPdRows) {
    row_m[tid] = kNegInf;
    row_l[tid] = 0.f;
    row_a[tid] = 1.f;
  }

  // loader mapping: 16 threads per token row of 256 bytes, 8 token rows per pass
  const int ld_tok = tid >> 4;  // 0..7
  const int ld_piece = tid & 15;
  const int head_off = kvh * p.block_size;
  const int* bt = p.block_tables + (int64_t)b * p.bt_stride;

  // Cache row (block * Hkv * block_size + head * block_size + offset; the launcher checks
  // it fits 31 bits) of token t0 + lane. Each lane maps one token and the loaders fetch
  // their 4 rows by shuffle: one mapping per token per warp instead of 5 per thread (the
  // per-thread version was a quarter of the kernel's instructions). Tokens past the split
  // read the split's last token instead: always a valid address, no predicates, and their
  // scores are masked (P = 0) whatever they hold. The division is a float reciprocal,
  // exact after one correction step.
  const int bsz = p.block_size;
  const float inv_bs = 1.f / (float)bsz;
  const int blk_stride = Hkv * bsz;
  auto lane_row = [&](int t0) -> int {
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
    return __ldg(bt + blk_i) * blk_stride + head_off + off;
  };

  uint4 kreg[kPdTile / 8], vreg[kPdTile / 8];
  float kscr = 0.f, vscr = 0.f;
  auto load_tile = [&](int t0) {
    const int my_row = lane_row(t0);
#pragma unroll
    for (int j = 0; j < kPdTile / 8; ++j) {
      const int64_t rowi = __shfl_sync(0xffffffffu, my_row, ld_tok + 8 * j);
      kreg[j] = __ldg(reinterpret_cast<const uint4*>(p.k_cache + rowi * D) + ld_piece);
      vreg[j] = __ldg(reinterpret_cast<const uint4*>(p.v_cache + rowi * D) + ld_piece);
    }
    if (warp == 0) {  // the tile's 32 scales; the softmax scale rides on the K scale
      kscr = __ldg(p.k_scale + my_row) * p.scale_log2;
      vscr = __ldg(p.v_scale + my_row);
    }
  };

  // the first tile's loads (block table, then K/V) fly while Q is read and summed
  if (t_begin < t_end) load_tile(t_begin);

  const int gq = lane >> 2, t4 = lane & 3;  // m16n8k16 fragment coordinates
  const int qp = (lane >> 2) & 3;           // m8n8k4 quad pair = row block
  const int hi = lane >> 4;
  const int l4 = lane & 3;
  const int arow = qp * 8 + l4 + 4 * hi;  // m8n8k4 A fragment row
  const int bcol = l4 + 4 * hi;           // m8n8k4 B fragment column (token in 8)

  // Q slice in registers. m8n8k4: row arow, dims dbase + 4kk .. +3 (kk = 0..15).
  // m16n8k16: the reduction order over the warp's 64 dims is free, so lane t's four k
  // values of step s are the contiguous dims dbase + 16t + 4s .. +3, which makes its K
  // fragments for all four steps one 16-byte shared-memory read.
  constexpr int QREGS = NATIVE ? MT * 16 : 32;
  uint32_t qa[QREGS];
  if constexpr (!NATIVE) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (arow < R) v = *reinterpret_cast<const uint4*>(pd_qrow<G, QN>(p, b, kvh, arow) + dbase + 8 * j);
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
        const int r = 16 * mt + gq + 8 * h;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if (r < R)
            v = *reinterpret_cast<const uint4*>(pd_qrow<G, QN>(p, b, kvh, r) + dbase + 16 * t4 + 8 * j);
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

  // per-row sums of this warp's Q slice (fp32 over the fp16 values), for the K offset
  auto h2sum = [](uint32_t w) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    return f.x + f.y;
  };
  if constexpr (!NATIVE) {
    float qs_ = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) qs_ += h2sum(qa[i]);
    qpart[warp][arow] = qs_;  // one lane per row
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
      if (t4 == 0) {
        qpart[warp][16 * mt + gq] = s0;
        qpart[warp][16 * mt + gq + 8] = s1;
      }
    }
    if (MT == 1 && t4 == 0) {  // rows 16..31 hold no query: keep their sums defined
      qpart[warp][16 + gq] = 0.f;
      qpart[warp][24 + gq] = 0.f;
    }
  }

  float oacc[8][8];  // the warp's O slice: 32 x 64 (m8n8k4) or MT x 16 x 64 (m16n8k16)
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int i = 0; i < 8; ++i) oacc[nb][i] = 0.f;


  // softmax thread layout: TPR threads per query row (rows padded to RP), TPT tokens each;
  // warps whose rows are all padding skip the softmax (warp 3 always does)
  constexpr int RP = R <= 8 ? 8 : (R <= 16 ? 16 : 32);
  constexpr int TPR = kPdWarps * 32 / RP;
  constexpr int TPT = kPdTile / TPR;
  __syncthreads();  // qpart complete
  if (tid < kPdRows)
    row_q[tid] = kPdBias * (qpart[0][tid] + qpart[1][tid] + qpart[2][tid] + qpart[3][tid]);

  // O = O * alpha + P V for dims 64*warp .. +63 of the tile whose V is in vb and whose P
  // and alpha the last softmax left in ps / row_a
  auto pv = [&](const int8_t* vb) {
    if constexpr (!NATIVE) {
      const int r0 = qp * 8 + (lane & 1) + 4 * hi;
      const float a0 = row_a[r0], a1 = row_a[r0 + 2];
      // once the running maxima settle, alpha is 1 for every row: skip the 64 multiplies
      if (__builtin_expect(__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f), 0)) {
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
          for (int i = 0; i < 8; ++i) oacc[nb][i] *= (i & 2) ? a1 : a0;
      }
      const __half* prow = &ps[arow * kPdPPitch];
#pragma unroll
      for (int kk = 0; kk < kPdTile / 4; ++kk) {
        const uint2 a2 = *reinterpret_cast<const uint2*>(prow + 4 * kk);
        const uint32_t a[2] = {a2.x, a2.y};
        const int8_t* vrow = &vb[(4 * kk + l4) * kPdVPitch + dbase + 4 * hi];
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
        al[q] = row_a[8 * q + gq];
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
          const __half* p0 = &ps[(16 * mt + gq) * kPdPPitch + 16 * kk + 2 * t4];
          a[mt][0] = *reinterpret_cast<const uint32_t*>(p0);
          a[mt][1] = *reinterpret_cast<const uint32_t*>(p0 + 8 * kPdPPitch);
          a[mt][2] = *reinterpret_cast<const uint32_t*>(p0 + 8);
          a[mt][3] = *reinterpret_cast<const uint32_t*>(p0 + 8 * kPdPPitch + 8);
        }
        // B rows (tokens) 2t, 2t+1, 2t+8, 2t+9 of this 16-token step
        const int8_t* v0 = &vb[(16 * kk + 2 * t4) * kPdVPitch + dbase + 4 * gq];
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
  };

  int vbuf = 0;
  float* my_s = ssp[warp];
  for (int t0 = t_begin; t0 < t_end; t0 += kPdTile) {
    __syncthreads();  // the previous tile's QK^T, PV and softmax are done
#pragma unroll
    for (int j = 0; j < kPdTile / 8; ++j) {
      const uint4 kf = make_uint4(kreg[j].x ^ kPdSignFlip, kreg[j].y ^ kPdSignFlip,
                                  kreg[j].z ^ kPdSignFlip, kreg[j].w ^ kPdSignFlip);
      const uint4 vf = make_uint4(vreg[j].x ^ kPdSignFlip, vreg[j].y ^ kPdSignFlip,
                                  vreg[j].z ^ kPdSignFlip, vreg[j].w ^ kPdSignFlip);
      *reinterpret_cast<uint4*>(&ks[(ld_tok + 8 * j) * KP + ld_piece * 16]) = kf;
      *reinterpret_cast<uint4*>(&vs[vbuf][(ld_tok + 8 * j) * kPdVPitch + ld_piece * 16]) = vf;
    }
    if (tid < kPdTile) {
      ksc[tid] = kscr;
      vsc[tid] = vscr;
    }
    __syncthreads();
    // next tile's loads fly while this one is computed
    if (t0 + kPdTile < t_end) load_tile(t0 + kPdTile);

    // partial S = Q K^T over this warp's 64 dims, all 32 tokens, unscaled
    if constexpr (!NATIVE) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        float sacc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) sacc[i] = 0.f;
        const int8_t* krow = &ks[(8 * nt + bcol) * KP + dbase];
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
          const int row = qp * 8 + (lane & 1) + (i & 2) + 4 * hi;
          const int col = 8 * nt + (i & 4) + (lane & 2);
          *reinterpret_cast<float2*>(&my_s[row * kPdSPitch + col]) = make_float2(sacc[i], sacc[i + 1]);
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint4 kv = *reinterpret_cast<const uint4*>(&ks[(8 * nt + gq) * KP + dbase + 16 * t4]);
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
            if (16 * mt + 8 * h < SR)  // compile-time: halves of padding rows are not kept
              *reinterpret_cast<float2*>(&my_s[(16 * mt + gq + 8 * h) * kPdSPitch + 8 * nt + 2 * t4]) =
                  make_float2(sacc[mt][2 * h], sacc[mt][2 * h + 1]);
      }
    }
    // PV of the previous tile (its V in the other buffer) is independent of the QK^T
    // above: the two overlap, and one barrier per tile goes
    if constexpr (PIPE) {
      if (t0 > t_begin) pv(vs[vbuf ^ 1]);
    }
    __syncthreads();

    // online softmax: the 4 warps' partial scores are summed here, then offset, scaled by
    // the token's K scale (times the softmax scale) and masked past the split, past the
    // context or in the row's causal future. The running maximum is lazy: it moves only
    // when a tile's maximum exceeds it by more than kPdLazy (P then stays <= 2^kPdLazy, far
    // inside fp16), so the O rescale in PV runs on a handful of tiles instead of most.
    if (warp * (32 / TPR) < R) {
      const int sm_row = tid / TPR;
      const int sm_sub = tid % TPR;
      float sv[TPT];
#pragma unroll
      for (int j = 0; j < TPT; ++j) sv[j] = 0.f;
#pragma unroll
      for (int w = 0; w < kPdWarps; ++w) {
        const float* src = &ssp[w][sm_row * kPdSPitch + sm_sub * TPT];
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
      const float qoff = row_q[sm_row];
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < TPT; ++j) {
        const int tl = sm_sub * TPT + j;
        sv[j] = (sv[j] - qoff) * ksc[tl];
        if (!full) sv[j] = t0 + tl <= limit ? sv[j] : kNegInf;
        mx = fmaxf(mx, sv[j]);
      }
#pragma unroll
      for (int o = 1; o < TPR; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = row_m[sm_row];
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
        const __half2 h = __floats2half2_rn(e0 * vsc[tl], e1 * vsc[tl + 1]);
        pw[j / 2] = *reinterpret_cast<const uint32_t*>(&h);
      }
      __half* dst = &ps[sm_row * kPdPPitch + sm_sub * TPT];
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
        row_l[sm_row] = row_l[sm_row] * alpha + sum;
        row_m[sm_row] = m_new;
        row_a[sm_row] = alpha;
      }
    }
    if constexpr (!PIPE) {
      __syncthreads();
      pv(vs[vbuf]);
    }
    if constexpr (PIPE) vbuf ^= 1;
  }
  if (PIPE && t_begin < t_end) {
    __syncthreads();  // the last softmax's P and alpha
    pv(vs[vbuf ^ 1]);
  }
  __syncthreads();

  // write back: the output (one split) or the split's partial
  // partials [Hkv, num_splits * batch slots, R, D]: slot = blockIdx.x (batched) or the split
  // of sequence 0 (batch 1; with one split per sequence there are no partials)
  const int64_t base = ((int64_t)kvh * p.num_splits * p.batch + blockIdx.x) * R;
  auto emit = [&](int row, int dim, const float* v, int n) {  // n adjacent dims
    if (row >= R) return;
    // normalised either way: the output, or the split's partial in fp16 (bounded by the
    // largest |V|, so fp16 holds it; half the bytes of the fp32 unnormalised partial the
    // reduce used to read, 10 MB each way at 64K for 4 rows)
    const float l = row_l[row];
    const float inv = l > 0.f ? 1.f / l : 0.f;
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
  if constexpr (!NATIVE) {
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
      for (int pr = 0; pr < 4; ++pr) {
        // i = 4 (pr >> 1) + 2 (pr & 1): rows r0 + (i & 2), cols (i & 4) + (lane & 2) + {0, 1}
        const int i = 4 * (pr >> 1) + 2 * (pr & 1);
        const int row = qp * 8 + (lane & 1) + (i & 2) + 4 * hi;
        const int dim = dbase + 8 * nb + (i & 4) + (lane & 2);
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
            emit(16 * mt + gq + 8 * rh, dbase + 32 * h + 4 * (2 * t4 + cc), v, 4);
          }
  }
  if (p.num_splits > 1 && tid < R) {
    p.part_ml[(base + tid) * 2] = row_m[tid];
    p.part_ml[(base + tid) * 2 + 1] = row_l[tid];
  }
}

// Combine the splits. One block per (sequence, KV head, row, 16-dim slice), 256 threads:
// 4 lanes of 4 dims x 64 groups of splits. Each thread loads the (max, sum) of splits tid,
// tid + 256, .. and its first 4 fp16 partials (every 64th split) at once, one round trip
// for up to 256 splits (32 registers: the 768 blocks of QN = 4 stay one wave on the H200);
// each partial is weighted by exp2(m - max) * l, and the weighted sums meet in shared
// memory.
// (The first version, one thread per dim walking all splits, had 12 blocks at batch 1 and
// took about 30 us at 256 splits: latency-bound, as long as the decode kernel itself.)
constexpr int kPdRedThreads = 256;
constexpr int kPdRedDims = 16;                             // dims per reduce block
constexpr int kPdRedLanes = kPdRedDims / 4;                // float4 lanes
constexpr int kPdRedGroups = kPdRedThreads / kPdRedLanes;  // split groups (64)
constexpr int kPdRedPerThread = kPdMaxSplits / kPdRedThreads;
constexpr int kPdRedPre = 4;  // partials per thread loaded up front (up to 256 splits)

template <int G, int QN, bool BATCHED = false>
__global__ void __launch_bounds__(kPdRedThreads)
    paged_decode_reduce_kernel(const PagedDecodeParams p) {
  constexpr int D = kPdHeadDim;
  constexpr int R = G * QN;
  constexpr int NQ = D / kPdRedDims;
  __shared__ float wgt[kPdMaxSplits];
  __shared__ float red[kPdRedThreads / 32];
  __shared__ __align__(16) float4 acc_s[kPdRedGroups][kPdRedLanes];
  const int dq = blockIdx.x % NQ;
  const int row = (blockIdx.x / NQ) % R;
  const int kvh = (blockIdx.x / (NQ * R)) % p.num_kv_heads;
  const int b = blockIdx.x / (NQ * R * p.num_kv_heads);
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  // this sequence's chunks: the range the decode kernel's schedule recorded (batched), else
  // every split of the one sequence (splits past the context hold empty partials)
  const int S = BATCHED ? p.sched[2 * b + 1] : p.num_splits;
  const int64_t base = (int64_t)kvh * p.num_splits * p.batch + (BATCHED ? p.sched[2 * b] : 0);
  // this thread's partials (every 64th split, 4 dims) are loaded before the weights are
  // known, beside the (max, sum) loads: one global round trip instead of two
  const int dl = tid % kPdRedLanes, sg = tid / kPdRedLanes;
  const __half* po = p.part_o + (base * R + row) * D + kPdRedDims * dq + 4 * dl;
  auto load4 = [&](int s) {  // 4 fp16 dims of split s's partial
    const uint2 u = *reinterpret_cast<const uint2*>(po + (int64_t)s * R * D);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, c.x, c.y);
  };
  float4 pv[kPdRedPre];
#pragma unroll
  for (int j = 0; j < kPdRedPre; ++j) {
    const int s = sg + j * kPdRedGroups;
    pv[j] = s < S ? load4(s) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float ms[kPdRedPerThread], ls[kPdRedPerThread];
  float mx = kNegInf;
#pragma unroll
  for (int i = 0; i < kPdRedPerThread; ++i) {
    const int s = tid + i * kPdRedThreads;
    ms[i] = kNegInf;
    ls[i] = 0.f;
    if (s < S) {
      const float2 ml = *reinterpret_cast<const float2*>(p.part_ml + ((base + s) * R + row) * 2);
      ms[i] = ml.x;
      ls[i] = ml.y;
    }
    mx = fmaxf(mx, ms[i]);
  }
  mx = warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < kPdRedThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  const float m_use = mx == kNegInf ? 0.f : mx;
  float den = 0.f;
#pragma unroll
  for (int i = 0; i < kPdRedPerThread; ++i) {
    const int s = tid + i * kPdRedThreads;
    const float w = exp2f(ms[i] - m_use) * ls[i];  // the partials are already divided by l
    if (s < S) wgt[s] = w;
    den += w;
  }
  den = warp_sum(den);
  __syncthreads();  // everyone has read red (the max) before it is reused
  if (lane == 0) red[warp] = den;
  __syncthreads();  // wgt and red complete
  den = 0.f;
#pragma unroll
  for (int w = 0; w < kPdRedThreads / 32; ++w) den += red[w];
  float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float w, const float4& v) {
    num.x += w * v.x;
    num.y += w * v.y;
    num.z += w * v.z;
    num.w += w * v.w;
  };
#pragma unroll
  for (int j = 0; j < kPdRedPre; ++j) {
    const int s = sg + j * kPdRedGroups;
    add(s < S ? wgt[s] : 0.f, pv[j]);
  }
#pragma unroll 4
  for (int s = sg + kPdRedPre * kPdRedGroups; s < S; s += kPdRedGroups)  // S > 256 only
    add(wgt[s], load4(s));
  acc_s[sg][dl] = num;
  __syncthreads();
  if (tid < kPdRedDims) {
    const int l = tid / 4, c = tid % 4;
    float v = 0.f;
#pragma unroll 8
    for (int g2 = 0; g2 < kPdRedGroups; ++g2) v += reinterpret_cast<const float*>(&acc_s[g2][l])[c];
    const int g = row / QN, qi = row % QN;
    p.out[(int64_t)(b * QN + qi) * p.out_tok_stride + (int64_t)(kvh * G + g) * D +
          kPdRedDims * dq + tid] = __float2half_rn(den > 0.f ? v / den : 0.f);
  }
}

#ifndef __CUDACC_RTC__
template <int G, int QN, bool NATIVE>
inline void launch_paged_decode(const PagedDecodeParams& p, int batch, cudaStream_t stream) {
  const int red_blocks = batch * p.num_kv_heads * G * QN * (kPdHeadDim / kPdRedDims);
  if (batch > 1 && p.num_splits > 1) {
    dim3 grid(p.num_splits * batch, 1, p.num_kv_heads);
    paged_decode_kernel<G, QN, NATIVE, true><<<grid, kPdWarps * 32, 0, stream>>>(p);
    paged_decode_reduce_kernel<G, QN, true><<<red_blocks, kPdRedThreads, 0, stream>>>(p);
  } else {
    dim3 grid(p.num_splits, batch, p.num_kv_heads);
    paged_decode_kernel<G, QN, NATIVE, false><<<grid, kPdWarps * 32, 0, stream>>>(p);
    // batch 1 with splits (one split per sequence writes the output directly)
    if (p.num_splits > 1)
      paged_decode_reduce_kernel<G, QN, false><<<red_blocks, kPdRedThreads, 0, stream>>>(p);
  }
}
#endif

}  // namespace sm70
