// torch bindings of the Gated DeltaNet chunked prefill (issue 23): torch.ops.sm70.
// gdn_chunk_prefill (gdn/chunk_prefill.cuh, one pass) and gdn_chunk_prefill_two_pass
// (gdn/chunk_two_pass.cuh: the same result, the chunk-parallel work apart). Checks the
// arguments (gdn_checks.h), allocates the output and launches on the current stream;
// vllm_patch/ops/reference_gdn.py (gdn_prefill_reference) defines what it computes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "gdn/chunk_prefill.cuh"
#include "gdn/chunk_two_pass.cuh"
#include "torch_bindings/bindings_common.h"
#include "torch_bindings/gdn_checks.h"

namespace sm70_bindings {
namespace {

// The arguments both prefill ops share: checks them, fills p, returns the output (zeros).
Tensor chunk_prepare(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                     const Tensor& dt_bias, Tensor& state, const Tensor& query_start_loc,
                     const Tensor& state_indices, const std::optional<Tensor>& has_initial_state,
                     int64_t num_k_heads, double scale, sm70::GdnChunkParams& p) {
  check_cuda_dtype(state, "state", at::kFloat);
  TORCH_CHECK(state.dim() == 4 && state.size(2) == sm70::kGcDv && state.size(3) == sm70::kGcDk,
              "state must be [slots, HV, 128, 128]");
  const int64_t hv = state.size(1);
  TORCH_CHECK(state.stride(3) == 1 && state.stride(2) == sm70::kGcDk &&
                  (hv == 1 || state.stride(1) == sm70::kGcDv * sm70::kGcDk),
              "state must be contiguous within a slot (any slot stride)");
  const int64_t T = check_gdn_inputs(qkv, a, b, A_log, dt_bias, num_k_heads, hv, sm70::kGcDk,
                                     sm70::kGcDv, scale);
  const int64_t N = check_sequences(query_start_loc, state_indices, "[N, S]", false);
  const bool* init = optional_per_sequence<bool>(has_initial_state, "has_initial_state", N,
                                                 at::kBool, "a contiguous [N] bool");
  // rows outside every sequence stay zero, as the reference leaves them
  Tensor out = at::zeros({T, hv, sm70::kGcDv}, qkv.options());
  p = sm70::GdnChunkParams{};
  fill_gdn_inputs(p, qkv, a, b, A_log, dt_bias);
  p.state = state.data_ptr<float>();
  p.state_slot_stride = state.stride(0);
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.state_indices = state_indices.data_ptr<int32_t>();
  // a column view such as vLLM's block_table[:, 0] keeps the table's row stride
  p.indices_stride = state_indices.stride(0);
  p.has_initial_state = init;
  p.out = hptr_mut(out);
  p.num_k_heads = (int)num_k_heads;
  p.num_v_heads = (int)hv;
  p.scale = (float)scale;
  return out;
}

Tensor gdn_chunk_prefill(const Tensor& qkv, const Tensor& a, const Tensor& b,
                         const Tensor& A_log, const Tensor& dt_bias, Tensor& state,
                         const Tensor& query_start_loc, const Tensor& state_indices,
                         const std::optional<Tensor>& has_initial_state, int64_t num_k_heads,
                         double scale) {
  const c10::cuda::CUDAGuard guard(qkv.device());
  sm70::GdnChunkParams p{};
  Tensor out = chunk_prepare(qkv, a, b, A_log, dt_bias, state, query_start_loc, state_indices,
                             has_initial_state, num_k_heads, scale, p);
  const int N = (int)(query_start_loc.numel() - 1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  // arch::Sm80 (m16n8k16) on sm_80+ unless set_arch_path("sm70") asks for the Volta code
  const cudaError_t e = use_sm80_path(qkv.device().index())
                            ? sm70::launch_gdn_chunk_prefill<sm70::arch::Sm80>(p, N, stream)
                            : sm70::launch_gdn_chunk_prefill<sm70::arch::Sm70>(p, N, stream);
  C10_CUDA_CHECK(e);
  return out;
}

// chunk_indices [NT, 2] int32: (sequence, chunk within it) for every chunk, as vLLM's GDN
// metadata holds it for FLA (prepare_chunk_indices with chunk 64); the kernel skips a row
// whose chunk starts past its sequence's end.
Tensor gdn_chunk_prefill_two_pass(const Tensor& qkv, const Tensor& a, const Tensor& b,
                                  const Tensor& A_log, const Tensor& dt_bias, Tensor& state,
                                  const Tensor& query_start_loc, const Tensor& state_indices,
                                  const std::optional<Tensor>& has_initial_state,
                                  const Tensor& chunk_indices, int64_t num_k_heads,
                                  double scale) {
  const c10::cuda::CUDAGuard guard(qkv.device());
  sm70::GdnChunkParams p{};
  Tensor out = chunk_prepare(qkv, a, b, A_log, dt_bias, state, query_start_loc, state_indices,
                             has_initial_state, num_k_heads, scale, p);
  check_cuda_dtype(chunk_indices, "chunk_indices", at::kInt);
  TORCH_CHECK(chunk_indices.dim() == 2 && chunk_indices.size(1) == 2 &&
                  chunk_indices.is_contiguous(),
              "chunk_indices must be a contiguous [NT, 2] (sequence, chunk)");
  const int64_t nt = chunk_indices.size(0);
  TORCH_CHECK(nt <= INT32_MAX, "too many chunks: " + num(nt));
  const int64_t T = qkv.size(0);
  const int64_t hv = state.size(1);
  auto half = qkv.options();
  Tensor w = at::empty({T, hv, sm70::kGcDv}, half);
  Tensor u = at::empty({T, hv, sm70::kGcDv}, half);
  Tensor pm = at::empty({T, hv, sm70::kGcChunk}, half);
  Tensor gc = at::empty({T, hv}, qkv.options().dtype(at::kFloat));
  sm70::GdnTwoPassScratch sc{};
  sc.chunk_indices = chunk_indices.data_ptr<int32_t>();
  sc.w = hptr_mut(w);
  sc.u = hptr_mut(u);
  sc.pm = hptr_mut(pm);
  sc.gc = gc.data_ptr<float>();
  const int N = (int)(query_start_loc.numel() - 1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t e =
      use_sm80_path(qkv.device().index())
          ? sm70::launch_gdn_chunk_two_pass<sm70::arch::Sm80>(p, sc, (int)nt, N, stream)
          : sm70::launch_gdn_chunk_two_pass<sm70::arch::Sm70>(p, sc, (int)nt, N, stream);
  C10_CUDA_CHECK(e);
  return out;
}

}  // namespace
}  // namespace sm70_bindings

TORCH_LIBRARY_IMPL(sm70, CUDA, m) {
  m.impl("gdn_chunk_prefill", &sm70_bindings::gdn_chunk_prefill);
  m.impl("gdn_chunk_prefill_two_pass", &sm70_bindings::gdn_chunk_prefill_two_pass);
}
