// torch bindings of the attention family: the int8 KV write and the paged decode
// (torch.ops.sm70.kv_int8_write, paged_decode, paged_decode_blocks_per_sm). Checks the
// arguments, allocates outputs and launches on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "attention/kv_int8.cuh"
#include "attention/paged_decode.cuh"
#include "torch_bindings/bindings_common.h"

namespace sm70_bindings {
namespace {

// The KV cache views both ops take: k/v [num_blocks, Hkv, block_size, 256] int8 and their
// scales [num_blocks, Hkv, block_size] float32, with any strides (vLLM's hybrid page is not
// contiguous: attention/kv_int8.cuh), V sharing K's strides and V's scales K's scale
// strides. Rows must be 4-byte aligned (the kernels move codes as 4-byte words).
void check_kv_views(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k_scale,
                    const Tensor& v_scale) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == 256 && v_cache.sizes() == k_cache.sizes(),
              "caches must be [num_blocks, Hkv, block_size, 256] views");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "cache rows must be contiguous and V must share K's strides");
  TORCH_CHECK(k_scale.dim() == 3 && k_scale.size(0) == k_cache.size(0) &&
                  k_scale.size(1) == k_cache.size(1) && k_scale.size(2) == k_cache.size(2) &&
                  v_scale.sizes() == k_scale.sizes() && v_scale.strides() == k_scale.strides(),
              "scales must be [num_blocks, Hkv, block_size] views with one set of strides");
  auto aligned4 = [](const Tensor& t) {
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 != 0) return false;
    for (int d = 0; d < t.dim() - 1; ++d)
      if (t.stride(d) % 4 != 0) return false;
    return true;
  };
  TORCH_CHECK(aligned4(k_cache) && aligned4(v_cache),
              "cache rows must start 4-byte aligned (base and strides multiples of 4 bytes)");
}

bool aligned16(const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < t.dim() - 1; ++d)
    if (t.stride(d) % 16 != 0) return false;
  return true;
}

void kv_int8_write(const Tensor& key, const Tensor& value, Tensor& k_cache, Tensor& v_cache,
                   Tensor& k_scale, Tensor& v_scale, const Tensor& slot_mapping) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&key, &value, &k_cache, &v_cache,
                                                              &k_scale, &v_scale, &slot_mapping})
    SM70_CHECK_CUDA(*t);
  SM70_CHECK_DTYPE(key, at::kHalf);
  SM70_CHECK_DTYPE(value, at::kHalf);
  SM70_CHECK_DTYPE(k_cache, at::kChar);
  SM70_CHECK_DTYPE(v_cache, at::kChar);
  SM70_CHECK_DTYPE(k_scale, at::kFloat);
  SM70_CHECK_DTYPE(v_scale, at::kFloat);
  SM70_CHECK_DTYPE(slot_mapping, at::kLong);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [T, H, D]");
  TORCH_CHECK(key.size(2) == 256, "head_dim must be 256");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == 256 && value.stride(2) == 1 &&
                  value.stride(1) == 256,
              "key/value heads must be contiguous (token stride may differ)");
  check_kv_views(k_cache, v_cache, k_scale, v_scale);
  TORCH_CHECK(k_cache.size(1) == key.size(1), "caches must have key's " +
                                                  std::to_string(key.size(1)) + " heads");
  TORCH_CHECK(slot_mapping.numel() >= key.size(0), "slot_mapping shorter than key");
  const c10::cuda::CUDAGuard guard(key.device());
  const sm70::KvCacheStrides st{k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
                                k_scale.stride(0), k_scale.stride(2), k_scale.stride(1)};
  sm70::launch_kv_int8_write<256>(
      hptr(key), hptr(value), key.stride(0), value.stride(0), k_cache.data_ptr<int8_t>(),
      v_cache.data_ptr<int8_t>(), k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), st,
      slot_mapping.data_ptr<int64_t>(), (int)key.size(0), (int)key.size(1),
      (int)k_cache.size(2), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Arch>
void launch_decode(const sm70::PagedDecodeParams& p, int q_per_seq, int batch,
                   cudaStream_t stream) {
  switch (q_per_seq) {
    case 1: sm70::launch_paged_decode<6, 1, Arch>(p, batch, stream); break;
    case 2: sm70::launch_paged_decode<6, 2, Arch>(p, batch, stream); break;
    case 3: sm70::launch_paged_decode<6, 3, Arch>(p, batch, stream); break;
    default: sm70::launch_paged_decode<6, 4, Arch>(p, batch, stream); break;
  }
}

Tensor paged_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                    const Tensor& k_scale, const Tensor& v_scale, const Tensor& block_tables,
                    const Tensor& seq_lens, int64_t q_per_seq, double sm_scale,
                    int64_t num_splits) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q, &k_cache, &v_cache, &k_scale,
                                                              &v_scale, &block_tables, &seq_lens})
    SM70_CHECK_CUDA(*t);
  SM70_CHECK_DTYPE(q, at::kHalf);
  SM70_CHECK_DTYPE(k_cache, at::kChar);
  SM70_CHECK_DTYPE(v_cache, at::kChar);
  SM70_CHECK_DTYPE(k_scale, at::kFloat);
  SM70_CHECK_DTYPE(v_scale, at::kFloat);
  SM70_CHECK_DTYPE(block_tables, at::kInt);
  SM70_CHECK_DTYPE(seq_lens, at::kInt);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 256 && q.stride(2) == 1 && q.stride(1) == 256,
              "q must be [tokens, Hq, 256] with contiguous heads");
  check_kv_views(k_cache, v_cache, k_scale, v_scale);
  const int64_t hkv = k_cache.size(1);
  const int64_t hq = q.size(1);
  TORCH_CHECK(hq == hkv * 6, "GQA 6:1 expected: Hq = " + std::to_string(hq) +
                                 ", Hkv = " + std::to_string(hkv));
  TORCH_CHECK(q_per_seq >= 1 && q_per_seq <= 4,
              "q_per_seq must be 1..4, got " + std::to_string(q_per_seq));
  TORCH_CHECK(q.size(0) % q_per_seq == 0, "q tokens must be a multiple of q_per_seq");
  const int64_t batch = q.size(0) / q_per_seq;
  TORCH_CHECK(seq_lens.numel() == batch && block_tables.dim() == 2 &&
                  block_tables.size(0) == batch && block_tables.stride(1) == 1,
              "seq_lens [B] and block_tables [B, max_blocks] must match the batch " +
                  std::to_string(batch));
  TORCH_CHECK(num_splits >= 1 && num_splits <= sm70::kPdMaxSplits,
              "num_splits must be 1.." + std::to_string(sm70::kPdMaxSplits));
  const c10::cuda::CUDAGuard guard(q.device());
  const bool sm80 = use_sm80_path(q.device().index());
  Tensor out = at::empty_like(q);
  if (batch == 0) return out;
  const int64_t rows = 6 * q_per_seq;
  Tensor part_o, part_ml, sched;
  sm70::PagedDecodeParams p{};
  // num_splits * batch slots per KV head, shared by the sequences in proportion to their
  // lengths (the kernel's schedule); sched: each sequence's slot range, for the reduce
  const int64_t slots = num_splits * batch;
  TORCH_CHECK(slots <= INT32_MAX, "num_splits x batch must be below 2^31, got " +
                                      std::to_string(num_splits) + " x " + std::to_string(batch));
  if (num_splits > 1) {
    part_o = at::empty({hkv, slots, rows, 256}, q.options());  // fp16
    part_ml = at::empty({hkv, slots, rows, 2}, q.options().dtype(at::kFloat));
    p.part_o = hptr_mut(part_o);
    p.part_ml = part_ml.data_ptr<float>();
    if (batch > 1) {
      sched = at::empty({batch, 2}, q.options().dtype(at::kInt));
      p.sched = sched.data_ptr<int>();
    }
  }
  p.q = hptr(q);
  p.k_cache = k_cache.data_ptr<int8_t>();
  p.v_cache = v_cache.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.kv_blk_stride = k_cache.stride(0);
  p.kv_tok_stride = k_cache.stride(2);
  p.kv_head_stride = k_cache.stride(1);
  p.sc_blk_stride = k_scale.stride(0);
  p.sc_tok_stride = k_scale.stride(2);
  p.sc_head_stride = k_scale.stride(1);
  p.vec16 = aligned16(k_cache) && aligned16(v_cache) ? 1 : 0;
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.out = hptr_mut(out);
  p.q_tok_stride = q.stride(0);
  p.out_tok_stride = out.stride(0);
  p.bt_stride = (int)block_tables.stride(0);
  p.num_kv_heads = (int)hkv;
  p.block_size = (int)k_cache.size(2);
  p.num_splits = (int)num_splits;
  p.batch = (int)batch;
  p.scale_log2 = (float)(sm_scale * 1.4426950408889634);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int bsz = (int)batch;
  if (sm80) {
    launch_decode<sm70::arch::Sm80>(p, (int)q_per_seq, bsz, stream);
  } else {
    launch_decode<sm70::arch::Sm70>(p, (int)q_per_seq, bsz, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Resident paged_decode blocks per SM for one query-row count and architecture tag:
// callers size num_splits so the grid is exactly one wave
// (vllm_patch.ops.reference.decode_num_splits).
template <int QN, class Arch>
int pd_blocks() {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, sm70::paged_decode_kernel<6, QN, Arch>, sm70::kPdWarps * 32, 0));
  return n;
}

template <class Arch>
int pd_blocks_for(int64_t q_per_seq) {
  switch (q_per_seq) {
    case 1: return pd_blocks<1, Arch>();
    case 2: return pd_blocks<2, Arch>();
    case 3: return pd_blocks<3, Arch>();
    default: return pd_blocks<4, Arch>();
  }
}

}  // namespace

int64_t paged_decode_blocks_per_sm(int64_t q_per_seq, int64_t device) {
  TORCH_CHECK(q_per_seq >= 1 && q_per_seq <= 4,
              "q_per_seq must be 1..4, got " + std::to_string(q_per_seq));
  int dev = (int)device;
  if (dev < 0) C10_CUDA_CHECK(cudaGetDevice(&dev));
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)dev);
  return use_sm80_path(dev) ? pd_blocks_for<sm70::arch::Sm80>(q_per_seq)
                            : pd_blocks_for<sm70::arch::Sm70>(q_per_seq);
}

}  // namespace sm70_bindings

TORCH_LIBRARY_IMPL(sm70, CUDA, m) {
  m.impl("kv_int8_write", &sm70_bindings::kv_int8_write);
  m.impl("paged_decode", &sm70_bindings::paged_decode);
}
