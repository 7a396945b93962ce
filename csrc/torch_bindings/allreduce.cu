// torch bindings of the two-GPU all-reduce family (torch.ops.sm70.allreduce_fp16,
// allreduce_int12, int12_pack, int12_unpack) and its buffer registration (allreduce_alloc,
// allreduce_open, allreduce_release: bound in ops_schema.cpp, as they take no CUDA tensor).
//
// The buffer is raw cudaMalloc memory, not the caching allocator's: its IPC handle must
// name exactly this allocation for the process's lifetime, and it must never move or be
// reused, because captured graphs hold its address. Buffers are made once, before any
// graph capture (cudaMalloc is not capturable); the all-reduce ops themselves only launch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>

#include "allreduce/int12.cuh"
#include "allreduce/two_gpu.cuh"
#include "torch_bindings/bindings_common.h"

namespace sm70_bindings {

std::tuple<int64_t, Tensor> allreduce_alloc(int64_t nbytes) {
  TORCH_CHECK(nbytes >= (int64_t)sm70::kArHeaderBytes + 32 && nbytes <= (int64_t{1} << 40),
              "allreduce_alloc: nbytes must be " + std::to_string(sm70::kArHeaderBytes + 32) +
                  " .. 2^40, got " + std::to_string(nbytes));
  void* p = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&p, (size_t)nbytes));
  // zero flags and call counts: both ranks start at call 0
  C10_CUDA_CHECK(cudaMemset(p, 0, (size_t)nbytes));
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&h, p));
  Tensor handle = at::empty({(int64_t)sizeof(h)}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(handle.data_ptr<uint8_t>(), &h, sizeof(h));
  return {reinterpret_cast<int64_t>(p), handle};
}

int64_t allreduce_open(const Tensor& handle) {
  TORCH_CHECK(!handle.is_cuda() && handle.scalar_type() == at::kByte && handle.is_contiguous() &&
                  handle.numel() == (int64_t)sizeof(cudaIpcMemHandle_t),
              "allreduce_open: handle must be a CPU uint8 tensor of " +
                  std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data_ptr<uint8_t>(), sizeof(h));
  void* p = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<int64_t>(p);
}

void allreduce_release(int64_t ptr, bool opened) {
  if (ptr == 0) return;
  void* p = reinterpret_cast<void*>(ptr);
  if (opened) {
    C10_CUDA_CHECK(cudaIpcCloseMemHandle(p));
  } else {
    C10_CUDA_CHECK(cudaFree(p));
  }
}

namespace {

void check_input(const Tensor& x, const char* op) {
  SM70_CHECK_CUDA(x);
  SM70_CHECK_DTYPE(x, at::kHalf);
  SM70_CHECK_CONTIG(x);
  TORCH_CHECK(x.numel() % 8 == 0, std::string(op) +
                                      ": the element count must be a multiple of 8, got " +
                                      std::to_string(x.numel()));
  TORCH_CHECK(x.numel() / 8 <= INT32_MAX, std::string(op) + ": too many elements");
  check_aligned16(x, "x");
}

Tensor allreduce(const Tensor& x, int64_t mine, int64_t peer, int64_t buffer_bytes, bool int12) {
  const char* op = int12 ? "allreduce_int12" : "allreduce_fp16";
  check_input(x, op);
  TORCH_CHECK(mine != 0 && peer != 0 && mine != peer,
              std::string(op) + ": mine and peer must be two registered buffers");
  TORCH_CHECK(mine % 16 == 0 && peer % 16 == 0,
              std::string(op) + ": buffers must be 16-byte aligned");
  const long long cap = sm70::ar_capacity((unsigned long long)buffer_bytes, int12);
  TORCH_CHECK(buffer_bytes > 0 && x.numel() <= cap,
              std::string(op) + ": " + std::to_string(x.numel()) + " elements exceed the " +
                  std::to_string(cap) + " a buffer of " + std::to_string(buffer_bytes) +
                  " bytes stages");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty_like(x);
  // an empty call launches nothing on either rank, so the call counts stay in step
  if (x.numel() == 0) return out;
  const int n8 = (int)(x.numel() / 8);
  auto stream = c10::cuda::getCurrentCUDAStream();
  void* m = reinterpret_cast<void*>(mine);
  void* p = reinterpret_cast<void*>(peer);
  if (int12) {
    sm70::launch_allreduce_int12(x.data_ptr(), out.data_ptr(), m, p, n8,
                                 (unsigned long long)buffer_bytes, stream);
  } else {
    sm70::launch_allreduce_fp16(x.data_ptr(), out.data_ptr(), m, p, n8,
                                (unsigned long long)buffer_bytes, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

Tensor allreduce_fp16(const Tensor& x, int64_t mine, int64_t peer, int64_t buffer_bytes) {
  return allreduce(x, mine, peer, buffer_bytes, false);
}

Tensor allreduce_int12(const Tensor& x, int64_t mine, int64_t peer, int64_t buffer_bytes) {
  return allreduce(x, mine, peer, buffer_bytes, true);
}

Tensor int12_pack(const Tensor& x) {
  check_input(x, "int12_pack");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty({x.numel() / 2 * 3}, x.options().dtype(at::kByte));
  if (x.numel() == 0) return out;
  sm70::launch_int12_pack(x.data_ptr(), out.data_ptr(), (int)(x.numel() / 8),
                          c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

Tensor int12_unpack(const Tensor& packed) {
  SM70_CHECK_CUDA(packed);
  SM70_CHECK_DTYPE(packed, at::kByte);
  SM70_CHECK_CONTIG(packed);
  TORCH_CHECK(packed.dim() == 1 && packed.numel() % 12 == 0,
              "int12_unpack: packed must be 1-D with a multiple of 12 bytes (8 values), got " +
                  std::to_string(packed.numel()));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 4 == 0,
              "int12_unpack: packed must be 4-byte aligned");
  const c10::cuda::CUDAGuard guard(packed.device());
  Tensor out = at::empty({packed.numel() / 3 * 2}, packed.options().dtype(at::kHalf));
  if (packed.numel() == 0) return out;
  sm70::launch_int12_unpack(packed.data_ptr(), out.data_ptr(), (int)(packed.numel() / 12),
                            c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace sm70_bindings

TORCH_LIBRARY_IMPL(sm70, CUDA, m) {
  m.impl("allreduce_fp16", &sm70_bindings::allreduce_fp16);
  m.impl("allreduce_int12", &sm70_bindings::allreduce_int12);
  m.impl("int12_pack", &sm70_bindings::int12_pack);
  m.impl("int12_unpack", &sm70_bindings::int12_unpack);
}
