// Dequantise GPTQ-int8 weights in the GEMV layout (qw [N, K] uint8 codes, sz [N, K/G] half2
// (scale, zero)) to fp16 W^T [N, K]: w = scale * (q - zero), computed in fp32 and rounded once,
// the same arithmetic as the GEMV's and the reference's.
//
// Why it exists: prefill-sized M multiplies through cuBLAS's fp16 tensor-core GEMM on a
// dequantised copy of one layer at a time (vllm_patch/quantization/sm70_gptq.py). The copy
// costs 3 bytes per weight of traffic (read 1, write 2) against the GEMM's 2 * M FLOPs per
// weight, a few per cent from a few hundred rows on; cuBLAS reaches the tensor cores of every
// architecture, Volta's included.
//
// One thread per 8 consecutive codes of a row (one 8-byte load, one 16-byte store); a group
// holds at least 16 codes, so the 8 share one (scale, zero).
#pragma once

#include "common/sm70.cuh"

namespace sm70 {

constexpr int kDqThreads = 256;

struct GptqDequantParams {
  const uint8_t* qw;  // [N, K]
  const __half2* sz;  // [N, K / group_size]
  __half* w;          // [N, K]
  int64_t N, K;
  int group_size;
};

__global__ void __launch_bounds__(kDqThreads) gptq_dequant_kernel(const GptqDequantParams p) {
  const int64_t i = (int64_t)blockIdx.x * kDqThreads + threadIdx.x;  // index of 8 codes
  const int64_t per_row = p.K / 8;
  if (i >= p.N * per_row) return;
  const int64_t n = i / per_row;
  const int64_t k = (i - n * per_row) * 8;
  const uint2 codes = *reinterpret_cast<const uint2*>(p.qw + n * p.K + k);
  const __half2 s = p.sz[n * (p.K / p.group_size) + k / p.group_size];
  const float scale = __low2float(s), zero = __high2float(s);
  const uint32_t words[2] = {codes.x, codes.y};
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t w = words[j >> 1] >> ((j & 1) * 16);
    const float a = scale * ((float)(w & 0xff) - zero);
    const float b = scale * ((float)((w >> 8) & 0xff) - zero);
    const __half2 h = __floats2half2_rn(a, b);
    o[j] = *reinterpret_cast<const uint32_t*>(&h);
  }
  *reinterpret_cast<uint4*>(p.w + n * p.K + k) = out;
}

#ifndef __CUDACC_RTC__
inline void launch_gptq_dequant(const GptqDequantParams& p, cudaStream_t stream) {
  const int64_t items = p.N * (p.K / 8);
  if (items == 0) return;
  const int64_t blocks = (items + kDqThreads - 1) / kDqThreads;
  gptq_dequant_kernel<<<(unsigned)blocks, kDqThreads, 0, stream>>>(p);
}
#endif  // __CUDACC_RTC__

}  // namespace sm70
