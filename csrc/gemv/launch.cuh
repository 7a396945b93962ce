// Host side of the GPTQ-int8 GEMV (nvcc only): which kernel a shape runs, its grid, and the
// launch. Requirements checked by the caller (torch_bindings/gemv.cu): M = 1..8,
// K % 16 == 0, group_size % 16 == 0, K % group_size == 0, 16-byte aligned x and qw.
#pragma once

#ifndef __CUDACC_RTC__

#include <cuda_runtime.h>

#include "common/arch.cuh"
#include "gemv/classic.cuh"
#include "gemv/stream.cuh"
#include "gemv/tensor_core.cuh"

namespace sm70 {

enum class GemvPath { kStream, kTensorCore, kClassic };

inline bool gptq_gemv_tc_fits(int K, int group_size) {
  return K % kGemvTcUnit == 0 && group_size % kGemvTcUnit == 0;
}

// M = 1 (decode) streams; M = 2..8 (MTP verification) take the tensor cores where their K
// rules hold: there the time is nearly flat in M, where the classic kernel's M
// multiply-adds per byte grow with it. Tiny N stays classic: a few blocks are
// latency-bound, and the classic kernel's K split fills the GPU better there.
inline GemvPath gptq_gemv_path(int M, int N, int K, int group_size) {
  if (M == 1) return GemvPath::kStream;
  if (N >= 1024 && gptq_gemv_tc_fits(K, group_size)) return GemvPath::kTensorCore;
  return GemvPath::kClassic;
}

// Classic kernel: K split across the block's warps only when one warp per R rows would
// leave the GPU short of warps (fewer than 10 per SM).
inline int gptq_gemv_ksplit(int N, int rows, int sm_count) {
  const int warps = (N + rows - 1) / rows;
  return warps < 10 * sm_count ? kGemvWarps : 1;
}

// Streamed kernel: split only when the rows leave the GPU short of warps AND K is long
// enough that each warp's slice still fills the pipeline (or the rows are fewer than SMs).
inline int gptq_gemv_stream_ksplit(int N, int K, int rows, int sm_count) {
  const int warps = (N + rows - 1) / rows;
  return warps < 10 * sm_count && (K >= 4096 || warps < sm_count) ? kGemvWarps : 1;
}

inline int gptq_gemv_blocks(int N, int rows, int ksplit) {
  const int row_sets = (N + rows - 1) / rows;
  return ksplit == 1 ? (row_sets + kGemvWarps - 1) / kGemvWarps : row_sets;
}

struct GemvTail {
  int blocks;      // grid
  int ks1_blocks;  // blocks with ksplit 1 (the rest split K)
};

// The streamed kernel's grid with its K-split tail. A ksplit-1 grid of B blocks gives some
// SMs ceil(B / SMs) blocks and others one fewer. When the grid is more than one wave of
// resident blocks and does not divide evenly over the SMs, the last partial wave would run
// a block or two per SM for a whole block lifetime; then only floor(B / SMs) x SMs blocks
// keep ksplit 1 (the same count on every SM) and the rows left over go to K-split blocks
// (R rows each, the warps split K): a quarter of the bytes per block, dispatched last, so
// they even out the SMs' ends. Within one wave a split only adds blocks, so none is made.
inline GemvTail gptq_gemv_stream_tail(int N, int rows, int ksplit, int blocks, int sms,
                                      int resident_blocks) {
  const GemvTail plain = {blocks, ksplit == 1 ? blocks : 0};
  if (ksplit != 1 || sms <= 0 || blocks <= resident_blocks || blocks % sms == 0) return plain;
  const int ks1 = blocks / sms * sms;
  const int rows_left = N - ks1 * kGemvWarps * rows;
  return {ks1 + (rows_left + rows - 1) / rows, ks1};
}

// Tensor-core kernel: warps per row tile, 4, or 8 when 4 per tile would leave fewer than
// 12 warps per SM and every warp keeps 2+ units.
inline int gptq_gemv_tc_ksplit(int N, int K, int tile_rows, int sm_count) {
  const int tiles = (N + tile_rows - 1) / tile_rows;
  return tiles * kGemvWarps < 12 * sm_count && K / kGemvTcUnit >= 16 ? 8 : kGemvWarps;
}

template <class Arch>
inline void launch_gptq_gemv_tc(const __half* x, const uint8_t* qw, const __half2* sz,
                                const __half* bias, __half* y, int M, int N, int K,
                                int group_size, int sm_count, cudaStream_t stream) {
  constexpr int rows = GemvTcRows<Arch>::value;
  const int ks = gptq_gemv_tc_ksplit(N, K, rows, sm_count);
  const int tiles = (N + rows - 1) / rows;
  if (ks == 8) {
    gptq_gemv_tc_kernel<Arch, 8, 1><<<tiles, 8 * 32, 0, stream>>>(x, qw, sz, bias, y, M, N, K,
                                                                  group_size, ks);
    return;
  }
  const int blocks = (tiles * ks + kGemvWarps - 1) / kGemvWarps;
  if constexpr (Arch::kM16n8k16) {
    // two accumulator chains when the grid is one wave at 4 blocks per SM (GemvTcPipe)
    if (blocks <= 4 * sm_count) {
      gptq_gemv_tc_kernel<Arch, kGemvWarps, 2><<<blocks, kGemvWarps * 32, 0, stream>>>(
          x, qw, sz, bias, y, M, N, K, group_size, ks);
      return;
    }
  }
  gptq_gemv_tc_kernel<Arch, kGemvWarps, 1><<<blocks, kGemvWarps * 32, 0, stream>>>(
      x, qw, sz, bias, y, M, N, K, group_size, ks);
}

inline void launch_gptq_gemv_stream(const __half* x, const uint8_t* qw, const __half2* sz,
                                    const __half* bias, __half* y, int N, int K,
                                    int group_size, int sm_count, cudaStream_t stream) {
  constexpr int R = kGemvStreamRows;
  const int ks = gptq_gemv_stream_ksplit(N, K, R, sm_count);
  const GemvTail t = gptq_gemv_stream_tail(N, R, ks, gptq_gemv_blocks(N, R, ks), sm_count,
                                           kGemvStreamBlocksPerSm * sm_count);
  gptq_gemv_stream_kernel<R><<<t.blocks, kGemvWarps * 32, 0, stream>>>(
      x, qw, sz, bias, y, N, K, group_size, t.ks1_blocks);
}

template <int M>
inline void launch_gptq_gemv_classic(const __half* x, const uint8_t* qw, const __half2* sz,
                                     const __half* bias, __half* y, int N, int K,
                                     int group_size, int sm_count, cudaStream_t stream) {
  constexpr int R = GemvRows<M>::value;
  const int ks = gptq_gemv_ksplit(N, R, sm_count);
  gptq_gemv_kernel<M, R><<<gptq_gemv_blocks(N, R, ks), kGemvWarps * 32, 0, stream>>>(
      x, qw, sz, bias, y, N, K, group_size, ks);
}

// y[M, N] = x[M, K] W: the kernel gptq_gemv_path picks, with the given architecture tag for
// the tensor-core path.
template <class Arch>
inline void launch_gptq_gemv(const __half* x, const uint8_t* qw, const __half2* sz,
                             const __half* bias, __half* y, int M, int N, int K, int group_size,
                             int sm_count, cudaStream_t stream) {
  switch (gptq_gemv_path(M, N, K, group_size)) {
    case GemvPath::kStream:
      launch_gptq_gemv_stream(x, qw, sz, bias, y, N, K, group_size, sm_count, stream);
      return;
    case GemvPath::kTensorCore:
      launch_gptq_gemv_tc<Arch>(x, qw, sz, bias, y, M, N, K, group_size, sm_count, stream);
      return;
    case GemvPath::kClassic:
      break;
  }
  switch (M) {
#define SM70_GEMV_CLASSIC(m_)                                                             \
  case m_:                                                                                \
    launch_gptq_gemv_classic<m_>(x, qw, sz, bias, y, N, K, group_size, sm_count, stream); \
    break;
    SM70_GEMV_CLASSIC(2)
    SM70_GEMV_CLASSIC(3)
    SM70_GEMV_CLASSIC(4)
    SM70_GEMV_CLASSIC(5)
    SM70_GEMV_CLASSIC(6)
    SM70_GEMV_CLASSIC(7)
    default:
      launch_gptq_gemv_classic<8>(x, qw, sz, bias, y, N, K, group_size, sm_count, stream);
#undef SM70_GEMV_CLASSIC
  }
}

}  // namespace sm70

#endif  // __CUDACC_RTC__
