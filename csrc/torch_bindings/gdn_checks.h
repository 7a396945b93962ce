// The argument checks the Gated DeltaNet bindings share (gdn.cu: recurrent decode and conv;
// gdn_chunk.cu: both chunked prefills): the conv output and gates every GDN kernel reads
// (sm70::GdnInputs), the sequence table, and the optional per-sequence vectors. Each check
// fails with a message naming the argument and the rule. CUDA translation units only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

#include "gdn/inputs.cuh"
#include "torch_bindings/bindings_common.h"

namespace sm70_bindings {

inline std::string num(int64_t v) { return std::to_string(v); }

inline void check_cuda_dtype(const Tensor& t, const char* name, at::ScalarType d) {
  TORCH_CHECK(t.is_cuda(), std::string(name) + " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == d, std::string(name) + " must be " + c10::toString(d) +
                                        ", got " + c10::toString(t.scalar_type()));
}

// A [rows, cols] tensor whose rows may be strided (vLLM's views into wider buffers) but
// whose last dimension is contiguous.
inline void check_rows(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.stride(1) == 1,
              std::string(name) + " must be [" + num(rows) + ", " + num(cols) +
                  "] with a contiguous last dimension");
}

// qkv [T, 2 H dk + HV dv] and a, b [T, HV] fp16, A_log [HV] float32 and dt_bias [HV]
// (float32 or fp16) for num_k_heads key heads and hv value heads of dk / dv, and scale;
// returns T. The kernels load q, k (and v) 8 bytes at a time.
inline int64_t check_gdn_inputs(const Tensor& qkv, const Tensor& a, const Tensor& b,
                                const Tensor& A_log, const Tensor& dt_bias,
                                int64_t num_k_heads, int64_t hv, int64_t dk, int64_t dv,
                                double scale) {
  check_cuda_dtype(qkv, "qkv", at::kHalf);
  check_cuda_dtype(a, "a", at::kHalf);
  check_cuda_dtype(b, "b", at::kHalf);
  check_cuda_dtype(A_log, "A_log", at::kFloat);
  TORCH_CHECK(dt_bias.is_cuda(), "dt_bias must be a CUDA tensor");
  TORCH_CHECK(dt_bias.scalar_type() == at::kFloat || dt_bias.scalar_type() == at::kHalf,
              "dt_bias must be float32 or float16");
  TORCH_CHECK(num_k_heads >= 1 && hv % num_k_heads == 0,
              "num_k_heads must divide the state's " + num(hv) + " value heads, got " +
                  num(num_k_heads));
  const int64_t T = qkv.size(0);
  check_rows(qkv, "qkv", T, 2 * num_k_heads * dk + hv * dv);
  check_rows(a, "a", T, hv);
  check_rows(b, "b", T, hv);
  TORCH_CHECK(A_log.dim() == 1 && A_log.numel() == hv && A_log.is_contiguous() &&
                  dt_bias.dim() == 1 && dt_bias.numel() == hv && dt_bias.is_contiguous(),
              "A_log and dt_bias must be contiguous [" + num(hv) + "]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qkv.data_ptr()) % 8 == 0 && qkv.stride(0) % 4 == 0,
              "qkv must be 8-byte aligned with a token stride that is a multiple of 4");
  TORCH_CHECK(scale > 0, "scale must be positive");
  return T;
}

inline void fill_gdn_inputs(sm70::GdnInputs& p, const Tensor& qkv, const Tensor& a,
                            const Tensor& b, const Tensor& A_log, const Tensor& dt_bias) {
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
}

// query_start_loc [N + 1] and state_indices [N] or [N, cols] int32; returns N. shape names
// the 2-d form in the message ("[N, 1 + k]"); every_column: the kernel reads all columns
// (so they must be contiguous), not only column 0.
inline int64_t check_sequences(const Tensor& query_start_loc, const Tensor& state_indices,
                               const char* shape, bool every_column) {
  check_cuda_dtype(query_start_loc, "query_start_loc", at::kInt);
  check_cuda_dtype(state_indices, "state_indices", at::kInt);
  const int64_t N = query_start_loc.numel() - 1;
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() && N >= 0,
              "query_start_loc must be a contiguous [N + 1]");
  TORCH_CHECK(N <= 65535, "at most 65535 sequences per call, got " + num(N));
  TORCH_CHECK((state_indices.dim() == 1 || state_indices.dim() == 2) &&
                  state_indices.size(0) == N &&
                  (!every_column || state_indices.dim() == 1 || state_indices.stride(1) == 1),
              "state_indices must be [N] or " + std::string(shape) + " with N = " + num(N));
  return N;
}

// An optional contiguous [n] vector of dtype d (num_accepted int32, has_initial_state bool):
// its data, or null without it; rule is the shape part of the message.
template <class T>
const T* optional_per_sequence(const std::optional<Tensor>& t, const char* name, int64_t n,
                               at::ScalarType d, const char* rule) {
  if (!t.has_value()) return nullptr;
  check_cuda_dtype(*t, name, d);
  TORCH_CHECK(t->dim() == 1 && t->numel() == n && t->is_contiguous(),
              std::string(name) + " must be " + rule);
  return t->data_ptr<T>();
}

}  // namespace sm70_bindings
