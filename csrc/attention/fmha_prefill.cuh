// Chunked-prefill attention (FMHA) on Volta tensor cores: head_dim 256, causal, GQA G:1,
// variable-length sequences whose new queries attend to their earlier context in the paged
// int8 KV cache and to the chunk's own fp16 K/V.
//
// What it computes, per sequence b with q_len = qsl[b+1] - qsl[b] new tokens after
// ctx = ctx_lens[b] cached ones: query token t (absolute position ctx + t) of head h sees
// keys j = 0 .. ctx + t, key j < ctx dequantised from the cache (int8 x its fp32 scale,
// per token and KV head), key j >= ctx the chunk's own k/v row j - ctx (fp16);
// out = softmax(sm_scale q K^T) V with fp32 scores, statistics and accumulators.
//
// Tiling. One block = one KV head and 64 query rows of one sequence, a row being a
// (token, query head of the group) pair: row m = token m / G, head kvh * G + m % G, so the
// G heads sharing a KV head share every K/V tile that is loaded (the tiles are the bytes
// a long context moves, and the row packing also keeps short chunks from idling rows).
// Keys go by in tiles of 32. 8 warps: for S = Q K^T warp w owns rows 16 (w % 4) .. +15
// and all 32 keys of the tile over head dims 128 (w / 4) .. +127, so each Q fragment it
// loads feeds two products (the two warps of a row group leave partial scores that the
// softmax adds); for O += P V the same rows and head dims (64 fp32 accumulators per
// lane). Each m8n8k4 instruction is a 16 x 16 tile: quad pair p takes rows 8 (p & 1) and
// columns 8 (p >> 1) of it.
// The softmax runs between the two products on 4 threads per row, each keeping the row's
// running max and sum in registers for the whole kernel; it writes P (fp16) and the row's
// rescale factor to shared memory. The next tile's K/V bytes are loaded into registers
// while the current tile is computed. Context rows are read with 16-byte loads where every
// row starts 16-byte aligned and with 8- or 4-byte loads otherwise (TRITON_ATTN's page has
// 260-byte rows), chosen at launch from the bases and strides (fm_ctx_vec).
//
// Shared memory (dynamic; Volta gives a block at most 96 KB): Q 64 rows, K and V 32 rows
// each (fp16, padded pitches), two partial S tiles 64 x 32 fp32, P 64 x 32 fp16, two
// floats per row. The pitches put the 16 rows one fragment load touches on distinct
// banks (Q, K: 130 words per row, V: 136, P: 18). That leaves room for one block per SM
// on a V100, hence 8 warps per block (the latency hiding a second block would give).
//
// Architecture tags (common/arch.cuh): arch::Sm70 is the m8n8k4 code a V100 runs;
// arch::Sm80 (the sm_80+ test GPU, where m8n8k4 is emulated) runs the same tiling, rows,
// softmax and loads with m16n8k16 products: its own pitches (kFm16*) and V stored
// transposed, so every fragment is 4-byte shared-memory reads.
#pragma once

#include "common/arch.cuh"
#include "common/mma.cuh"
#include "common/sm70.cuh"

namespace sm70 {

constexpr int kFmD = 256;       // head_dim
constexpr int kFmRows = 64;     // query rows (token x group head) per block
constexpr int kFmKeys = 32;     // keys per tile
constexpr int kFmWarps = 8;
constexpr int kFmThreads = kFmWarps * 32;
constexpr int kFmQPitch = 260;  // halves per Q / K row in shared memory
constexpr int kFmVPitch = 272;  // halves per V row
constexpr int kFmSPitch = 36;   // floats per S row
constexpr int kFmPPitch = 36;   // halves per P row

constexpr int kFmQBytes = kFmRows * kFmQPitch * 2;
constexpr int kFmKBytes = kFmKeys * kFmQPitch * 2;
constexpr int kFmVBytes = kFmKeys * kFmVPitch * 2;
constexpr int kFmSBytes = 2 * kFmRows * kFmSPitch * 4;  // two partial score tiles
constexpr int kFmPBytes = kFmRows * kFmPPitch * 2;
constexpr int kFmSmemBytes = kFmQBytes + kFmKBytes + kFmVBytes + kFmSBytes + kFmPBytes +
                             2 * kFmRows * 4;
static_assert(kFmSmemBytes <= 96 * 1024, "Volta: at most 96 KB of shared memory per block");
static_assert(kFmQBytes % 16 == 0 && kFmKBytes % 16 == 0 && kFmVBytes % 16 == 0 &&
                  kFmSBytes % 16 == 0 && kFmPBytes % 16 == 0,
              "16-byte aligned sub-buffers");

// arch::Sm80 (m16n8k16): fragments are 4-byte pairs along k, so the pitches that spread a
// fragment load over all banks differ (132 words per Q / K row, 20 per P row), and V is
// stored transposed (one row of 32 keys per head dim) so a B fragment (two keys of one
// dim) is one 4-byte read.
constexpr int kFm16QPitch = 264;  // halves per Q / K row
constexpr int kFm16VtPitch = 40;  // halves per transposed V row (one head dim)
constexpr int kFm16PPitch = 40;   // halves per P row
constexpr int kFm16QBytes = kFmRows * kFm16QPitch * 2;
constexpr int kFm16KBytes = kFmKeys * kFm16QPitch * 2;
constexpr int kFm16VBytes = kFmD * kFm16VtPitch * 2;
constexpr int kFm16PBytes = kFmRows * kFm16PPitch * 2;
constexpr int kFm16SmemBytes = kFm16QBytes + kFm16KBytes + kFm16VBytes + kFmSBytes +
                               kFm16PBytes + 2 * kFmRows * 4;
static_assert(kFm16SmemBytes <= 96 * 1024, "the same budget on the sm_80+ instantiation");
static_assert(kFm16QBytes % 16 == 0 && kFm16KBytes % 16 == 0 && kFm16VBytes % 16 == 0 &&
                  kFm16PBytes % 16 == 0,
              "16-byte aligned sub-buffers");

template <class Arch>
struct FmLayout {
  static constexpr bool kTc16 = Arch::kM16n8k16;
  static constexpr int QPitch = kTc16 ? kFm16QPitch : kFmQPitch;
  static constexpr int PPitch = kTc16 ? kFm16PPitch : kFmPPitch;
  static constexpr int QBytes = kTc16 ? kFm16QBytes : kFmQBytes;
  static constexpr int KBytes = kTc16 ? kFm16KBytes : kFmKBytes;
  static constexpr int VBytes = kTc16 ? kFm16VBytes : kFmVBytes;
  static constexpr int PBytes = kTc16 ? kFm16PBytes : kFmPBytes;
  static constexpr int Bytes = kTc16 ? kFm16SmemBytes : kFmSmemBytes;
};

struct FmhaPrefillParams {
  const __half* q;      // [T, Hq, 256]
  const __half* k;      // [T, Hkv, 256]: the chunk's own keys
  const __half* v;      // [T, Hkv, 256]
  const int8_t* k_cache;  // element (blk, tok, head, d) at blk*cs[0] + tok*cs[1] + head*cs[2] + d
  const int8_t* v_cache;
  const float* k_scale;  // element (blk, tok, head) at blk*ss[0] + tok*ss[1] + head*ss[2]
  const float* v_scale;
  const int* block_table;  // [B, bt_stride]
  const int* query_start_loc;  // [B + 1]
  const int* ctx_lens;         // [B]
  __half* out;                 // [T, Hq, 256]
  int64_t q_tok_stride, q_head_stride;  // in elements
  int64_t k_tok_stride, k_head_stride;
  int64_t v_tok_stride, v_head_stride;
  int64_t out_tok_stride, out_head_stride;
  int64_t cs_block, cs_token, cs_head;  // cache strides, elements (bytes)
  int64_t ss_block, ss_token, ss_head;  // scale strides, elements
  // widest load (16, 8 or 4 bytes) that every context row's address allows: 16 on a packed
  // cache, 4 on TRITON_ATTN's 260-byte rows (fm_ctx_vec sets it at launch)
  int ctx_vec;
  int bt_stride;
  int block_size;
  int group;  // G = Hq / Hkv
  float scale_log2;  // sm_scale * log2(e)
};

// Raw bytes of one thread's share of a K/V tile: 32 dims of one key (8 threads per key).
// kind 1: cache row (32 int8 in k[0..1], v[0..1], read with ctx_vec-byte loads, and the
// two scales); kind 2: the chunk's fp16 row (64 bytes in k[0..3], v[0..3]); kind 0: no key
// (stored as zeros, so P = 0 times V stays 0).
struct FmTileRegs {
  uint4 k[4];
  uint4 v[4];
  float ks, vs;
  int kind;
};

// 32 bytes of a cache row into two uint4 in memory order, with loads of `vec` bytes (the
// uniform launch choice, so the branch never diverges): the same bytes and sectors on every
// path, only more load instructions where the rows are 8- or 4-byte aligned.
__device__ __forceinline__ void fm_load_row32(const int8_t* src, int vec, uint4& a, uint4& b) {
  if (vec == 16) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    a = __ldg(s);
    b = __ldg(s + 1);
  } else if (vec == 8) {
    const uint2* s = reinterpret_cast<const uint2*>(src);
    const uint2 w0 = __ldg(s), w1 = __ldg(s + 1), w2 = __ldg(s + 2), w3 = __ldg(s + 3);
    a = make_uint4(w0.x, w0.y, w1.x, w1.y);
    b = make_uint4(w2.x, w2.y, w3.x, w3.y);
  } else {
    const unsigned* s = reinterpret_cast<const unsigned*>(src);
    a = make_uint4(__ldg(s), __ldg(s + 1), __ldg(s + 2), __ldg(s + 3));
    b = make_uint4(__ldg(s + 4), __ldg(s + 5), __ldg(s + 6), __ldg(s + 7));
  }
}

__device__ __forceinline__ void fm_load_tile(const FmhaPrefillParams& p, int kt, int kvh,
                                             int ctx, int kv_len, int q0, const int* bt,
                                             FmTileRegs& r) {
  const int tid = threadIdx.x;
  const int j = kt * kFmKeys + (tid >> 3);  // key
  const int piece = tid & 7;                // dims 32 piece .. +31
  if (j < ctx) {
    const int blk = __ldg(bt + j / p.block_size);
    const int off = j % p.block_size;
    const int64_t row = (int64_t)blk * p.cs_block + (int64_t)off * p.cs_token +
                        (int64_t)kvh * p.cs_head + piece * 32;
    fm_load_row32(p.k_cache + row, p.ctx_vec, r.k[0], r.k[1]);
    fm_load_row32(p.v_cache + row, p.ctx_vec, r.v[0], r.v[1]);
    const int64_t srow =
        (int64_t)blk * p.ss_block + (int64_t)off * p.ss_token + (int64_t)kvh * p.ss_head;
    r.ks = __ldg(p.k_scale + srow);
    r.vs = __ldg(p.v_scale + srow);
    r.kind = 1;
  } else if (j < kv_len) {
    const int64_t t = q0 + (j - ctx);
    const uint4* kp =
        reinterpret_cast<const uint4*>(p.k + t * p.k_tok_stride + kvh * p.k_head_stride) +
        piece * 4;
    const uint4* vp =
        reinterpret_cast<const uint4*>(p.v + t * p.v_tok_stride + kvh * p.v_head_stride) +
        piece * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r.k[i] = __ldg(kp + i);
      r.v[i] = __ldg(vp + i);
    }
    r.kind = 2;
  } else {
    r.kind = 0;
  }
}

// Two adjacent halves of shared memory as one word (4-byte aligned by construction).
__device__ __forceinline__ uint32_t ld_u32(const __half* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// The fp32 scale as an unevaluated sum of two halves, hi + lo (|lo| <= 2^-12 |hi|), both
// in each lane of a half2: the dequantisation below multiplies by both, so the one scale
// of a whole row is not rounded to 11 bits.
struct FmScale2 {
  __half2 hi, lo;
};

__device__ __forceinline__ FmScale2 fm_scale2(float s) {
  const __half h = __float2half_rn(s);
  const __half l = __float2half_rn(s - __half2float(h));
  return {__halves2half2(h, h), __halves2half2(l, l)};
}

// Four int8 (one word) times the scale as two half2 words, with no integer or float
// conversion instruction (Volta issues those at a quarter of the fp32 rate, and a context
// tile converts 64 values per thread): prmt makes each code's biased byte u = q + 128 the
// low byte of the half 1024 + u, one exact subtraction leaves q (exact in fp16), and
// fma(q, hi, q lo) rounds q hi + q lo once: within about one fp16 rounding of q x scale,
// like converting the fp32 product.
__device__ __forceinline__ uint2 fm_dequant4(uint32_t w, const FmScale2& s) {
  const uint32_t u = w ^ 0x80808080u;  // signed codes to biased bytes
  const uint32_t b01 = __byte_perm(u, 0x64646464u, 0x4140);  // halves 1024 + u0, 1024 + u1
  const uint32_t b23 = __byte_perm(u, 0x64646464u, 0x4342);
  const __half2 off = __float2half2_rn(1152.f);
  const __half2 q01 = __hsub2(*reinterpret_cast<const __half2*>(&b01), off);
  const __half2 q23 = __hsub2(*reinterpret_cast<const __half2*>(&b23), off);
  const __half2 a = __hfma2(q01, s.hi, __hmul2(q01, s.lo));
  const __half2 b = __hfma2(q23, s.hi, __hmul2(q23, s.lo));
  return make_uint2(*reinterpret_cast<const uint32_t*>(&a),
                    *reinterpret_cast<const uint32_t*>(&b));
}

template <class Arch>
__device__ __forceinline__ void fm_store_tile(const FmTileRegs& r, __half* ks, __half* vs) {
  using L = FmLayout<Arch>;
  const int tid = threadIdx.x;
  const int key = tid >> 3;
  const int d0 = (tid & 7) * 32;
  uint2* kd = reinterpret_cast<uint2*>(ks + key * L::QPitch + d0);  // 8-byte aligned rows
  uint2 kv[8], vv[8];  // the thread's 32 K and 32 V values as fp16, 4 per word pair
  if (r.kind == 1) {
    const FmScale2 ks2 = fm_scale2(r.ks), vs2 = fm_scale2(r.vs);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t kw[4] = {r.k[i].x, r.k[i].y, r.k[i].z, r.k[i].w};
      const uint32_t vw[4] = {r.v[i].x, r.v[i].y, r.v[i].z, r.v[i].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        kv[4 * i + c] = fm_dequant4(kw[c], ks2);
        vv[4 * i + c] = fm_dequant4(vw[c], vs2);
      }
    }
  } else if (r.kind == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      kv[2 * i] = make_uint2(r.k[i].x, r.k[i].y);
      kv[2 * i + 1] = make_uint2(r.k[i].z, r.k[i].w);
      vv[2 * i] = make_uint2(r.v[i].x, r.v[i].y);
      vv[2 * i + 1] = make_uint2(r.v[i].z, r.v[i].w);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      kv[i] = make_uint2(0u, 0u);
      vv[i] = make_uint2(0u, 0u);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) kd[i] = kv[i];
  if constexpr (!L::kTc16) {
    uint2* vd = reinterpret_cast<uint2*>(vs + key * kFmVPitch + d0);
#pragma unroll
    for (int i = 0; i < 8; ++i) vd[i] = vv[i];
  } else {  // transposed: dim d0 + e, key
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __half* h = reinterpret_cast<const __half*>(&vv[i]);
#pragma unroll
      for (int e = 0; e < 4; ++e) vs[(d0 + 4 * i + e) * kFm16VtPitch + key] = h[e];
    }
  }
}

// Grid: (row blocks of the longest chunk, B, Hkv), kFmThreads threads and
// dynamic shared memory (FmLayout<Arch>::Bytes). The tag picks the products (top of file).
template <class Arch>
__global__ void __launch_bounds__(kFmThreads, 1)
    fmha_prefill_kernel(const FmhaPrefillParams p) {
  extern __shared__ __align__(16) unsigned char fm_smem[];
  using L = FmLayout<Arch>;
  constexpr bool TC16 = L::kTc16;
  __half* qs = reinterpret_cast<__half*>(fm_smem);
  __half* ks = reinterpret_cast<__half*>(fm_smem + L::QBytes);
  __half* vs = reinterpret_cast<__half*>(fm_smem + L::QBytes + L::KBytes);
  float* ss = reinterpret_cast<float*>(fm_smem + L::QBytes + L::KBytes + L::VBytes);
  __half* ps =
      reinterpret_cast<__half*>(fm_smem + L::QBytes + L::KBytes + L::VBytes + kFmSBytes);
  float* row_a = reinterpret_cast<float*>(fm_smem + L::QBytes + L::KBytes + L::VBytes +
                                          kFmSBytes + L::PBytes);
  float* row_l = row_a + kFmRows;

  const int b = blockIdx.y;
  const int kvh = blockIdx.z;
  const int q0 = p.query_start_loc[b];
  const int q_len = p.query_start_loc[b + 1] - q0;
  const int ctx = p.ctx_lens[b];
  const int G = p.group;
  const int rows = q_len * G;
  // the heaviest (latest) row blocks first: causal work grows with the row block
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kFmRows;
  if (m0 >= rows) return;
  const int kv_len = ctx + q_len;
  const int t_last = min((m0 + kFmRows - 1) / G, q_len - 1);
  const int n_tiles = (ctx + t_last + 1 + kFmKeys - 1) / kFmKeys;
  const int* bt = p.block_table + (int64_t)b * p.bt_stride;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  FmTileRegs raw;
  fm_load_tile(p, 0, kvh, ctx, kv_len, q0, bt, raw);

  // Q rows into shared memory: 32 threads per row (16 bytes each), 8 rows per pass;
  // padding rows are zeros
#pragma unroll
  for (int i = 0; i < kFmRows / 8; ++i) {
    const int r = (tid >> 5) + 8 * i;
    const int m = m0 + r;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (m < rows) {
      const int t = m / G;
      const int h = kvh * G + (m - t * G);
      val = __ldg(reinterpret_cast<const uint4*>(p.q + (int64_t)(q0 + t) * p.q_tok_stride +
                                                 (int64_t)h * p.q_head_stride) +
                  lane);
    }
    uint2* dst = reinterpret_cast<uint2*>(qs + r * L::QPitch + lane * 8);
    dst[0] = make_uint2(val.x, val.y);
    dst[1] = make_uint2(val.z, val.w);
  }

  // fragment coordinates (common/mma.cuh): quad pair qp, lane half hi, lane in quad l4
  const int qp = (lane >> 2) & 3;
  const int hi = lane >> 4;
  const int l4 = lane & 3;
  const int rg = warp & 3;   // row group: rows 16 rg .. +15
  const int ch = warp >> 2;  // head dims 128 ch .. +127 (S: partial over them; O: owned)
  const int a_row = 16 * rg + 8 * (qp & 1) + l4 + 4 * hi;  // A fragment row (Q, P)
  const int s_key = 8 * (qp >> 1) + l4 + 4 * hi;  // B fragment key (K), + 16 per key group
  const int c_row0 = 16 * rg + 8 * (qp & 1) + (lane & 1) + 4 * hi;  // C row, + (i & 2)
  const int c_col0 = 8 * (qp >> 1) + (lane & 2);                    // C column, + (i&4)+(i&1)
  // m16n8k16 fragment coordinates: row (A, C) / column (B) g, k pair (A, B) / column pair t
  const int gq = lane >> 2;
  const int t4 = lane & 3;

  // softmax thread: row sm_row, columns 8 sm_part .. +7, its row's running statistics
  const int sm_row = tid >> 2;
  const int sm_part = tid & 3;
  const int sm_m = m0 + sm_row;
  const int sm_limit = sm_m < rows ? ctx + sm_m / G : -1;  // newest key the row sees
  float run_m = kNegInf;
  float run_l = 0.f;

  float o[8][8];
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[s][i] = 0.f;

  for (int kt = 0; kt < n_tiles; ++kt) {
    fm_store_tile<Arch>(raw, ks, vs);
    if (kt + 1 < n_tiles) fm_load_tile(p, kt + 1, kvh, ctx, kv_len, q0, bt, raw);
    __syncthreads();

    if constexpr (TC16) {
      // partial S over the warp's 128 dims, m16n8k16: one m16 row tile x four n8 key tiles
      float acc[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
      const __half* qa = qs + (16 * rg + gq) * L::QPitch + 128 * ch + 2 * t4;
      const __half* kb = ks + gq * L::QPitch + 128 * ch + 2 * t4;
#pragma unroll 4
      for (int kk = 0; kk < 128 / 16; ++kk) {
        const uint32_t a[4] = {ld_u32(qa + 16 * kk), ld_u32(qa + 8 * L::QPitch + 16 * kk),
                               ld_u32(qa + 16 * kk + 8),
                               ld_u32(qa + 8 * L::QPitch + 16 * kk + 8)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const __half* kj = kb + 8 * j * L::QPitch + 16 * kk;
          const uint32_t bb[2] = {ld_u32(kj), ld_u32(kj + 8)};
          mma_m16n8k16(acc[j], a, bb);
        }
      }
      float* sp = ss + ch * kFmRows * kFmSPitch + (16 * rg + gq) * kFmSPitch + 2 * t4;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<float2*>(sp + 8 * j) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(sp + 8 * kFmSPitch + 8 * j) = make_float2(acc[j][2], acc[j][3]);
      }
    } else
    // partial S = Q K^T over the warp's 128 dims: 16 rows x 32 keys (two key groups of
    // 16), two independent accumulator chains per group
    {
      float acc[2][2][8];
#pragma unroll
      for (int g = 0; g < 2; ++g)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[g][c][i] = 0.f;
      const __half* qa = qs + a_row * kFmQPitch + 128 * ch;
      const __half* kb = ks + s_key * kFmQPitch + 128 * ch;
#pragma unroll 8
      for (int kk = 0; kk < 128 / 4; ++kk) {
        const uint2 av = *reinterpret_cast<const uint2*>(qa + 4 * kk);
        const uint32_t a[2] = {av.x, av.y};
#pragma unroll
        for (int g = 0; g < 2; ++g) {
          const uint2 bv = *reinterpret_cast<const uint2*>(kb + 16 * g * kFmQPitch + 4 * kk);
          const uint32_t bb[2] = {bv.x, bv.y};
          mma_m8n8k4(acc[g][kk & 1], a, bb);
        }
      }
      float* sp = ss + ch * kFmRows * kFmSPitch;
#pragma unroll
      for (int g = 0; g < 2; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = c_row0 + (i & 2);
          const int c = 16 * g + c_col0 + (i & 4) + (i & 1);
          sp[r * kFmSPitch + c] = acc[g][0][i] + acc[g][1][i];
        }
    }
    __syncthreads();

    // online softmax (log2 domain) of the tile, 4 threads per row
    {
      // the two partial tiles (dims 0..127 and 128..255) added, then the softmax scale
      const float* s_lo = ss + sm_row * kFmSPitch + 8 * sm_part;
      const float* s_hi = s_lo + kFmRows * kFmSPitch;
      const float4 a0 = *reinterpret_cast<const float4*>(s_lo);
      const float4 a1 = *reinterpret_cast<const float4*>(s_lo + 4);
      const float4 b0 = *reinterpret_cast<const float4*>(s_hi);
      const float4 b1 = *reinterpret_cast<const float4*>(s_hi + 4);
      float sv[8] = {a0.x + b0.x, a0.y + b0.y, a0.z + b0.z, a0.w + b0.w,
                     a1.x + b1.x, a1.y + b1.y, a1.z + b1.z, a1.w + b1.w};
#pragma unroll
      for (int c = 0; c < 8; ++c) sv[c] *= p.scale_log2;
      const int j0 = kt * kFmKeys + 8 * sm_part;
      float mx = kNegInf;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        if (j0 + c > sm_limit) sv[c] = kNegInf;
        mx = fmaxf(mx, sv[c]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(run_m, mx);
      const float base = m_new == kNegInf ? 0.f : m_new;  // a row with no key yet
      const float alpha = exp2f(run_m - base);
      float sum = 0.f;
      __half pv[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float e = exp2f(sv[c] - base);  // masked: exp2(-inf) = 0
        sum += e;
        pv[c] = __float2half_rn(e);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      run_l = run_l * alpha + sum;
      run_m = m_new;
      uint2* pd = reinterpret_cast<uint2*>(ps + sm_row * L::PPitch + 8 * sm_part);
      pd[0] = *reinterpret_cast<const uint2*>(&pv[0]);
      pd[1] = *reinterpret_cast<const uint2*>(&pv[4]);
      if (sm_part == 0) row_a[sm_row] = alpha;
    }
    __syncthreads();

    // O = alpha O + P V over the warp's 16 rows x 128 dims
    if constexpr (TC16) {
      // 16 n8 dim tiles, o[s][i] as o16[2 s + (i >> 2)][i & 3]
      float(&o16)[16][4] = *reinterpret_cast<float(*)[16][4]>(&o[0][0]);
      const float a_lo = row_a[16 * rg + gq];
      const float a_hi = row_a[16 * rg + gq + 8];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o16[j][0] *= a_lo;
        o16[j][1] *= a_lo;
        o16[j][2] *= a_hi;
        o16[j][3] *= a_hi;
      }
      const __half* pa = ps + (16 * rg + gq) * L::PPitch + 2 * t4;
      const __half* vb = vs + (128 * ch + gq) * kFm16VtPitch + 2 * t4;
#pragma unroll
      for (int kk = 0; kk < kFmKeys / 16; ++kk) {
        const uint32_t a[4] = {ld_u32(pa + 16 * kk), ld_u32(pa + 8 * L::PPitch + 16 * kk),
                               ld_u32(pa + 16 * kk + 8),
                               ld_u32(pa + 8 * L::PPitch + 16 * kk + 8)};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const __half* vj = vb + 8 * j * kFm16VtPitch + 16 * kk;
          const uint32_t bb[2] = {ld_u32(vj), ld_u32(vj + 8)};
          mma_m16n8k16(o16[j], a, bb);
        }
      }
    } else {
      const float a_lo = row_a[c_row0];
      const float a_hi = row_a[c_row0 + 2];
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int i = 0; i < 8; ++i) o[s][i] *= (i & 2) ? a_hi : a_lo;
      const __half* pa = ps + a_row * kFmPPitch;
#pragma unroll
      for (int kk = 0; kk < kFmKeys / 4; ++kk) {
        const uint2 av = *reinterpret_cast<const uint2*>(pa + 4 * kk);
        const uint32_t a[2] = {av.x, av.y};
        const __half* vb = vs + (4 * kk + l4) * kFmVPitch + 128 * ch + 8 * (qp >> 1) + 4 * hi;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const uint2 bv = *reinterpret_cast<const uint2*>(vb + 16 * s);
          const uint32_t bb[2] = {bv.x, bv.y};
          mma_m8n8k4_rr(o[s], a, bb);
        }
      }
    }
    __syncthreads();
  }

  if (sm_part == 0) row_l[sm_row] = run_l;
  __syncthreads();

  // out = O / l for the warp's rows that are real (token, head) pairs
  if constexpr (TC16) {
    const float(&o16)[16][4] = *reinterpret_cast<const float(*)[16][4]>(&o[0][0]);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * rg + gq + 8 * hh;
      const int m = m0 + r;
      if (m >= rows) continue;
      const float l = row_l[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int t = m / G;
      const int h = kvh * G + (m - t * G);
      __half* dst = p.out + (int64_t)(q0 + t) * p.out_tok_stride +
                    (int64_t)h * p.out_head_stride + 128 * ch + 2 * t4;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<__half2*>(dst + 8 * j) =
            __floats2half2_rn(o16[j][2 * hh] * inv, o16[j][2 * hh + 1] * inv);
    }
  } else {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = c_row0 + 2 * hh;
      const int m = m0 + r;
      if (m >= rows) continue;
      const float l = row_l[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int t = m / G;
      const int h = kvh * G + (m - t * G);
      __half* dst = p.out + (int64_t)(q0 + t) * p.out_tok_stride + (int64_t)h * p.out_head_stride +
                    128 * ch + 8 * (qp >> 1) + (lane & 2);
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        // C columns (i & 4) + (lane & 2) + (i & 1): pairs i, i + 1 are adjacent columns
#pragma unroll
        for (int q4 = 0; q4 < 2; ++q4) {
          const int i = 4 * q4 + 2 * hh;  // i & 2 = 2 hh, i & 4 = 4 q4
          *reinterpret_cast<__half2*>(dst + 16 * s + 4 * q4) =
              __floats2half2_rn(o[s][i] * inv, o[s][i + 1] * inv);
        }
      }
    }
  }
}

// The m8n8k4 (or, on sm_80+, m16n8k16) throughput ceiling: each warp runs `iters` rounds
// of 8 independent accumulator chains from registers, no memory traffic; the sums go to
// out[blockIdx.x * blockDim.x + threadIdx.x] so nothing is optimised away. WIDE: m16n8k16.
template <bool WIDE>
__global__ void __launch_bounds__(256) fmha_tc_peak_kernel(float* __restrict__ out, int iters) {
  const uint32_t seed = threadIdx.x * 0x9e3779b9u;
  const __half2 h = __floats2half2_rn((float)(seed & 7) * 0.001f, 0.002f);
  const uint32_t w = *reinterpret_cast<const uint32_t*>(&h);
  float total = 0.f;
  if constexpr (WIDE) {
    float acc[8][4];
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[c][i] = 0.f;
    const uint32_t a[4] = {w, w ^ 1u, w, w ^ 2u};
    const uint32_t bb[2] = {w ^ 3u, w};
    for (int it = 0; it < iters; ++it)
#pragma unroll
      for (int c = 0; c < 8; ++c) mma_m16n8k16(acc[c], a, bb);
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) total += acc[c][i];
  } else {
    float acc[8][8];
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[c][i] = 0.f;
    const uint32_t a[2] = {w, w ^ 1u};
    const uint32_t bb[2] = {w ^ 3u, w};
    for (int it = 0; it < iters; ++it)
#pragma unroll
      for (int c = 0; c < 8; ++c) mma_m8n8k4(acc[c], a, bb);
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) total += acc[c][i];
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

#ifndef __CUDACC_RTC__
// The widest context load every row allows: a row starts at base + blk cs_block +
// tok cs_token + head cs_head (+ 32 piece), so the load width is the largest of 16, 8, 4
// dividing both bases and all three strides (the binding has checked 4 divides them).
inline int fm_ctx_vec(const FmhaPrefillParams& p) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p.k_cache) |
                        reinterpret_cast<uintptr_t>(p.v_cache) | (uint64_t)p.cs_block |
                        (uint64_t)p.cs_token | (uint64_t)p.cs_head;
  return bits % 16 == 0 ? 16 : bits % 8 == 0 ? 8 : 4;
}

template <class Arch>
inline cudaError_t launch_fmha_prefill(const FmhaPrefillParams& p, int batch, int num_kv_heads,
                                       int max_q_len, cudaStream_t stream) {
  const int64_t max_rows = (int64_t)max_q_len * p.group;
  if (batch == 0 || max_rows == 0) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(
      fmha_prefill_kernel<Arch>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      FmLayout<Arch>::Bytes);
  if (e != cudaSuccess) return e;
  const dim3 grid((unsigned)((max_rows + kFmRows - 1) / kFmRows), (unsigned)batch,
                  (unsigned)num_kv_heads);
  FmhaPrefillParams lp = p;
  lp.ctx_vec = fm_ctx_vec(p);
  fmha_prefill_kernel<Arch><<<grid, kFmThreads, FmLayout<Arch>::Bytes, stream>>>(lp);
  return cudaGetLastError();
}

template <bool WIDE>
inline void launch_fmha_tc_peak(float* out, int blocks, int iters, cudaStream_t stream) {
  fmha_tc_peak_kernel<WIDE><<<blocks, 256, 0, stream>>>(out, iters);
}
#endif

}  // namespace sm70
