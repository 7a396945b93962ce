// Tensor-core instruction wrappers: mma.sync m8n8k4 (Volta's native shape, what a V100
// runs) and m16n8k16 (sm_80+, only for the arch::Sm80 test instantiations).
#pragma once

#include "common/sm70.cuh"

namespace sm70 {

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

// m16n8k16 (sm_80+ native tensor-core shape). Only the arch::Sm80 instantiations use it
// (common/arch.cuh): there mma.m8n8k4 is emulated and far slower than on Volta. On sm_70
// the body is a trap and the launchers never select that path.
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

}  // namespace sm70
