// torch binding of the GEMM family: torch.ops.sm70.int8_gemm_lowrank (prefill-sized M),
// the int8 GEMM with its fused per-row low-rank correction.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "gemm/gptq_dequant.cuh"
#include "gemm/int8_gemm_lowrank.cuh"
#include "torch_bindings/bindings_common.h"

namespace sm70_bindings {
namespace {

Tensor int8_gemm_lowrank(const Tensor& x, const Tensor& qw, const Tensor& sz, int64_t group_size,
                         const std::optional<Tensor>& bias, const std::optional<Tensor>& a_t,
                         const std::optional<Tensor>& b_t,
                         const std::optional<Tensor>& row_mask) {
  SM70_CHECK_CUDA(x);
  SM70_CHECK_DTYPE(x, at::kHalf);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 8 == 0,
              "x must be [M, K] with unit column stride and a row stride multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got " + std::to_string(K));
  check_packed_weight(qw, sz, K, group_size);
  check_aligned16(x, "x");
  check_aligned16(qw, "qw");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rank = a_t.has_value() ? a_t->size(0) : 0;
  Tensor t;
  Tensor mask_u8;
  if (rank > 0) {
    TORCH_CHECK(b_t.has_value(), "b_t is required with a_t");
    SM70_CHECK_DTYPE(*a_t, at::kHalf);
    SM70_CHECK_DTYPE(*b_t, at::kHalf);
    SM70_CHECK_CONTIG(*a_t);
    SM70_CHECK_CONTIG(*b_t);
    TORCH_CHECK(a_t->dim() == 2 && a_t->size(1) == K, "a_t must be [rank, K]");
    TORCH_CHECK(b_t->dim() == 2 && b_t->size(0) == N && b_t->size(1) == rank,
                "b_t must be [N, rank]");
    TORCH_CHECK(rank <= 256 && rank % 8 == 0,
                "rank must be a multiple of 8 up to 256, got " + std::to_string(rank));
    if (row_mask.has_value()) {
      TORCH_CHECK(row_mask->numel() == M,
                  "row_mask must have M = " + std::to_string(M) + " elements");
      mask_u8 = row_mask->to(at::kByte).contiguous();
    } else {
      mask_u8 = at::ones({M}, x.options().dtype(at::kByte));
    }
    t = at::empty({M, rank}, x.options());
    sm70::LowrankGemmParams p1{};
    p1.x = hptr(x);
    p1.wh = hptr(*a_t);
    p1.row_mask = mask_u8.data_ptr<uint8_t>();
    p1.y = hptr_mut(t);
    p1.ldx = x.stride(0);
    p1.ldy = rank;
    p1.M = (int)M;
    p1.N = (int)rank;
    p1.K = (int)K;
    p1.group_size = 1;
    sm70::launch_lowrank_gemm(p1, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  sm70::LowrankGemmParams p{};
  p.x = hptr(x);
  p.qw = qw.data_ptr<uint8_t>();
  p.sz = reinterpret_cast<const __half2*>(sz.data_ptr<at::Half>());
  if (rank > 0) {
    p.x2 = hptr(t);
    p.w2 = hptr(*b_t);
    p.ldx2 = rank;
    p.K2 = (int)rank;
  }
  if (bias.has_value()) {
    SM70_CHECK_DTYPE(*bias, at::kHalf);
    SM70_CHECK_CONTIG(*bias);
    TORCH_CHECK(bias->numel() == N, "bias must have N elements");
    p.bias = hptr(*bias);
  }
  p.y = hptr_mut(y);
  p.ldx = x.stride(0);
  p.ldy = N;
  p.M = (int)M;
  p.N = (int)N;
  p.K = (int)K;
  p.group_size = (int)group_size;
  sm70::launch_lowrank_gemm(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

void gptq_dequant(const Tensor& qw, const Tensor& sz, int64_t group_size, Tensor& out) {
  check_packed_weight(qw, sz, qw.size(1), group_size);
  check_aligned16(qw, "qw");
  SM70_CHECK_CUDA(out);
  SM70_CHECK_CONTIG(out);
  SM70_CHECK_DTYPE(out, at::kHalf);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == qw.size(0) && out.size(1) == qw.size(1),
              "out must be [N, K] like qw");
  TORCH_CHECK(qw.size(1) % 8 == 0, "K must be a multiple of 8");
  check_aligned16(out, "out");
  const c10::cuda::CUDAGuard guard(qw.device());
  sm70::GptqDequantParams p{};
  p.qw = qw.data_ptr<uint8_t>();
  p.sz = reinterpret_cast<const __half2*>(sz.data_ptr<at::Half>());
  p.w = hptr_mut(out);
  p.N = qw.size(0);
  p.K = qw.size(1);
  p.group_size = (int)group_size;
  sm70::launch_gptq_dequant(p, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace sm70_bindings

TORCH_LIBRARY_IMPL(sm70, CUDA, m) {
  m.impl("int8_gemm_lowrank", &sm70_bindings::int8_gemm_lowrank);
  m.impl("gptq_dequant", &sm70_bindings::gptq_dequant);
}
