"""Every kernel instantiation the torch extension launches, with its launch shape.

The NVRTC check (tests/test_kernels_compile.py) compiles exactly these instantiations (the
Volta ones for sm_70, the H200 timing ones for sm_90) and pins their resources
(tests/data/kernel_resources.json, made by sm70ctl.kernels.resources); the launchers in
csrc/ use the same block sizes and no dynamic shared memory: keep the two in step when an
instantiation is added. Headers are named relative to csrc/.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelVariant:
    header: str  # file under csrc/, e.g. "gemv/gptq_gemv.cuh"
    expr: str  # C++ name expression that instantiates the kernel
    threads: int  # threads per block used by the launcher
    dynamic_smem: int = 0  # bytes of dynamic shared memory the launcher requests

    @property
    def label(self) -> str:
        return self.expr.replace("sm70::", "")


def gemv_rows(m: int) -> int:
    """Rows per warp of the classic M-row GEMV (mirrors GemvRows<M> in gemv/classic.cuh)."""
    return 4 if m <= 4 else 2


GEMV = "gemv/gptq_gemv.cuh"
DECODE = "attention/paged_decode.cuh"
ALLREDUCE = "allreduce/two_gpu.cuh"
GDN_DECODE = "gdn/recurrent_decode.cuh"
FMHA = "attention/fmha_prefill.cuh"
FMHA_SMEM = 90880  # kFmSmemBytes in attention/fmha_prefill.cuh (arch::Sm70)
FMHA_SMEM_H200 = 95232  # kFm16SmemBytes (arch::Sm80: its own pitches, V transposed)
GDN_CHUNK = "gdn/chunk_prefill.cuh"
GDN_CHUNK_SMEM = 88320  # kGcSmemBytes in gdn/chunk_prefill.cuh (both tags)
GDN_TWO_PASS = "gdn/chunk_two_pass.cuh"
GDN_WY_SMEM = 87040  # kG2WySmemBytes in gdn/chunk_two_pass.cuh (pass 1)
GDN_STATE_SMEM = 78848  # kG2StateSmemBytes (pass 2)
GQA_GROUP = 6  # Qwen3.8-27B: 24 query heads over 4 KV heads
MAX_QUERY_ROWS = 4  # 1 + MTP k=3
VOLTA = "sm70::arch::Sm70"  # the architecture tag a V100 runs (csrc/common/arch.cuh)
H200 = "sm70::arch::Sm80"  # the m16n8k16 tag of the sm_80+ test GPU

VARIANTS: tuple[KernelVariant, ...] = (
    # M = 1 (decode): streamed, packed-half math, 2 rows per warp
    KernelVariant(GEMV, "sm70::gptq_gemv_stream_kernel<2>", 128),
    # M = 2..8 (MTP verification): the tensor-core kernel, 4 or 8 warps per row tile
    *(KernelVariant(GEMV, f"sm70::gptq_gemv_tc_kernel<{VOLTA}, {w}, 1>", 32 * w) for w in (4, 8)),
    # M = 2..8 where the tensor-core kernel's K rules do not hold, or N is small
    *(
        KernelVariant(GEMV, f"sm70::gptq_gemv_kernel<{m}, {gemv_rows(m)}>", 128)
        for m in range(2, 9)
    ),
    KernelVariant("attention/kv_int8.cuh", "sm70::kv_int8_write_kernel<256>", 128),
    # batch 1 (or one split per sequence), and batches sharing their chunks by length
    *(
        KernelVariant(DECODE, f"sm70::paged_decode_kernel<{GQA_GROUP}, {qn}, {VOLTA}, {b}>", 128)
        for b in ("false", "true")
        for qn in range(1, MAX_QUERY_ROWS + 1)
    ),
    *(
        KernelVariant(DECODE, f"sm70::paged_decode_reduce_kernel<{GQA_GROUP}, {qn}, {b}>", 256)
        for b in ("false", "true")
        for qn in range(1, MAX_QUERY_ROWS + 1)
    ),
    KernelVariant("gemm/int8_gemm_lowrank.cuh", "sm70::lowrank_gemm_kernel", 128),
    # prefill-sized M on cuBLAS: the weights' fp16 copy, one slice at a time
    KernelVariant("gemm/gptq_dequant.cuh", "sm70::gptq_dequant_kernel", 256),
    # the two-GPU all-reduce (fixed grid of 32 blocks) and the single-GPU 12-bit pack/unpack
    *(KernelVariant(ALLREDUCE, f"sm70::allreduce_{m}_kernel", 512) for m in ("fp16", "int12")),
    *(KernelVariant("allreduce/int12.cuh", f"sm70::int12_{op}_kernel", 256)
      for op in ("pack", "unpack")),
    # Gated DeltaNet recurrent decode (1 + k tokens per sequence), float32 or int16 state
    *(KernelVariant(GDN_DECODE, f"sm70::gdn_recurrent_kernel<{s}>", 128)
      for s in ("float", "short")),
    # its causal conv1d (width 4): the decode-side update and the varlen prefill
    *(KernelVariant("gdn/conv1d.cuh", f"sm70::gdn_conv1d_{m}_kernel", 128)
      for m in ("update", "prefill")),
    # chunked-prefill attention (8 warps, dynamic shared memory: kFmSmemBytes) and the
    # tensor-core ceiling loop its benchmark divides by
    KernelVariant(FMHA, f"sm70::fmha_prefill_kernel<{VOLTA}>", 256, FMHA_SMEM),
    KernelVariant(FMHA, "sm70::fmha_tc_peak_kernel<false>", 256),
    # Gated DeltaNet chunked prefill (8 warps, dynamic shared memory: kGcSmemBytes)
    KernelVariant(GDN_CHUNK, f"sm70::gdn_chunk_prefill_kernel<{VOLTA}>", 256, GDN_CHUNK_SMEM),
    # its two-pass form: the chunk-parallel pass and the state pass
    KernelVariant(GDN_TWO_PASS, f"sm70::gdn_chunk_wy_kernel<{VOLTA}>", 256, GDN_WY_SMEM),
    KernelVariant(GDN_TWO_PASS, f"sm70::gdn_chunk_state_kernel<{VOLTA}>", 256, GDN_STATE_SMEM),
)

# The H200 timing instantiations (m16n8k16), compiled for sm_90 by the resource report: the
# tensor-core GEMV's three pipelines (4 warps, 1 or 2 accumulator chains; 8 warps) and the
# decode kernel.
H200_VARIANTS: tuple[KernelVariant, ...] = (
    *(
        KernelVariant(GEMV, f"sm70::gptq_gemv_tc_kernel<{H200}, {w}, {ch}>", 32 * w)
        for w, ch in ((4, 1), (4, 2), (8, 1))
    ),
    *(
        KernelVariant(DECODE, f"sm70::paged_decode_kernel<{GQA_GROUP}, {qn}, {H200}, {b}>", 128)
        for b in ("false", "true")
        for qn in range(1, MAX_QUERY_ROWS + 1)
    ),
    KernelVariant(FMHA, f"sm70::fmha_prefill_kernel<{H200}>", 256, FMHA_SMEM_H200),
    KernelVariant(GDN_CHUNK, f"sm70::gdn_chunk_prefill_kernel<{H200}>", 256, GDN_CHUNK_SMEM),
    KernelVariant(GDN_TWO_PASS, f"sm70::gdn_chunk_wy_kernel<{H200}>", 256, GDN_WY_SMEM),
    KernelVariant(GDN_TWO_PASS, f"sm70::gdn_chunk_state_kernel<{H200}>", 256, GDN_STATE_SMEM),
)


def headers() -> list[str]:
    return sorted({v.header for v in VARIANTS})
