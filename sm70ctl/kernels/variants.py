"""Every kernel variant the torch extension launches, with its launch shape.

The NVRTC check (tests/test_kernels_compile.py) compiles exactly these instantiations for
sm_70, and the launchers in csrc/torch_bindings use the same block sizes and no dynamic
shared memory; keep the two in step when a variant is added.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelVariant:
    header: str  # file under csrc/kernels
    expr: str  # C++ name expression that instantiates the kernel
    threads: int  # threads per block used by the launcher
    dynamic_smem: int = 0  # bytes of dynamic shared memory the launcher requests

    @property
    def label(self) -> str:
        return self.expr.replace("sm70::", "")


def gemv_rows(m: int) -> int:
    """Rows per warp for an M-row GEMV (mirrors GemvRows<M> in gptq_gemv.cuh)."""
    return 4 if m <= 4 else 2


GQA_GROUP = 6  # Qwen3.8-27B: 24 query heads over 4 KV heads
MAX_QUERY_ROWS = 4  # 1 + MTP k=3
GEMV_SK_STAGES = (2, 3)  # stream-K GEMV pipeline depths (R = 8 spills at 128 registers)

VARIANTS: tuple[KernelVariant, ...] = (
    *(
        KernelVariant("gptq_gemv.cuh", f"sm70::gptq_gemv_kernel<{m}, {gemv_rows(m)}>", 128)
        for m in range(1, 9)
    ),
    *(
        KernelVariant("gptq_gemv.cuh", f"sm70::gptq_gemv_stream_kernel<4, {u}>", 128)
        for u in (1, 2)
    ),
    # streamed M = 1 with x in dynamic shared memory (kernels 6, 7), up to K = 24576
    *(
        KernelVariant(
            "gptq_gemv.cuh", f"sm70::gptq_gemv_stream_kernel<{r}, {u}, true>", 128, 48 * 1024
        )
        for r, u in ((4, 2), (8, 1))
    ),
    # streamed M = 1 with packed-half math (kernels 8, 9, 13): R = 4, U = 1 / 2; R = 2, U = 1
    *(
        KernelVariant("gptq_gemv.cuh", f"sm70::gptq_gemv_stream_kernel<{r}, {u}, false, true>", 128)
        for r, u in ((4, 1), (4, 2), (2, 1))
    ),
    # tensor-core GEMV, M = 1..8 (kernels 10, 11): the m8n8k4 variant (the m16n8k16 one is
    # sm_80+ only, for the H200 test GPU)
    *(
        KernelVariant("gptq_gemv.cuh", f"sm70::gptq_gemv_tc_kernel<false, {w}, 1>", 32 * w)
        for w in (4, 8)
    ),
    # stream-K M = 1 (kernels 4, 5): R = 4 rows, S = 2 / 3 pipeline stages
    *(
        KernelVariant("gptq_gemv.cuh", f"sm70::gptq_gemv_sk_kernel<4, {s}>", 128)
        for s in GEMV_SK_STAGES
    ),
    KernelVariant("kv_int8.cuh", "sm70::kv_int8_write_kernel<256>", 128),
    # batch 1 (or one split per sequence), and batches sharing their chunks by length
    *(
        KernelVariant(
            "paged_decode.cuh",
            f"sm70::paged_decode_kernel<{GQA_GROUP}, {qn}, false, {batched}>",
            128,
        )
        for batched in ("false", "true")
        for qn in range(1, MAX_QUERY_ROWS + 1)
    ),
    *(
        KernelVariant(
            "paged_decode.cuh",
            f"sm70::paged_decode_reduce_kernel<{GQA_GROUP}, {qn}, {batched}>",
            256,
        )
        for batched in ("false", "true")
        for qn in range(1, MAX_QUERY_ROWS + 1)
    ),
    KernelVariant("int8_gemm_lowrank.cuh", "sm70::lowrank_gemm_kernel", 128),
)


def headers() -> list[str]:
    return sorted({v.header for v in VARIANTS})
