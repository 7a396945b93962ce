// Paged decode attention: which tokens a block reads. Batch 1 (or one split per sequence)
// cuts each sequence into equal parts; a batch with splits shares equal chunks of the
// batch's tokens over its slots (pd_work_batch).
#pragma once

#include "attention/decode_common.cuh"

namespace sm70 {


// tokens / parts rounded up to whole tiles, at least one tile. I = int for one sequence
// (32-bit division), long long for a batch's total. The batch's longest context also goes
// through long long: as int, the batched QN = 4 arch::Sm80 kernel spills more on sm_90.
template <typename I>
__device__ __forceinline__ int pd_chunk_for(I tokens, I parts) {
  const I per = (tokens + parts - 1) / parts;
  return (int)max((I)kPdTile, (per + kPdTile - 1) / kPdTile * kPdTile);
}

// The slot's work in a batched launch (batch > 1, num_splits > 1). The batch's tokens are
// cut into chunks of one size (whole tiles) and sequence b's chunks take slots first_b ..
// first_b + n_b - 1 of the W = num_splits * batch slots of a KV head: blocks get equal
// token counts whatever the mix of lengths (with the same split count for every sequence,
// one long context batched with seven short ones would run on 1/8 of the grid). The chunk
// is the smallest that fits W slots with at most kPdMaxSplits chunks per sequence; every
// block derives the same schedule from seq_lens (three block reductions and a scan), and
// the block given sched writes each sequence's (first, n) for the reduce.
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

}  // namespace sm70
