// What every Gated DeltaNet kernel reads before its state: the conv output qkv, the gate
// inputs a and b and the per-head gate parameters (the head of GdnRecurrentParams and
// GdnChunkParams), and the gating itself, as reference_gdn.gdn_gating defines it:
//   g = -exp(A_log) * softplus(a + dt_bias) (softplus(x) = x above 20),  beta = sigmoid(b).
#pragma once

#include "common/sm70.cuh"

namespace sm70 {

struct GdnInputs {
  const __half* qkv;  // [T, 2 H dk + HV dv], token stride qkv_stride (elements)
  int64_t qkv_stride;
  const __half* a;  // [T, HV], token stride a_stride
  int64_t a_stride;
  const __half* b;
  int64_t b_stride;
  const float* A_log;         // [HV]
  const float* dt_bias_f32;   // [HV], one of the two is set
  const __half* dt_bias_f16;  // [HV]
};

// -exp(A_log[hv]) and dt_bias[hv]: what the gate of value head hv needs besides a and b.
struct GdnHeadGate {
  float neg_a;
  float dt_bias;
};

__device__ __forceinline__ GdnHeadGate gdn_head_gate(const GdnInputs& p, int hv) {
  return {-expf(p.A_log[hv]),
          p.dt_bias_f32 ? p.dt_bias_f32[hv] : __half2float(p.dt_bias_f16[hv])};
}

// g and beta of token t, value head hv.
__device__ __forceinline__ void gdn_gate(const GdnInputs& p, const GdnHeadGate& hg, int64_t t,
                                         int hv, float& g, float& beta) {
  const float x = __half2float(p.a[t * p.a_stride + hv]) + hg.dt_bias;
  const float bx = __half2float(p.b[t * p.b_stride + hv]);
  const float softplus = x <= 20.f ? log1pf(expf(x)) : x;
  g = hg.neg_a * softplus;
  beta = 1.f / (1.f + expf(-bx));
}

}  // namespace sm70
