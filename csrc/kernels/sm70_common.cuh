// Shared device helpers for the sm_70 (Volta) kernels.
//
// Pure CUDA: no torch, no host-only headers, so the same text compiles with nvcc
// (the torch extension) and NVRTC 12.8 (CI's sm_70 compile check). Only Volta
// features are used: fp16 tensor cores through mma.sync.m8n8k4, prmt, shuffles.
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

// One warp-wide m8n8k4 product: four independent 8x8x4 products, one per quad pair
// (lanes 0-3+16-19, 4-7+20-23, 8-11+24-27, 12-15+28-31). A row-major, B column-major,
// fp16 inputs, fp32 accumulators. Fragment layouts (PTX ISA, "mma.m8n8k4 .f16"):
//   A: row = lane%4 + 4*(lane>=16), k = 0..3 (two f16x2 registers)
//   B (col): col = lane%4 + 4*(lane>=16), k = 0..3
//   C (f32): row = (lane&1) + (i&2) + 4*(lane>=16), col = (i&4) + (lane&2) + (i&1)
__device__ __forceinline__ void mma_m8n8k4(float (&d)[8], const uint32_t (&a)[2],
                                           const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
      "{%0,%1,%2,%3,%4,%5,%6,%7};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(b[1]));
}

// Same, with B row-major: B row (k) = lane%4, cols = 0..3 (+4 for lanes >= 16).
__device__ __forceinline__ void mma_m8n8k4_rr(float (&d)[8], const uint32_t (&a)[2],
                                              const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
      "{%0,%1,%2,%3,%4,%5,%6,%7};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(b[1]));
}

// m16n8k16 (sm_80+ native tensor-core shape). Only the H200/A100 test path of the decode
// kernel uses it: there mma.m8n8k4 is emulated and far slower than on Volta. On sm_70 the
// body is a trap and the launcher never selects that path.
//   A: a0 (row g, k 2t..2t+1), a1 (row g+8), a2 (row g, k +8), a3 (row g+8, k +8)
//   B (col): b0 (k 2t..2t+1, col g), b1 (k 2t+8..2t+9, col g);   g = lane/4, t = lane%4
//   C: c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8)
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

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
