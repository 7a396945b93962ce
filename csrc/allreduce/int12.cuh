// The 12-bit exchange format of the two-GPU all-reduce: fp16 rounded to six mantissa bits
// (1 sign, 5 exponent, 6 mantissa), two codes in three bytes. The plain-PyTorch reference
// is vllm_patch/distributed/int12.py; the format, its error bound and why it was chosen over
// a per-block scale are in docs/allreduce.md. These functions must match that reference bit
// for bit.
//
// One thread packs 8 values (one 16-byte load of halves) into three 32-bit words: code i
// occupies bits 12i .. 12i+11 of the 96-bit little-endian group, which is the same byte
// stream as "value 2j in the low 12 bits of three bytes, value 2j+1 in the high 12".
//
// Pure CUDA (NVRTC compiles it for sm_70): integer ops and fp16 conversions only. The value
// functions are __host__ __device__ so a CPU test (tests/test_allreduce_int12_host.py) can
// run exactly this code on every fp16 pattern.
#pragma once

#include "common/sm70.cuh"

namespace sm70 {

constexpr uint32_t kInt12MaxFinite = 0x7bfu;  // 65024: finite values saturate here
constexpr uint32_t kInt12Inf = 0x7c0u;
constexpr uint32_t kInt12Nan = 0x7e0u;  // the quiet NaN; every NaN becomes it (sign kept)

// The 12-bit code of one fp16 bit pattern `h` (low 16 bits): round to nearest, ties to even,
// at bit 4. Rounding the pattern as an integer is exact across binades and into the
// subnormals, because fp16's encoding is monotone in the magnitude.
__host__ __device__ __forceinline__ uint32_t int12_encode(uint32_t h) {
  const uint32_t sign = (h >> 4) & 0x800u;
  const uint32_t mag = h & 0x7fffu;
  uint32_t r = (mag + 7u + ((mag >> 4) & 1u)) >> 4;
  // 65504 would round to 65536, which is not finite: a finite partial sum must not become
  // inf in transit (the peer could not tell it from a real overflow)
  r = r < kInt12MaxFinite ? r : kInt12MaxFinite;
  r = mag == 0x7c00u ? kInt12Inf : r;
  // a NaN with payload only in the four dropped bits would otherwise round to inf
  r = mag > 0x7c00u ? kInt12Nan : r;
  return sign | r;
}

// The fp16 value of a code, as a float (exact: the code is the top 12 bits of the pattern).
__host__ __device__ __forceinline__ float int12_decode(uint32_t c) {
  return __half2float(__ushort_as_half((unsigned short)((c & 0xfffu) << 4)));
}

// Q(x) of one fp16 value, as a float: what the peer reads back.
__host__ __device__ __forceinline__ float int12_round(uint32_t h) {
  return int12_decode(int12_encode(h));
}

// One word of the 12-bit all-reduce's output: the two own halves of `own` (quantised, so
// both ranks compute the same) plus the peer's codes lo and hi, summed in float and rounded
// once to fp16.
__host__ __device__ __forceinline__ uint32_t int12_add_word(uint32_t own, uint32_t lo,
                                                            uint32_t hi) {
  const __half2 s = __floats2half2_rn(int12_round(own & 0xffffu) + int12_decode(lo),
                                      int12_round(own >> 16) + int12_decode(hi));
  return *reinterpret_cast<const uint32_t*>(&s);
}

// One word of the fp16 all-reduce's output: two halves each side, summed in float, rounded
// once (the correctly rounded sum: float carries 2 x 11 + 2 bits).
__host__ __device__ __forceinline__ uint32_t fp16_add_word(uint32_t a, uint32_t b) {
  const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&a));
  const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&b));
  const __half2 s = __floats2half2_rn(fa.x + fb.x, fa.y + fb.y);
  return *reinterpret_cast<const uint32_t*>(&s);
}

// 8 halves (a 16-byte group, half 2w in the low 16 bits of word w) -> three packed words.
__host__ __device__ __forceinline__ void int12_pack8(const uint4& v, uint32_t out[3]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t c[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    c[2 * i] = int12_encode(w[i] & 0xffffu);
    c[2 * i + 1] = int12_encode(w[i] >> 16);
  }
  out[0] = c[0] | (c[1] << 12) | (c[2] << 24);
  out[1] = (c[2] >> 8) | (c[3] << 4) | (c[4] << 16) | (c[5] << 28);
  out[2] = (c[5] >> 4) | (c[6] << 8) | (c[7] << 20);
}

// Three packed words -> the 8 codes they hold, in order.
__host__ __device__ __forceinline__ void int12_unpack8(const uint32_t p[3], uint32_t c[8]) {
  c[0] = p[0] & 0xfffu;
  c[1] = (p[0] >> 12) & 0xfffu;
  c[2] = (p[0] >> 24) | ((p[1] & 0xfu) << 8);
  c[3] = (p[1] >> 4) & 0xfffu;
  c[4] = (p[1] >> 16) & 0xfffu;
  c[5] = (p[1] >> 28) | ((p[2] & 0xffu) << 4);
  c[6] = (p[2] >> 8) & 0xfffu;
  c[7] = p[2] >> 20;
}

// Single-GPU pack and unpack of n8 groups of 8 values: what the all-reduce kernel does to its
// own partial, exposed as ops so one GPU can check the format against the reference.
constexpr int kInt12Threads = 256;

__global__ void __launch_bounds__(kInt12Threads)
    int12_pack_kernel(const uint4* __restrict__ in, uint32_t* __restrict__ out, int n8) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += gridDim.x * blockDim.x) {
    uint32_t p[3];
    int12_pack8(in[i], p);
    out[3 * i] = p[0];
    out[3 * i + 1] = p[1];
    out[3 * i + 2] = p[2];
  }
}

__global__ void __launch_bounds__(kInt12Threads)
    int12_unpack_kernel(const uint32_t* __restrict__ in, uint4* __restrict__ out, int n8) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += gridDim.x * blockDim.x) {
    const uint32_t p[3] = {in[3 * i], in[3 * i + 1], in[3 * i + 2]};
    uint32_t c[8];
    int12_unpack8(p, c);
    uint4 v;
    v.x = ((c[0] & 0xfffu) << 4) | ((c[1] & 0xfffu) << 20);
    v.y = ((c[2] & 0xfffu) << 4) | ((c[3] & 0xfffu) << 20);
    v.z = ((c[4] & 0xfffu) << 4) | ((c[5] & 0xfffu) << 20);
    v.w = ((c[6] & 0xfffu) << 4) | ((c[7] & 0xfffu) << 20);
    out[i] = v;
  }
}

#ifndef __CUDACC_RTC__
inline int int12_grid(int n8) {
  const int blocks = (n8 + kInt12Threads - 1) / kInt12Threads;
  return blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks);
}

inline void launch_int12_pack(const void* in, void* out, int n8, cudaStream_t stream) {
  int12_pack_kernel<<<int12_grid(n8), kInt12Threads, 0, stream>>>(
      static_cast<const uint4*>(in), static_cast<uint32_t*>(out), n8);
}

inline void launch_int12_unpack(const void* in, void* out, int n8, cudaStream_t stream) {
  int12_unpack_kernel<<<int12_grid(n8), kInt12Threads, 0, stream>>>(
      static_cast<const uint32_t*>(in), static_cast<uint4*>(out), n8);
}
#endif  // __CUDACC_RTC__

}  // namespace sm70
