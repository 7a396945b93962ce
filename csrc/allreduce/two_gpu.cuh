// The two-GPU all-reduce over CUDA IPC peer memory: the one-shot fp16 sum and the 12-bit
// packed exchange (allreduce/int12.cuh), for tensor parallelism of two V100s.
//
// Buffers. Each rank allocates ONE buffer once (cudaMalloc, zeroed, its IPC handle sent to
// the peer, which opens it with peer access); the kernel takes both base addresses as plain
// arguments. Layout of a buffer of `total` bytes:
//   [0, 4 * kArBlocks)                  flags: flag b is written by the PEER's block b
//   [4 * kArBlocks, 8 * kArBlocks)      epochs: how many calls block b of this rank has made
//   [kArHeaderBytes, + half)            staging half 0
//   [kArHeaderBytes + half, + 2 half)   staging half 1, half = ar_half_bytes(total)
// A call copies (fp16) or packs (12-bit) the caller's tensor into its own staging half,
// then reads the peer's staging half of the same call and adds. The caller's tensors are
// never shared, so graphs may capture any input and output address.
//
// Handshake (per block, no grid-wide barrier): block b of both ranks handles the same
// elements (same fixed grid, same grid-stride loop). After writing its staging slice,
// block b raises the peer's flag b to its call count e and waits until its own flag b,
// raised by the peer, reaches e; then it reads the peer's slice. There is one exchange per
// call and no closing barrier: an element always travels between the same pair of blocks
// (the grid-stride mapping does not depend on the size), so each block pair is a channel
// of its own. Its call e writes staging half (e & 1); its call e + 2 starts only after it
// saw the peer block's flag of call e + 1, which the peer block raises after it finished
// reading our half (e & 1) in call e. The fixed grid together with the stream order of a
// rank's kernels would carry the same argument on its own; the kernel has both.
// tests/test_allreduce_handshake_model.py checks the design on every interleaving of a
// small model, and that each shortcut (one half, an equality wait, the flag before the
// data, size-dependent chunks without the fixed grid or the stream order) breaks it.
//
// Why this survives CUDA-graph capture and replay: nothing in it changes per call on the
// host. The buffer addresses are fixed for the process, the caller's tensors are fixed by
// the graph's memory pool, and the call count lives in device memory (the epochs), advanced
// by the kernel itself; a replay therefore raises the next count, exactly as an eager call
// does. Flags are compared by serial-number arithmetic (the peer can be at most one call
// ahead), so the 32-bit counts may wrap. Both ranks must make the same sequence of calls
// (tensor parallelism does: same layers, same shapes, same graphs).
//
// Pure CUDA (NVRTC compiles it for sm_70): release/acquire at system scope (sm_70 PTX),
// volatile vector loads of peer memory, no shared memory beyond one word.
#pragma once

#include "allreduce/int12.cuh"
#include "common/sm70.cuh"

namespace sm70 {

constexpr int kArBlocks = 32;
constexpr int kArThreads = 512;
constexpr unsigned kArHeaderBytes = 4096;

// Bytes of one staging half of a buffer of `total` bytes (16-byte aligned; 0 if too small).
__host__ __device__ constexpr unsigned long long ar_half_bytes(unsigned long long total) {
  return total <= kArHeaderBytes ? 0ull : ((total - kArHeaderBytes) / 2) & ~15ull;
}

__device__ __forceinline__ unsigned* ar_flags(char* buf) {
  return reinterpret_cast<unsigned*>(buf);
}
__device__ __forceinline__ unsigned* ar_epochs(char* buf) {
  return reinterpret_cast<unsigned*>(buf) + kArBlocks;
}

__device__ __forceinline__ void ar_store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ar_load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Peer memory is read with volatile loads: never served from a stale L1 line of an earlier
// call, and never turned into a non-coherent (ld.global.nc) load by the compiler.
__device__ __forceinline__ uint4 ar_load_peer16(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ar_load_peer4(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// This block's call count for this call (1 for the first call after the buffer was zeroed).
__device__ __forceinline__ unsigned ar_begin(char* mine) {
  __shared__ unsigned epoch;
  if (threadIdx.x == 0) {
    epoch = *reinterpret_cast<volatile unsigned*>(ar_epochs(mine) + blockIdx.x) + 1u;
  }
  __syncthreads();
  return epoch;
}

// After this block's staging writes: publish them to the peer, then wait for the peer's.
__device__ __forceinline__ void ar_exchange(char* mine, char* peer, unsigned epoch) {
  __syncthreads();  // every thread's staging stores are issued
  if (threadIdx.x == 0) {
    __threadfence_system();  // ... and visible to the peer GPU before the flag is
    ar_epochs(mine)[blockIdx.x] = epoch;
    ar_store_release(ar_flags(peer) + blockIdx.x, epoch);
    // the peer is at most one call ahead, so "reached" is a signed difference (wraps)
    while (static_cast<int>(ar_load_acquire(ar_flags(mine) + blockIdx.x) - epoch) < 0) {
    }
  }
  __syncthreads();
}

// fp16: out = fp16(float(own) + float(peer)), the correctly rounded sum (float holds twice
// fp16's precision plus two bits, so rounding twice equals rounding once). Addition
// commutes, so both ranks write the same bits.
__global__ void __launch_bounds__(kArThreads)
    allreduce_fp16_kernel(const uint4* __restrict__ in, uint4* __restrict__ out, char* mine,
                          char* peer, int n8, unsigned long long half_bytes) {
  const unsigned epoch = ar_begin(mine);
  const unsigned long long off = kArHeaderBytes + (epoch & 1u) * half_bytes;
  uint4* stage = reinterpret_cast<uint4*>(mine + off);
  const uint4* theirs = reinterpret_cast<const uint4*>(peer + off);
  const int step = kArBlocks * kArThreads;
  for (int i = blockIdx.x * kArThreads + threadIdx.x; i < n8; i += step) stage[i] = in[i];
  ar_exchange(mine, peer, epoch);
  for (int i = blockIdx.x * kArThreads + threadIdx.x; i < n8; i += step) {
    const uint4 a = in[i];
    const uint4 b = ar_load_peer16(theirs + i);
    out[i] = make_uint4(fp16_add_word(a.x, b.x), fp16_add_word(a.y, b.y),
                        fp16_add_word(a.z, b.z), fp16_add_word(a.w, b.w));
  }
}

// 12-bit: each rank packs its partial, reads the peer's packed partial and returns
// fp16(float(Q(own)) + float(Q(peer))). Quantising its own value too keeps both ranks'
// results bitwise equal (tensor-parallel ranks must hold the same activations).
__global__ void __launch_bounds__(kArThreads)
    allreduce_int12_kernel(const uint4* __restrict__ in, uint4* __restrict__ out, char* mine,
                           char* peer, int n8, unsigned long long half_bytes) {
  const unsigned epoch = ar_begin(mine);
  const unsigned long long off = kArHeaderBytes + (epoch & 1u) * half_bytes;
  uint32_t* stage = reinterpret_cast<uint32_t*>(mine + off);
  const uint32_t* theirs = reinterpret_cast<const uint32_t*>(peer + off);
  const int step = kArBlocks * kArThreads;
  for (int i = blockIdx.x * kArThreads + threadIdx.x; i < n8; i += step) {
    uint32_t p[3];
    int12_pack8(in[i], p);
    stage[3 * i] = p[0];
    stage[3 * i + 1] = p[1];
    stage[3 * i + 2] = p[2];
  }
  ar_exchange(mine, peer, epoch);
  for (int i = blockIdx.x * kArThreads + threadIdx.x; i < n8; i += step) {
    const uint4 a = in[i];
    const uint32_t p[3] = {ar_load_peer4(theirs + 3 * i), ar_load_peer4(theirs + 3 * i + 1),
                           ar_load_peer4(theirs + 3 * i + 2)};
    uint32_t c[8];
    int12_unpack8(p, c);
    out[i] = make_uint4(int12_add_word(a.x, c[0], c[1]), int12_add_word(a.y, c[2], c[3]),
                        int12_add_word(a.z, c[4], c[5]), int12_add_word(a.w, c[6], c[7]));
  }
}

#ifndef __CUDACC_RTC__
// The launches: always kArBlocks blocks (one of the two arguments above). `mine`
// and `peer` are the two ranks' buffers of `total` bytes each; n8 = elements / 8, and the
// caller has checked that the call's staging fits one half (ar_capacity below).
inline void launch_allreduce_fp16(const void* in, void* out, void* mine, void* peer, int n8,
                                  unsigned long long total, cudaStream_t stream) {
  allreduce_fp16_kernel<<<kArBlocks, kArThreads, 0, stream>>>(
      static_cast<const uint4*>(in), static_cast<uint4*>(out), static_cast<char*>(mine),
      static_cast<char*>(peer), n8, ar_half_bytes(total));
}

inline void launch_allreduce_int12(const void* in, void* out, void* mine, void* peer, int n8,
                                   unsigned long long total, cudaStream_t stream) {
  allreduce_int12_kernel<<<kArBlocks, kArThreads, 0, stream>>>(
      static_cast<const uint4*>(in), static_cast<uint4*>(out), static_cast<char*>(mine),
      static_cast<char*>(peer), n8, ar_half_bytes(total));
}

// The most fp16 elements one call may reduce with a buffer of `total` bytes: the staging of
// n elements is 2n bytes (fp16) or 3n/2 bytes (12-bit), rounded down to groups of 8. Mirrors
// vllm_patch.distributed.selection.capacity_elements.
inline long long ar_capacity(unsigned long long total, bool int12) {
  const unsigned long long half = ar_half_bytes(total);
  const unsigned long long n = int12 ? half / 12ull * 8ull : half / 16ull * 8ull;
  return static_cast<long long>(n);
}
#endif  // __CUDACC_RTC__

}  // namespace sm70
