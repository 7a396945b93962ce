// Shared pieces of the torch bindings (torch_bindings/*.cu): argument checks, pointer
// casts, and which architecture tag a launch uses. Messages are built from strings only:
// streaming integers through c10::str crashed in the extension's ostream on one torch
// image, so numbers go through std::to_string.
#pragma once

#include <cstdint>

namespace sm70_bindings {

// The process-wide architecture path (ops_schema.cpp: set_arch_path / arch_path): true
// when "sm70" forces the arch::Sm70 instantiations on any GPU.
bool arch_path_forces_sm70();

// torch.ops.sm70.paged_decode_blocks_per_sm (attention.cu), registered in ops_schema.cpp.
int64_t paged_decode_blocks_per_sm(int64_t q_per_seq, int64_t device);

}  // namespace sm70_bindings

#ifdef __CUDACC__
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_fp16.h>

#include <string>

#define SM70_CHECK_CUDA(t) TORCH_CHECK((t).is_cuda(), #t " must be a CUDA tensor")
#define SM70_CHECK_CONTIG(t) TORCH_CHECK((t).is_contiguous(), #t " must be contiguous")
#define SM70_CHECK_DTYPE(t, d)                                                           \
  TORCH_CHECK((t).scalar_type() == (d), #t " must be " + std::string(c10::toString(d)) + \
                                            ", got " + c10::toString((t).scalar_type()))

namespace sm70_bindings {

using at::Tensor;

inline void check_aligned16(const Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned");
}

inline const __half* hptr(const Tensor& t) {
  return reinterpret_cast<const __half*>(t.data_ptr<at::Half>());
}
inline __half* hptr_mut(Tensor& t) { return reinterpret_cast<__half*>(t.data_ptr<at::Half>()); }

// The GEMV / GEMM weight: qw [N, K] uint8 codes and sz [N, K / group_size, 2] fp16
// (scale, zero), the layout of gemv/gemv_common.cuh.
inline void check_packed_weight(const Tensor& qw, const Tensor& sz, int64_t K,
                                int64_t group_size) {
  SM70_CHECK_CUDA(qw);
  SM70_CHECK_CUDA(sz);
  SM70_CHECK_CONTIG(qw);
  SM70_CHECK_CONTIG(sz);
  SM70_CHECK_DTYPE(qw, at::kByte);
  SM70_CHECK_DTYPE(sz, at::kHalf);
  TORCH_CHECK(qw.dim() == 2 && qw.size(1) == K, "qw must be [N, K] with K = " + std::to_string(K));
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0,
              "group_size must be a multiple of 16 dividing K (K=" + std::to_string(K) +
                  ", group_size=" + std::to_string(group_size) + ")");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == qw.size(0) && sz.size(1) == K / group_size &&
                  sz.size(2) == 2,
              "sz must be [N, K / group_size, 2] (scale, zero)");
}

// Whether a launch on this device takes the arch::Sm80 (m16n8k16) instantiations: on
// sm_80+ GPUs, where m8n8k4 is emulated, unless set_arch_path("sm70") forces the Volta
// code. A V100 always runs arch::Sm70.
inline bool use_sm80_path(int device) {
  if (arch_path_forces_sm70()) return false;
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 8;
}

}  // namespace sm70_bindings
#endif  // __CUDACC__
