// torch bindings of the chunked-prefill attention: torch.ops.sm70.fmha_prefill (the kernel
// of attention/fmha_prefill.cuh) and fmha_tc_peak (the tensor-core throughput loop its
// benchmark divides by). Checks the arguments, allocates the output, launches on the
// current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "attention/fmha_prefill.cuh"
#include "torch_bindings/bindings_common.h"

namespace sm70_bindings {
namespace {

// [T, H, 256] fp16 with unit dim stride and 16-byte aligned rows (the kernel reads 16 B).
void check_rows(const Tensor& t, const char* name, int64_t tokens) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == 256 && t.stride(2) == 1,
              std::string(name) + " must be [tokens, heads, 256] with unit dim stride");
  TORCH_CHECK(t.size(0) == tokens, std::string(name) + " must have " + std::to_string(tokens) +
                                       " tokens, got " + std::to_string(t.size(0)));
  TORCH_CHECK(t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0,
              std::string(name) + ": token and head strides must be multiples of 8 elements");
  check_aligned16(t, name);
}

// The cache base pointers: the kernel's narrowest context load is one 4-byte word.
void check_aligned4(const Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, name,
              " must be 4-byte aligned (the kernel's narrowest load)");
}

std::string strides_text(c10::IntArrayRef s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return "[" + out + "]";
}

Tensor fmha_prefill(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                    const Tensor& v_cache, const Tensor& k_scale, const Tensor& v_scale,
                    c10::IntArrayRef cache_strides, c10::IntArrayRef scale_strides,
                    const Tensor& block_table, const Tensor& query_start_loc,
                    const Tensor& ctx_lens, int64_t block_size, int64_t max_q_len,
                    double sm_scale) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{
           &q, &k, &v, &k_cache, &v_cache, &k_scale, &v_scale, &block_table, &query_start_loc,
           &ctx_lens})
    SM70_CHECK_CUDA(*t);
  SM70_CHECK_DTYPE(q, at::kHalf);
  SM70_CHECK_DTYPE(k, at::kHalf);
  SM70_CHECK_DTYPE(v, at::kHalf);
  SM70_CHECK_DTYPE(k_cache, at::kChar);
  SM70_CHECK_DTYPE(v_cache, at::kChar);
  SM70_CHECK_DTYPE(k_scale, at::kFloat);
  SM70_CHECK_DTYPE(v_scale, at::kFloat);
  SM70_CHECK_DTYPE(block_table, at::kInt);
  SM70_CHECK_DTYPE(query_start_loc, at::kInt);
  SM70_CHECK_DTYPE(ctx_lens, at::kInt);
  const int64_t tokens = q.size(0);
  check_rows(q, "q", tokens);
  check_rows(k, "k", tokens);
  check_rows(v, "v", tokens);
  const int64_t hq = q.size(1), hkv = k.size(1);
  TORCH_CHECK(v.size(1) == hkv, "k and v must have the same number of KV heads");
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0,
              "query heads must be a multiple of KV heads: Hq = " + std::to_string(hq) +
                  ", Hkv = " + std::to_string(hkv));
  TORCH_CHECK(cache_strides.size() == 3 && scale_strides.size() == 3,
              "cache_strides and scale_strides must be [block, token, head] (3 values each)");
  // the kernel's narrowest context load is one 4-byte word (TRITON_ATTN's 260-byte rows);
  // it picks 8- or 16-byte loads itself where bases and strides allow
  for (int64_t s : cache_strides)
    TORCH_CHECK(s >= 0 && s % 4 == 0,
                "cache_strides must be non-negative multiples of 4 bytes (4-byte loads), got " +
                    strides_text(cache_strides));
  for (int64_t s : scale_strides)
    TORCH_CHECK(s >= 0, "scale_strides must be non-negative, got " + strides_text(scale_strides));
  check_aligned4(k_cache, "k_cache");
  check_aligned4(v_cache, "v_cache");
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got " + std::to_string(block_size));
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() >= 1,
              "query_start_loc must be a contiguous [B + 1] int32 tensor");
  const int64_t batch = query_start_loc.numel() - 1;
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.is_contiguous() && ctx_lens.numel() == batch,
              "ctx_lens must be a contiguous [B] int32 tensor, B = " + std::to_string(batch));
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= batch &&
                  (block_table.size(1) <= 1 || block_table.stride(1) == 1),
              "block_table must be [B, max_blocks] int32 with unit column stride, B = " +
                  std::to_string(batch));
  TORCH_CHECK(max_q_len >= 0 && max_q_len <= tokens,
              "max_q_len must be 0..tokens (" + std::to_string(tokens) + "), got " +
                  std::to_string(max_q_len));
  TORCH_CHECK(max_q_len * (hq / hkv) <= INT32_MAX && tokens <= INT32_MAX,
              "max_q_len x group must fit 31 bits");
  TORCH_CHECK(batch <= 65535 && hkv <= 65535, "at most 65535 sequences and KV heads");
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor out = at::empty({tokens, hq, 256}, q.options());
  if (batch == 0 || tokens == 0 || max_q_len == 0) return out;
  sm70::FmhaPrefillParams p{};
  p.q = hptr(q);
  p.k = hptr(k);
  p.v = hptr(v);
  p.k_cache = k_cache.data_ptr<int8_t>();
  p.v_cache = v_cache.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.block_table = block_table.data_ptr<int>();
  p.query_start_loc = query_start_loc.data_ptr<int>();
  p.ctx_lens = ctx_lens.data_ptr<int>();
  p.out = hptr_mut(out);
  p.q_tok_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k_tok_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.v_tok_stride = v.stride(0);
  p.v_head_stride = v.stride(1);
  p.out_tok_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.cs_block = cache_strides[0];
  p.cs_token = cache_strides[1];
  p.cs_head = cache_strides[2];
  p.ss_block = scale_strides[0];
  p.ss_token = scale_strides[1];
  p.ss_head = scale_strides[2];
  p.bt_stride = (int)block_table.stride(0);
  p.block_size = (int)block_size;
  p.group = (int)(hq / hkv);
  p.scale_log2 = (float)(sm_scale * 1.4426950408889634);
  auto stream = c10::cuda::getCurrentCUDAStream();
  // arch::Sm80 (m16n8k16) on sm_80+ unless set_arch_path("sm70") asks for the Volta code
  const cudaError_t e =
      use_sm80_path(q.device().index())
          ? sm70::launch_fmha_prefill<sm70::arch::Sm80>(p, (int)batch, (int)hkv, (int)max_q_len,
                                                         stream)
          : sm70::launch_fmha_prefill<sm70::arch::Sm70>(p, (int)batch, (int)hkv, (int)max_q_len,
                                                         stream);
  C10_CUDA_CHECK(e);
  return out;
}

// out: a float32 CUDA buffer of blocks x 256 (one sum per thread); its size sets the grid.
void fmha_tc_peak(Tensor& out, int64_t iters, bool wide) {
  SM70_CHECK_CUDA(out);
  SM70_CHECK_DTYPE(out, at::kFloat);
  SM70_CHECK_CONTIG(out);
  const int64_t blocks = out.numel() / 256;
  TORCH_CHECK(out.numel() % 256 == 0 && blocks >= 1 && blocks <= (1 << 20),
              "out must hold blocks x 256 floats, blocks 1..2^20, got " +
                  std::to_string(out.numel()));
  TORCH_CHECK(iters >= 1 && iters <= INT32_MAX, "iters must be >= 1");
  const c10::cuda::CUDAGuard guard(out.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                        out.device().index()));
  TORCH_CHECK(!wide || major >= 8, "the m16n8k16 loop needs an sm_80+ GPU");
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (wide) {
    sm70::launch_fmha_tc_peak<true>(out.data_ptr<float>(), (int)blocks, (int)iters, stream);
  } else {
    sm70::launch_fmha_tc_peak<false>(out.data_ptr<float>(), (int)blocks, (int)iters, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

}  // namespace sm70_bindings

TORCH_LIBRARY_IMPL(sm70, CUDA, m) {
  m.impl("fmha_prefill", &sm70_bindings::fmha_prefill);
  m.impl("fmha_tc_peak", &sm70_bindings::fmha_tc_peak);
}
