// torch bindings for the sm_70 kernels: registers torch.ops.sm70.*.
// The kernels live in csrc/kernels/*.cuh (pure CUDA, NVRTC-compatible); this file only
// checks arguments, allocates outputs and launches on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "gptq_gemv.cuh"
#include "int8_gemm_lowrank.cuh"
#include "kv_int8.cuh"
#include "paged_decode.cuh"

namespace {

using at::Tensor;

#define SM70_CHECK_CUDA(t) TORCH_CHECK((t).is_cuda(), #t " must be a CUDA tensor")
#define SM70_CHECK_CONTIG(t) TORCH_CHECK((t).is_contiguous(), #t " must be contiguous")
// Messages are built from strings only: streaming integers through c10::str crashed in
// the extension's ostream on the H200 image (torch 2.11), so numbers go through to_string.
#define SM70_CHECK_DTYPE(t, d)                                                 \
  TORCH_CHECK((t).scalar_type() == (d), #t " must be " + std::string(c10::toString(d)) + \
                                            ", got " + c10::toString((t).scalar_type()))

inline void check_aligned16(const Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned");
}

inline const __half* hptr(const Tensor& t) {
  return reinterpret_cast<const __half*>(t.data_ptr<at::Half>());
}
inline __half* hptr_mut(Tensor& t) { return reinterpret_cast<__half*>(t.data_ptr<at::Half>()); }

void check_packed_weight(const Tensor& qw, const Tensor& sz, int64_t K, int64_t group_size) {
  SM70_CHECK_CUDA(qw);
  SM70_CHECK_CUDA(sz);
  SM70_CHECK_CONTIG(qw);
  SM70_CHECK_CONTIG(sz);
  SM70_CHECK_DTYPE(qw, at::kByte);
  SM70_CHECK_DTYPE(sz, at::kHalf);
  TORCH_CHECK(qw.dim() == 2 && qw.size(1) == K, "qw must be [N, K] with K = " + std::to_string(K));
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0,
              "group_size must be a multiple of 16 dividing K (K=" + std::to_string(K) +
                  ", group_size=" + std::to_string(group_size) + ")");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == qw.size(0) && sz.size(1) == K / group_size &&
                  sz.size(2) == 2,
              "sz must be [N, K / group_size, 2] (scale, zero)");
}

// Stream-K GEMV workspace: one zero-filled int32 buffer per (device, stream), shared by
// every call on that stream (the kernels leave it zero again, so no memset per call).
// Buffers are never freed: a CUDA graph captured with one keeps using its address after
// the cache grows. Inside a graph capture with no big-enough buffer for the capturing
// stream (torch's usual pattern warms up on another stream), the new buffer's zero-fill
// is captured too, so it runs before every replay; such a buffer serves only that capture
// (another graph may replay first), and the next eager call makes a plain one again.
struct GemvWsKey {
  int device;
  int64_t stream;
  bool operator==(const GemvWsKey& o) const { return device == o.device && stream == o.stream; }
};
struct GemvWsHash {
  size_t operator()(const GemvWsKey& k) const {
    return std::hash<int64_t>()(k.stream) * 31u + std::hash<int>()(k.device);
  }
};
struct GemvWs {
  std::vector<Tensor> bufs;          // the last one is current
  unsigned long long capture_id = 0;  // nonzero: the current one was made in that capture
};

int* gemv_workspace(const c10::cuda::CUDAStream& stream, int64_t ints) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<GemvWsKey, GemvWs, GemvWsHash>();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream.stream(), &status, &capture));
  TORCH_CHECK(status != cudaStreamCaptureStatusInvalidated,
              "gptq_gemv: the stream's graph capture was invalidated");
  if (status == cudaStreamCaptureStatusNone) capture = 0;
  const std::lock_guard<std::mutex> lock(mu);
  GemvWs& ws = (*cache)[GemvWsKey{(int)stream.device_index(), (int64_t)stream.id()}];
  if (!ws.bufs.empty() && ws.bufs.back().numel() >= ints && ws.capture_id == 0)
    return ws.bufs.back().data_ptr<int>();
  if (!ws.bufs.empty() && ws.bufs.back().numel() >= ints && capture != 0 &&
      ws.capture_id == capture)
    return ws.bufs.back().data_ptr<int>();
  // eager: grow geometrically (few buffers kept); in a capture: exactly what it needs
  int64_t size = ints;
  if (capture == 0 && !ws.bufs.empty() && ws.capture_id == 0)
    size = std::max(ints, 2 * ws.bufs.back().numel());
  ws.bufs.push_back(at::zeros({size}, at::TensorOptions()
                                          .dtype(at::kInt)
                                          .device(at::kCUDA, stream.device_index())));
  ws.capture_id = capture;
  return ws.bufs.back().data_ptr<int>();
}

Tensor gptq_gemv(const Tensor& x, const Tensor& qw, const Tensor& sz, int64_t group_size,
                 const std::optional<Tensor>& bias, int64_t ksplit, int64_t kernel) {
  SM70_CHECK_CUDA(x);
  SM70_CHECK_CONTIG(x);
  SM70_CHECK_DTYPE(x, at::kHalf);
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "gptq_gemv takes 1 to 8 rows, got " + std::to_string(M));
  TORCH_CHECK(K > 0 && K % 16 == 0, "K must be a positive multiple of 16, got " + std::to_string(K));
  check_packed_weight(qw, sz, K, group_size);
  check_aligned16(x, "x");
  check_aligned16(qw, "qw");
  const __half* bp = nullptr;
  if (bias.has_value()) {
    SM70_CHECK_DTYPE(*bias, at::kHalf);
    SM70_CHECK_CONTIG(*bias);
    TORCH_CHECK(bias->numel() == N, "bias must have N = " + std::to_string(N) + " elements");
    bp = hptr(*bias);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty({M, N}, x.options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* q = qw.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const __half2*>(sz.data_ptr<at::Half>());
  const int n = (int)N, k = (int)K, g = (int)group_size;
  TORCH_CHECK(kernel >= 0 && kernel <= 13,
              "kernel must be 0 (auto), 1 (classic), 2 or 3 (streamed, M = 1), 4 or 5 "
              "(stream-K, M = 1), 6 or 7 (streamed, x in shared memory, M = 1), 8 or 9 "
              "(streamed, packed-half math, M = 1), 10 (tensor cores, the device's mma), 11 "
              "(tensor cores, m8n8k4), 12 (8 with a K-split tail, M = 1) or 13 (12 with 2 rows per "
              "warp, M = 1), got " +
                  std::to_string(kernel));
  // auto at M = 2..8 (MTP verification) is the tensor-core kernel where its K rules hold:
  // on the H200 its time is nearly flat in M (1.3-1.7x fp16 F.linear at M = 4) where the
  // classic kernel's M multiply-adds per byte made it slower than F.linear (0.5-0.8x).
  // Tiny N stays classic: at N = 48 (in_proj_ba) 4.1-4.9 us against 5.9 (a few blocks,
  // latency-bound); between 48 and 1024 rows nothing was measured.
  if (kernel == 0 && M >= 2 && N >= 1024 && sm70::gptq_gemv_tc_fits((int)K, (int)group_size))
    kernel = 10;
  const bool tc = kernel == 10 || kernel == 11;
  TORCH_CHECK(ksplit == 0 || ksplit == 1 || ksplit == 4 || (tc && (ksplit == 2 || ksplit == 8)),
              "ksplit must be 0 (auto), 1 or 4 (or 2 or 8 for kernels 10, 11), got " +
                  std::to_string(ksplit));
  TORCH_CHECK(!tc || sm70::gptq_gemv_tc_fits((int)K, (int)group_size),
              "kernels 10, 11 (tensor cores) need K and group_size multiples of 128, got K=" +
                  std::to_string(K) + ", group_size=" + std::to_string(group_size));
  TORCH_CHECK(kernel < 2 || tc || M == 1,
              "kernel " + std::to_string(kernel) + " (streamed / stream-K) takes M = 1 only, got M = " +
                  std::to_string(M));
  const int kn = (int)kernel;
  if (N == 0) return y;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index()));
  // Stream-K (kernels 4, 5; ksplit is ignored) only when asked for: on the H200 it was
  // slower than the streamed kernel on 8 of the 9 M = 1 shapes (docs/kernels.md); auto at
  // M = 1 is the streamed kernel with packed-half math, 2 rows per warp and a K-split tail
  // (kernel 13).
  const bool sk_fits = sm70::gptq_gemv_sk_fits(N, K);  // 32-bit row offsets
  TORCH_CHECK((kn != 4 && kn != 5) || sk_fits, "kernel " + std::to_string(kn) +
                                     " (stream-K) needs N * K < 2^32, got N=" +
                                     std::to_string(N) + ", K=" + std::to_string(K));
  if (tc) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                          x.device().index()));
    // 10: m16n8k16 where m8n8k4 is emulated (sm_80+), Volta's m8n8k4 where it is native
    const bool native = kn == 10 && major >= 8;
    sm70::launch_gptq_gemv_tc(native, hptr(x), q, s, bp, hptr_mut(y), (int)M, n, k, g, sms,
                              (int)ksplit, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
  }
  if (M == 1 && (kn == 4 || kn == 5)) {
    int* ws = gemv_workspace(stream, (int64_t)sm70::gptq_gemv_sk_workspace_ints(n));
    C10_CUDA_CHECK(sm70::launch_gptq_gemv_sk(kn == 5 ? 5 : 4, hptr(x), q, s, bp, hptr_mut(y), n,
                                             k, g, ws, x.device().index(), sms, stream));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
  }
  // ksplit 1 or 4 forces the mode (tuning): with 0 SMs no N is "too few warps" (mode 1);
  // the launcher reads a negative SM count as mode 4
  if (ksplit == 1) sms = 0;
  if (ksplit == 4) sms = -1;
  switch (M) {
    case 1: sm70::launch_gptq_gemv<1>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream, kn); break;
    case 2: sm70::launch_gptq_gemv<2>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream); break;
    case 3: sm70::launch_gptq_gemv<3>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream); break;
    case 4: sm70::launch_gptq_gemv<4>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream); break;
    case 5: sm70::launch_gptq_gemv<5>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream); break;
    case 6: sm70::launch_gptq_gemv<6>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream); break;
    case 7: sm70::launch_gptq_gemv<7>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream); break;
    default: sm70::launch_gptq_gemv<8>(hptr(x), q, s, bp, hptr_mut(y), n, k, g, sms, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

void kv_int8_write(const Tensor& key, const Tensor& value, Tensor& k_cache, Tensor& v_cache,
                   Tensor& k_scale, Tensor& v_scale, const Tensor& slot_mapping) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&key, &value, &k_cache, &v_cache, &k_scale, &v_scale, &slot_mapping})
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
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(1) == key.size(1) && k_cache.size(3) == 256,
              "caches must be [num_blocks, H, block_size, 256]");
  SM70_CHECK_CONTIG(k_cache);
  SM70_CHECK_CONTIG(v_cache);
  SM70_CHECK_CONTIG(k_scale);
  SM70_CHECK_CONTIG(v_scale);
  TORCH_CHECK(k_scale.numel() == k_cache.numel() / 256 && v_scale.numel() == k_scale.numel(),
              "scales must be [num_blocks, H, block_size]");
  TORCH_CHECK(slot_mapping.numel() >= key.size(0), "slot_mapping shorter than key");
  const c10::cuda::CUDAGuard guard(key.device());
  sm70::launch_kv_int8_write<256>(
      hptr(key), hptr(value), key.stride(0), value.stride(0), k_cache.data_ptr<int8_t>(),
      v_cache.data_ptr<int8_t>(), k_scale.data_ptr<float>(), v_scale.data_ptr<float>(),
      slot_mapping.data_ptr<int64_t>(), (int)key.size(0), (int)key.size(1),
      (int)k_cache.size(2), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Tensor paged_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                    const Tensor& k_scale, const Tensor& v_scale, const Tensor& block_tables,
                    const Tensor& seq_lens, int64_t q_per_seq, double sm_scale,
                    int64_t num_splits, int64_t mma) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q, &k_cache, &v_cache, &k_scale, &v_scale, &block_tables, &seq_lens})
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
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == 256 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [num_blocks, Hkv, block_size, 256]");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous(), "scales must be contiguous");
  // the kernel indexes cache rows (token x head, 256 bytes each) with 31-bit integers
  TORCH_CHECK(k_cache.numel() / 256 <= INT32_MAX,
              "the KV cache must hold at most 2^31 - 1 token-head rows (512 GiB per cache)");
  const int64_t hkv = k_cache.size(1);
  const int64_t hq = q.size(1);
  TORCH_CHECK(hq == hkv * 6, "GQA 6:1 expected: Hq = " + std::to_string(hq) + ", Hkv = " + std::to_string(hkv));
  TORCH_CHECK(q_per_seq >= 1 && q_per_seq <= 4, "q_per_seq must be 1..4, got " + std::to_string(q_per_seq));
  TORCH_CHECK(q.size(0) % q_per_seq == 0, "q tokens must be a multiple of q_per_seq");
  const int64_t batch = q.size(0) / q_per_seq;
  TORCH_CHECK(seq_lens.numel() == batch && block_tables.dim() == 2 &&
                  block_tables.size(0) == batch && block_tables.stride(1) == 1,
              "seq_lens [B] and block_tables [B, max_blocks] must match the batch " + std::to_string(batch));
  TORCH_CHECK(num_splits >= 1 && num_splits <= sm70::kPdMaxSplits, "num_splits must be 1.." + std::to_string(sm70::kPdMaxSplits));
  TORCH_CHECK(mma >= 0 && mma <= 2, "mma must be 0 (auto), 1 (m8n8k4) or 2 (m16n8k16)");
  const c10::cuda::CUDAGuard guard(q.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                        q.device().index()));
  TORCH_CHECK(mma != 2 || major >= 8, "mma=2 (m16n8k16) needs compute capability 8.0+");
  // auto: Volta's m8n8k4 where it is native, m16n8k16 where m8n8k4 is emulated
  const bool native = mma == 2 || (mma == 0 && major >= 8);
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
  switch (q_per_seq * 2 + (native ? 1 : 0)) {
    case 2: sm70::launch_paged_decode<6, 1, false>(p, bsz, stream); break;
    case 3: sm70::launch_paged_decode<6, 1, true>(p, bsz, stream); break;
    case 4: sm70::launch_paged_decode<6, 2, false>(p, bsz, stream); break;
    case 5: sm70::launch_paged_decode<6, 2, true>(p, bsz, stream); break;
    case 6: sm70::launch_paged_decode<6, 3, false>(p, bsz, stream); break;
    case 7: sm70::launch_paged_decode<6, 3, true>(p, bsz, stream); break;
    case 8: sm70::launch_paged_decode<6, 4, false>(p, bsz, stream); break;
    default: sm70::launch_paged_decode<6, 4, true>(p, bsz, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

Tensor int8_gemm_lowrank(const Tensor& x, const Tensor& qw, const Tensor& sz, int64_t group_size,
                         const std::optional<Tensor>& bias, const std::optional<Tensor>& a_t,
                         const std::optional<Tensor>& b_t,
                         const std::optional<Tensor>& row_mask) {
  SM70_CHECK_CUDA(x);
  SM70_CHECK_DTYPE(x, at::kHalf);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 8 == 0,
              "x must be [M, K] with unit column stride and a row stride multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got " + std::to_string(K));
  check_packed_weight(qw, sz, K, group_size);
  check_aligned16(x, "x");
  check_aligned16(qw, "qw");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rank = a_t.has_value() ? a_t->size(0) : 0;
  Tensor t;
  Tensor mask_u8;
  if (rank > 0) {
    TORCH_CHECK(b_t.has_value(), "b_t is required with a_t");
    SM70_CHECK_DTYPE(*a_t, at::kHalf);
    SM70_CHECK_DTYPE(*b_t, at::kHalf);
    SM70_CHECK_CONTIG(*a_t);
    SM70_CHECK_CONTIG(*b_t);
    TORCH_CHECK(a_t->dim() == 2 && a_t->size(1) == K, "a_t must be [rank, K]");
    TORCH_CHECK(b_t->dim() == 2 && b_t->size(0) == N && b_t->size(1) == rank,
                "b_t must be [N, rank]");
    TORCH_CHECK(rank <= 256 && rank % 8 == 0, "rank must be a multiple of 8 up to 256, got " + std::to_string(rank));
    if (row_mask.has_value()) {
      TORCH_CHECK(row_mask->numel() == M, "row_mask must have M = " + std::to_string(M) + " elements");
      mask_u8 = row_mask->to(at::kByte).contiguous();
    } else {
      mask_u8 = at::ones({M}, x.options().dtype(at::kByte));
    }
    t = at::empty({M, rank}, x.options());
    sm70::LowrankGemmParams p1{};
    p1.x = hptr(x);
    p1.wh = hptr(*a_t);
    p1.row_mask = mask_u8.data_ptr<uint8_t>();
    p1.y = hptr_mut(t);
    p1.ldx = x.stride(0);
    p1.ldy = rank;
    p1.M = (int)M;
    p1.N = (int)rank;
    p1.K = (int)K;
    p1.group_size = 1;
    sm70::launch_lowrank_gemm(p1, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  sm70::LowrankGemmParams p{};
  p.x = hptr(x);
  p.qw = qw.data_ptr<uint8_t>();
  p.sz = reinterpret_cast<const __half2*>(sz.data_ptr<at::Half>());
  if (rank > 0) {
    p.x2 = hptr(t);
    p.w2 = hptr(*b_t);
    p.ldx2 = rank;
    p.K2 = (int)rank;
  }
  if (bias.has_value()) {
    SM70_CHECK_DTYPE(*bias, at::kHalf);
    SM70_CHECK_CONTIG(*bias);
    TORCH_CHECK(bias->numel() == N, "bias must have N elements");
    p.bias = hptr(*bias);
  }
  p.y = hptr_mut(y);
  p.ldx = x.stride(0);
  p.ldy = N;
  p.M = (int)M;
  p.N = (int)N;
  p.K = (int)K;
  p.group_size = (int)group_size;
  sm70::launch_lowrank_gemm(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// Resident paged_decode blocks per SM for one query-row count and MMA path: callers size
// num_splits so the grid is exactly one wave (sm70ctl.kernels.reference.decode_num_splits).
template <int QN>
int pd_blocks(bool native) {
  int n = 0;
  if (native) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, sm70::paged_decode_kernel<6, QN, true>, sm70::kPdWarps * 32, 0));
  } else {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, sm70::paged_decode_kernel<6, QN, false>, sm70::kPdWarps * 32, 0));
  }
  return n;
}

int64_t paged_decode_blocks_per_sm(int64_t q_per_seq, int64_t mma, int64_t device) {
  TORCH_CHECK(q_per_seq >= 1 && q_per_seq <= 4, "q_per_seq must be 1..4, got " + std::to_string(q_per_seq));
  TORCH_CHECK(mma >= 0 && mma <= 2, "mma must be 0 (auto), 1 (m8n8k4) or 2 (m16n8k16)");
  int dev = (int)device;
  if (dev < 0) C10_CUDA_CHECK(cudaGetDevice(&dev));
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)dev);
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  const bool native = mma == 2 || (mma == 0 && major >= 8);
  switch (q_per_seq) {
    case 1: return pd_blocks<1>(native);
    case 2: return pd_blocks<2>(native);
    case 3: return pd_blocks<3>(native);
    default: return pd_blocks<4>(native);
  }
}

}  // namespace

TORCH_LIBRARY(sm70, m) {
  m.def(
      "gptq_gemv(Tensor x, Tensor qw, Tensor sz, int group_size, Tensor? bias, int ksplit=0, "
      "int kernel=0) -> Tensor");
  m.def(
      "kv_int8_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
      "Tensor block_tables, Tensor seq_lens, int q_per_seq, float sm_scale, int num_splits, "
      "int mma=0) -> Tensor");
  m.def("paged_decode_blocks_per_sm(int q_per_seq, int mma=0, int device=-1) -> int",
        &paged_decode_blocks_per_sm);
  m.def(
      "int8_gemm_lowrank(Tensor x, Tensor qw, Tensor sz, int group_size, Tensor? bias, "
      "Tensor? a_t, Tensor? b_t, Tensor? row_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(sm70, CUDA, m) {
  m.impl("gptq_gemv", &gptq_gemv);
  m.impl("kv_int8_write", &kv_int8_write);
  m.impl("paged_decode", &paged_decode);
  m.impl("int8_gemm_lowrank", &int8_gemm_lowrank);
}
