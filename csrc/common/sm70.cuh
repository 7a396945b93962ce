// Shared device helpers for the sm_70 (Volta) kernels: fixed-width integer types under
// NVRTC, -inf, the prmt "magic number" byte conversion and warp reductions.
//
// Pure CUDA: no torch, no host-only headers, so the same text compiles with nvcc
// (the torch extension) and NVRTC 12.8 (CI's sm_70 compile check). Only Volta
// features are used: prmt, shuffles (the tensor-core wrappers are in common/mma.cuh).
#pragma once

#include <cuda_fp16.h>

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef int int32_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
#else
#include <cstdint>
#endif

namespace sm70 {

// -inf without math.h (NVRTC has no INFINITY macro)
#define kNegInf __int_as_float(0xff800000)

// Byte j of w (unsigned) as the float 8388608 + byte (exact, no I2F).
template <int J>
__device__ __forceinline__ float u8_magic(uint32_t w) {
  return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7440 | J));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace sm70
