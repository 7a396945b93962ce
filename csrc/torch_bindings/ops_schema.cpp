// The op schemas of torch.ops.sm70.* (the one TORCH_LIBRARY block), and the process-wide
// architecture path. The CUDA implementations are registered by one .cu per family
// (gemv.cu, gemm.cu, attention.cu); the ops without tensor arguments are bound here.
#include <torch/library.h>

#include <atomic>
#include <string>
#include <tuple>

#include "torch_bindings/bindings_common.h"

namespace sm70_bindings {
namespace {

// "native" (false): each device runs its own architecture's instantiations. "sm70" (true):
// the Volta m8n8k4 ones on any GPU, so a test GPU checks the code a V100 runs. Not for
// serving: vLLM never sets it.
std::atomic<bool> g_force_sm70{false};

void set_arch_path(std::string path) {
  TORCH_CHECK(path == "native" || path == "sm70",
              "set_arch_path: path must be \"native\" or \"sm70\", got \"" + path + "\"");
  g_force_sm70.store(path == "sm70");
}

std::string arch_path() { return g_force_sm70.load() ? "sm70" : "native"; }

}  // namespace

bool arch_path_forces_sm70() { return g_force_sm70.load(); }

// The two-GPU all-reduce's buffer registration (allreduce.cu): no CUDA tensor argument,
// so bound here rather than through a CUDA dispatch key.
std::tuple<int64_t, at::Tensor> allreduce_alloc(int64_t nbytes);
int64_t allreduce_open(const at::Tensor& handle);
void allreduce_release(int64_t ptr, bool opened);

}  // namespace sm70_bindings

TORCH_LIBRARY(sm70, m) {
  m.def("gptq_gemv(Tensor x, Tensor qw, Tensor sz, int group_size, Tensor? bias) -> Tensor");
  m.def(
      "kv_int8_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
      "Tensor block_tables, Tensor seq_lens, int q_per_seq, float sm_scale, int num_splits) "
      "-> Tensor");
  m.def("paged_decode_blocks_per_sm(int q_per_seq, int device=-1) -> int",
        &sm70_bindings::paged_decode_blocks_per_sm);
  // chunked-prefill attention (torch_bindings/fmha.cu, docs/kernels.md)
  m.def(
      "fmha_prefill(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
      "Tensor k_scale, Tensor v_scale, int[] cache_strides, int[] scale_strides, "
      "Tensor block_table, Tensor query_start_loc, Tensor ctx_lens, int block_size, "
      "int max_q_len, float sm_scale) -> Tensor");
  m.def("fmha_tc_peak(Tensor(a!) out, int iters, bool wide) -> ()");
  m.def(
      "int8_gemm_lowrank(Tensor x, Tensor qw, Tensor sz, int group_size, Tensor? bias, "
      "Tensor? a_t, Tensor? b_t, Tensor? row_mask) -> Tensor");
  m.def("gptq_dequant(Tensor qw, Tensor sz, int group_size, Tensor(a!) out) -> ()");
  m.def("set_arch_path(str path) -> ()", &sm70_bindings::set_arch_path);
  m.def("arch_path() -> str", &sm70_bindings::arch_path);
  // the two-GPU all-reduce (torch_bindings/allreduce.cu, docs/allreduce.md)
  m.def("allreduce_alloc(int nbytes) -> (int, Tensor)", &sm70_bindings::allreduce_alloc);
  m.def("allreduce_open(Tensor handle) -> int", &sm70_bindings::allreduce_open);
  m.def("allreduce_release(int ptr, bool opened) -> ()", &sm70_bindings::allreduce_release);
  m.def("allreduce_fp16(Tensor x, int mine, int peer, int buffer_bytes) -> Tensor");
  m.def("allreduce_int12(Tensor x, int mine, int peer, int buffer_bytes) -> Tensor");
  m.def("int12_pack(Tensor x) -> Tensor");
  m.def("int12_unpack(Tensor packed) -> Tensor");
  // Gated DeltaNet (torch_bindings/gdn.cu, docs/kernels.md#gated-deltanet)
  m.def(
      "gdn_recurrent_decode(Tensor qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, "
      "Tensor(a!) state, Tensor(b!)? state_scale, Tensor query_start_loc, "
      "Tensor state_indices, Tensor? num_accepted, int num_k_heads, float scale) -> Tensor");
  m.def(
      "gdn_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, "
      "Tensor query_start_loc, Tensor state_indices, Tensor? num_accepted, bool silu) -> Tensor");
  m.def(
      "gdn_conv1d_prefill(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, "
      "Tensor query_start_loc, Tensor state_indices, Tensor? has_initial_state, bool silu) "
      "-> Tensor");
  m.def(
      "gdn_chunk_prefill(Tensor qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, "
      "Tensor(a!) state, Tensor query_start_loc, Tensor state_indices, "
      "Tensor? has_initial_state, int num_k_heads, float scale) -> Tensor");
  m.def(
      "gdn_chunk_prefill_two_pass(Tensor qkv, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias, Tensor(a!) state, Tensor query_start_loc, Tensor state_indices, "
      "Tensor? has_initial_state, Tensor chunk_indices, int num_k_heads, float scale) "
      "-> Tensor");
}
