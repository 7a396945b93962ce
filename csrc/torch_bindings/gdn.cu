// torch bindings of the Gated DeltaNet family (issue 23): torch.ops.sm70.gdn_recurrent_decode,
// gdn_conv1d_update and gdn_conv1d_prefill. Checks the arguments, allocates the output and
// launches on the current stream. The kernels and their layouts are described in gdn/*.cuh;
// vllm_patch/ops/reference_gdn.py defines what they compute.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>

#include "gdn/conv1d.cuh"
#include "gdn/recurrent_decode.cuh"
#include "torch_bindings/bindings_common.h"
#include "torch_bindings/gdn_checks.h"

namespace sm70_bindings {
namespace {

// A per-slot state view [slots, ...inner] whose inner dimensions are contiguous (the slot
// stride is the page stride of vLLM's hybrid allocation).
void check_slots(const Tensor& t, const char* name, std::initializer_list<int64_t> inner) {
  TORCH_CHECK(t.dim() == (int64_t)inner.size() + 1, std::string(name) + " has the wrong rank");
  int64_t stride = 1;
  int64_t d = t.dim() - 1;
  for (auto it = std::rbegin(inner); it != std::rend(inner); ++it, --d) {
    TORCH_CHECK(t.size(d) == *it && (t.size(d) == 1 || t.stride(d) == stride),
                std::string(name) + " dimension " + num(d) + " must be " + num(*it) +
                    " and contiguous within a slot");
    stride *= *it;
  }
}

Tensor gdn_recurrent_decode(const Tensor& qkv, const Tensor& a, const Tensor& b,
                            const Tensor& A_log, const Tensor& dt_bias, Tensor& state,
                            const std::optional<Tensor>& state_scale,
                            const Tensor& query_start_loc, const Tensor& state_indices,
                            const std::optional<Tensor>& num_accepted, int64_t num_k_heads,
                            double scale) {
  SM70_CHECK_CUDA(state);
  const bool int16 = state.scalar_type() == at::kShort;
  TORCH_CHECK(int16 || state.scalar_type() == at::kFloat,
              "state must be float32 or int16 (with state_scale)");
  TORCH_CHECK(state.dim() == 4, "state must be [slots, HV, 128, 128]");
  const int64_t hv = state.size(1);
  check_slots(state, "state", {hv, sm70::kGdnDv, sm70::kGdnDk});
  const int64_t T = check_gdn_inputs(qkv, a, b, A_log, dt_bias, num_k_heads, hv, sm70::kGdnDk,
                                     sm70::kGdnDv, scale);
  // 16-byte (float32) or 8-byte (int16) loads of state rows
  check_aligned16(state, "state");
  TORCH_CHECK(state.stride(0) % 4 == 0, "state's slot stride must be a multiple of 4");
  float* scale_ptr = nullptr;
  int64_t scale_stride = 0;
  if (int16) {
    TORCH_CHECK(state_scale.has_value(), "an int16 state needs state_scale [slots, HV, 128]");
    SM70_CHECK_CUDA(*state_scale);
    SM70_CHECK_DTYPE(*state_scale, at::kFloat);
    TORCH_CHECK(state_scale->size(0) == state.size(0), "state_scale must have one row per slot");
    check_slots(*state_scale, "state_scale", {hv, sm70::kGdnDv});
    scale_ptr = const_cast<float*>(state_scale->data_ptr<float>());
    scale_stride = state_scale->stride(0);
  } else {
    TORCH_CHECK(!state_scale.has_value(), "state_scale is for an int16 state only");
  }
  const int64_t N = check_sequences(query_start_loc, state_indices, "[N, 1 + k]", true);
  const int64_t cols = state_indices.dim() == 2 ? state_indices.size(1) : 1;
  TORCH_CHECK(cols >= 1 && cols <= sm70::kGdnMaxCols,
              "state_indices must have 1.." + num(sm70::kGdnMaxCols) + " columns, got " +
                  num(cols));
  const int32_t* acc = optional_per_sequence<int32_t>(num_accepted, "num_accepted", N, at::kInt,
                                                      "a contiguous [N]");
  const c10::cuda::CUDAGuard guard(qkv.device());
  Tensor out = at::empty({T, hv, sm70::kGdnDv}, qkv.options());
  sm70::GdnRecurrentParams p{};
  fill_gdn_inputs(p, qkv, a, b, A_log, dt_bias);
  p.state = state.data_ptr();
  p.state_slot_stride = state.stride(0);
  p.state_scale = scale_ptr;
  p.scale_slot_stride = scale_stride;
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.state_indices = state_indices.data_ptr<int32_t>();
  // a column view such as vLLM's block_table[:, 0] keeps the table's row stride
  p.indices_stride = state_indices.stride(0);
  p.cols = (int)cols;
  p.num_accepted = acc;
  p.out = hptr_mut(out);
  p.num_k_heads = (int)num_k_heads;
  p.num_v_heads = (int)hv;
  p.scale = (float)scale;
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (int16) {
    sm70::launch_gdn_recurrent<short>(p, (int)N, stream);
  } else {
    sm70::launch_gdn_recurrent<float>(p, (int)N, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The arguments both conv ops share; fills everything in p but the mode's own pointer.
Tensor conv_prepare(const Tensor& x, Tensor& conv_state, const Tensor& weight,
                    const std::optional<Tensor>& bias, const Tensor& query_start_loc,
                    const Tensor& state_indices, bool silu, sm70::GdnConvParams& p) {
  check_cuda_dtype(x, "x", at::kHalf);
  check_cuda_dtype(conv_state, "conv_state", at::kHalf);
  check_cuda_dtype(weight, "weight", at::kHalf);
  const int64_t T = x.size(0), D = x.dim() == 2 ? x.size(1) : -1;
  check_rows(x, "x", T, D);
  TORCH_CHECK(D > 0 && D % 2 == 0, "x must have an even number of channels, got " + num(D));
  TORCH_CHECK(x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0,
              "x must be 4-byte aligned with an even token stride");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) == sm70::kConvWidth &&
                  weight.is_contiguous(),
              "weight must be a contiguous [" + num(D) + ", 4]");
  check_aligned16(weight, "weight");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) >= 3,
              "conv_state must be [slots, 3 + k, D] (vLLM's SD layout)");
  check_slots(conv_state, "conv_state", {conv_state.size(1), D});
  TORCH_CHECK(conv_state.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(conv_state.data_ptr()) % 4 == 0,
              "conv_state must be 4-byte aligned with an even slot stride");
  check_sequences(query_start_loc, state_indices, "[N, 1 + k]", false);
  p.bias = nullptr;
  if (bias.has_value()) {
    SM70_CHECK_CUDA(*bias);
    SM70_CHECK_DTYPE(*bias, at::kHalf);
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == D && bias->is_contiguous(),
                "bias must be a contiguous [" + num(D) + "]");
    p.bias = hptr(*bias);
  }
  Tensor out = at::empty({T, D}, x.options());
  p.x = hptr(x);
  p.x_stride = x.stride(0);
  p.out = hptr_mut(out);
  p.state = hptr_mut(conv_state);
  p.state_slot_stride = conv_state.stride(0);
  p.state_rows = (int)conv_state.size(1);
  p.weight = hptr(weight);
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.state_indices = state_indices.data_ptr<int32_t>();
  // a column view such as vLLM's block_table[:, 0] keeps the table's row stride
  p.indices_stride = state_indices.stride(0);
  p.dim = (int)D;
  p.silu = silu;
  return out;
}

Tensor gdn_conv1d_update(const Tensor& x, Tensor& conv_state, const Tensor& weight,
                         const std::optional<Tensor>& bias, const Tensor& query_start_loc,
                         const Tensor& state_indices, const std::optional<Tensor>& num_accepted,
                         bool silu) {
  const c10::cuda::CUDAGuard guard(x.device());
  sm70::GdnConvParams p{};
  Tensor out = conv_prepare(x, conv_state, weight, bias, query_start_loc, state_indices, silu, p);
  p.num_accepted = optional_per_sequence<int32_t>(num_accepted, "num_accepted",
                                                  state_indices.size(0), at::kInt,
                                                  "a contiguous [N]");
  sm70::launch_gdn_conv1d_update(p, (int)state_indices.size(0),
                                 c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

Tensor gdn_conv1d_prefill(const Tensor& x, Tensor& conv_state, const Tensor& weight,
                          const std::optional<Tensor>& bias, const Tensor& query_start_loc,
                          const Tensor& state_indices,
                          const std::optional<Tensor>& has_initial_state, bool silu) {
  const c10::cuda::CUDAGuard guard(x.device());
  sm70::GdnConvParams p{};
  Tensor out = conv_prepare(x, conv_state, weight, bias, query_start_loc, state_indices, silu, p);
  p.has_initial_state = optional_per_sequence<bool>(has_initial_state, "has_initial_state",
                                                    state_indices.size(0), at::kBool,
                                                    "a contiguous [N] bool");
  sm70::launch_gdn_conv1d_prefill(p, (int)state_indices.size(0), x.size(0),
                                  c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace sm70_bindings

TORCH_LIBRARY_IMPL(sm70, CUDA, m) {
  m.impl("gdn_recurrent_decode", &sm70_bindings::gdn_recurrent_decode);
  m.impl("gdn_conv1d_update", &sm70_bindings::gdn_conv1d_update);
  m.impl("gdn_conv1d_prefill", &sm70_bindings::gdn_conv1d_prefill);
}
