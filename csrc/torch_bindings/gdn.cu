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

namespace sm70_bindings {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

// A [rows, ...] tensor whose rows may be strided (vLLM's views into wider buffers) but
// whose last dimension is contiguous.
void check_rows(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.stride(1) == 1,
              std::string(name) + " must be [" + num(rows) + ", " + num(cols) +
                  "] with a contiguous last dimension");
}

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
  for (const Tensor* t : std::initializer_list<const Tensor*>{
           &qkv, &a, &b, &A_log, &dt_bias, &state, &query_start_loc, &state_indices})
    SM70_CHECK_CUDA(*t);
  SM70_CHECK_DTYPE(qkv, at::kHalf);
  SM70_CHECK_DTYPE(a, at::kHalf);
  SM70_CHECK_DTYPE(b, at::kHalf);
  SM70_CHECK_DTYPE(A_log, at::kFloat);
  SM70_CHECK_DTYPE(query_start_loc, at::kInt);
  SM70_CHECK_DTYPE(state_indices, at::kInt);
  TORCH_CHECK(dt_bias.scalar_type() == at::kFloat || dt_bias.scalar_type() == at::kHalf,
              "dt_bias must be float32 or float16");
  const bool int16 = state.scalar_type() == at::kShort;
  TORCH_CHECK(int16 || state.scalar_type() == at::kFloat,
              "state must be float32 or int16 (with state_scale)");
  TORCH_CHECK(state.dim() == 4, "state must be [slots, HV, 128, 128]");
  const int64_t hv = state.size(1);
  check_slots(state, "state", {hv, sm70::kGdnDv, sm70::kGdnDk});
  TORCH_CHECK(num_k_heads >= 1 && hv % num_k_heads == 0,
              "num_k_heads must divide the state's " + num(hv) + " value heads, got " +
                  num(num_k_heads));
  const int64_t T = qkv.size(0);
  check_rows(qkv, "qkv", T, 2 * num_k_heads * sm70::kGdnDk + hv * sm70::kGdnDv);
  check_rows(a, "a", T, hv);
  check_rows(b, "b", T, hv);
  TORCH_CHECK(A_log.dim() == 1 && A_log.numel() == hv && A_log.is_contiguous() &&
                  dt_bias.dim() == 1 && dt_bias.numel() == hv && dt_bias.is_contiguous(),
              "A_log and dt_bias must be contiguous [" + num(hv) + "]");
  // 8-byte loads of q/k and 16-byte (float32) or 8-byte (int16) loads of state rows
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qkv.data_ptr()) % 8 == 0 && qkv.stride(0) % 4 == 0,
              "qkv must be 8-byte aligned with a token stride that is a multiple of 4");
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
  const int64_t N = query_start_loc.numel() - 1;
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() && N >= 0,
              "query_start_loc must be a contiguous [N + 1]");
  TORCH_CHECK(N <= 65535, "at most 65535 sequences per call, got " + num(N));
  TORCH_CHECK((state_indices.dim() == 1 || state_indices.dim() == 2) &&
                  state_indices.size(0) == N &&
                  (state_indices.dim() == 1 || state_indices.stride(1) == 1),
              "state_indices must be [N] or [N, 1 + k] with N = " + num(N));
  const int64_t cols = state_indices.dim() == 2 ? state_indices.size(1) : 1;
  TORCH_CHECK(cols >= 1 && cols <= sm70::kGdnMaxCols,
              "state_indices must have 1.." + num(sm70::kGdnMaxCols) + " columns, got " +
                  num(cols));
  const int32_t* acc = nullptr;
  if (num_accepted.has_value()) {
    SM70_CHECK_CUDA(*num_accepted);
    SM70_CHECK_DTYPE(*num_accepted, at::kInt);
    TORCH_CHECK(num_accepted->dim() == 1 && num_accepted->numel() == N &&
                    num_accepted->is_contiguous(),
                "num_accepted must be a contiguous [N]");
    acc = num_accepted->data_ptr<int32_t>();
  }
  TORCH_CHECK(scale > 0, "scale must be positive");
  const c10::cuda::CUDAGuard guard(qkv.device());
  Tensor out = at::empty({T, hv, sm70::kGdnDv}, qkv.options());
  sm70::GdnRecurrentParams p{};
  p.qkv = hptr(qkv);
  p.qkv_stride = qkv.stride(0);
  p.a = hptr(a);
  p.a_stride = a.stride(0);
  p.b = hptr(b);
  p.b_stride = b.stride(0);
  p.A_log = A_log.data_ptr<float>();
  if (dt_bias.scalar_type() == at::kFloat) {
    p.dt_bias_f32 = dt_bias.data_ptr<float>();
  } else {
    p.dt_bias_f16 = hptr(dt_bias);
  }
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
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &conv_state, &weight,
                                                              &query_start_loc, &state_indices})
    SM70_CHECK_CUDA(*t);
  SM70_CHECK_DTYPE(x, at::kHalf);
  SM70_CHECK_DTYPE(conv_state, at::kHalf);
  SM70_CHECK_DTYPE(weight, at::kHalf);
  SM70_CHECK_DTYPE(query_start_loc, at::kInt);
  SM70_CHECK_DTYPE(state_indices, at::kInt);
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
  const int64_t N = query_start_loc.numel() - 1;
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() && N >= 0,
              "query_start_loc must be a contiguous [N + 1]");
  TORCH_CHECK(N <= 65535, "at most 65535 sequences per call, got " + num(N));
  TORCH_CHECK((state_indices.dim() == 1 || state_indices.dim() == 2) &&
                  state_indices.size(0) == N,
              "state_indices must be [N] or [N, 1 + k] with N = " + num(N));
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
  if (num_accepted.has_value()) {
    SM70_CHECK_CUDA(*num_accepted);
    SM70_CHECK_DTYPE(*num_accepted, at::kInt);
    TORCH_CHECK(num_accepted->dim() == 1 && num_accepted->numel() == state_indices.size(0) &&
                    num_accepted->is_contiguous(),
                "num_accepted must be a contiguous [N]");
    p.num_accepted = num_accepted->data_ptr<int32_t>();
  }
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
  if (has_initial_state.has_value()) {
    SM70_CHECK_CUDA(*has_initial_state);
    SM70_CHECK_DTYPE(*has_initial_state, at::kBool);
    TORCH_CHECK(has_initial_state->dim() == 1 &&
                    has_initial_state->numel() == state_indices.size(0) &&
                    has_initial_state->is_contiguous(),
                "has_initial_state must be a contiguous [N] bool");
    p.has_initial_state = has_initial_state->data_ptr<bool>();
  }
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
