// Paged decode attention over the int8 KV cache (attention/kv_int8.cuh layout), head_dim 256,
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
// arch::Sm70 is what a V100 runs. arch::Sm80 swaps the two products for mma.m16n8k16
// (sm_80+ only), everything else unchanged: there m8n8k4 is emulated, so the test GPU
// measures the memory pipeline through that instantiation and checks the arch::Sm70 one
// for correctness.
//   attention/decode_common.cuh       tile shape, parameters, biased int8 conversion
//   attention/decode_schedule.cuh     which tokens a block reads
//   attention/paged_decode_kernel.cuh the kernel: prologue, tile loop, split epilogue
//   attention/paged_decode_reduce.cuh the reduce over a sequence's splits
#pragma once

#include "attention/paged_decode_kernel.cuh"
#include "attention/paged_decode_reduce.cuh"

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

namespace sm70 {

template <int G, int QN, class Arch>
inline void launch_paged_decode(const PagedDecodeParams& p, int batch, cudaStream_t stream) {
  const int red_blocks = batch * p.num_kv_heads * G * QN * (kPdHeadDim / kPdRedDims);
  if (batch > 1 && p.num_splits > 1) {
    dim3 grid(p.num_splits * batch, 1, p.num_kv_heads);
    paged_decode_kernel<G, QN, Arch, true><<<grid, kPdWarps * 32, 0, stream>>>(p);
    paged_decode_reduce_kernel<G, QN, true><<<red_blocks, kPdRedThreads, 0, stream>>>(p);
  } else {
    dim3 grid(p.num_splits, batch, p.num_kv_heads);
    paged_decode_kernel<G, QN, Arch, false><<<grid, kPdWarps * 32, 0, stream>>>(p);
    // batch 1 with splits (one split per sequence writes the output directly)
    if (p.num_splits > 1)
      paged_decode_reduce_kernel<G, QN, false><<<red_blocks, kPdRedThreads, 0, stream>>>(p);
  }
}

}  // namespace sm70
#endif  // __CUDACC_RTC__
