// Paged decode attention, shared pieces: tile shape, the parameter block, the biased int8
// conversion of K and V, and the block-wide reduction (attention/paged_decode.cuh says what
// the kernels do).
#pragma once

#include "common/arch.cuh"
#include "common/sm70.cuh"

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
template <class Arch>
struct PdKPitch {
  static constexpr int value = Arch::kM16n8k16 ? kPdHeadDim + 64 : kPdHeadDim + 16;
};

// The KV cache as vLLM's allocator lays it out: a (block, token, head) row of D int8 codes
// lives at k_cache + block * kv_blk_stride + token * kv_tok_stride + head * kv_head_stride
// (bytes; V at the same offsets from v_cache), its fp32 scale at k_scale + block *
// sc_blk_stride + token * sc_tok_stride + head * sc_head_stride (floats). No contiguity is
// assumed: TRITON_ATTN's hybrid page puts K and V of a block side by side and each row's
// scale in its 4 padding bytes (rows of D + 4 bytes), our own tests also use the packed
// [block, head, token, D] order. vec16: every row starts 16-byte aligned (one 16-byte load
// per loader thread); otherwise rows are only 4-byte aligned (260-byte rows) and each
// thread issues four 4-byte loads for the same bytes.
struct PagedDecodeParams {
  const __half* q;          // [B*QN, Hq, D], token stride q_tok_stride (elements)
  const int8_t* k_cache;    // row (block, token, head) at the kv_* strides
  const int8_t* v_cache;
  const float* k_scale;     // scale (block, token, head) at the sc_* strides
  const float* v_scale;
  int64_t kv_blk_stride;    // bytes
  int64_t kv_tok_stride;
  int64_t kv_head_stride;
  int64_t sc_blk_stride;    // floats
  int64_t sc_tok_stride;
  int64_t sc_head_stride;
  int vec16;
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
// fp32 accumulators run over thousands of tokens per split, and the tensor cores'
// truncating accumulation turns the 1152 offset into a large output error at long contexts
// (seen with m16n8k16).
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

}  // namespace sm70
