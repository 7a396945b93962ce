// torch binding of the GPTQ-int8 GEMV family: torch.ops.sm70.gptq_gemv. Checks the
// arguments, allocates the output and launches on the current stream; which kernel a shape
// runs is gemv/launch.cuh's rule.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "gemv/gptq_gemv.cuh"
#include "torch_bindings/bindings_common.h"

namespace sm70_bindings {
namespace {

Tensor gptq_gemv(const Tensor& x, const Tensor& qw, const Tensor& sz, int64_t group_size,
                 const std::optional<Tensor>& bias) {
  SM70_CHECK_CUDA(x);
  SM70_CHECK_CONTIG(x);
  SM70_CHECK_DTYPE(x, at::kHalf);
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "gptq_gemv takes 1 to 8 rows, got " + std::to_string(M));
  TORCH_CHECK(K > 0 && K % 16 == 0,
              "K must be a positive multiple of 16, got " + std::to_string(K));
  check_packed_weight(qw, sz, K, group_size);
  check_aligned16(x, "x");
  check_aligned16(qw, "qw");
  const __half* bp = nullptr;
  if (bias.has_value()) {
    SM70_CHECK_DTYPE(*bias, at::kHalf);
    SM70_CHECK_CONTIG(*bias);
    TORCH_CHECK(bias->numel() == N, "bias must have N = " + std::to_string(N) + " elements");
    bp = hptr(*bias);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty({M, N}, x.options());
  if (N == 0) return y;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* q = qw.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const __half2*>(sz.data_ptr<at::Half>());
  const int dev = x.device().index();
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int m = (int)M, n = (int)N, k = (int)K, g = (int)group_size;
  if (use_sm80_path(dev)) {
    sm70::launch_gptq_gemv<sm70::arch::Sm80>(hptr(x), q, s, bp, hptr_mut(y), m, n, k, g, sms,
                                             stream);
  } else {
    sm70::launch_gptq_gemv<sm70::arch::Sm70>(hptr(x), q, s, bp, hptr_mut(y), m, n, k, g, sms,
                                             stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace
}  // namespace sm70_bindings

TORCH_LIBRARY_IMPL(sm70, CUDA, m) { m.impl("gptq_gemv", &sm70_bindings::gptq_gemv); }
