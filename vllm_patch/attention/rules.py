"""What the SM70 attention backend serves, and how a step's rows split between its kernels:
pure functions (no torch, no vLLM), so the refusals and the split are tested on any machine.

The backend serves fp16 models with the `int8_per_token_head` KV cache and head size 256
(the kernels are written for exactly that; GQA 6:1 is the decode kernel's group). A step's
rows arrive reordered by vLLM (decode -> short extend -> long extend -> prefill, because the
builder sets `reorder_batch_threshold`): the leading requests that all have the same query
length q <= MAX_DECODE_ROWS (1 + k MTP verification rows count as decodes) go to
`torch.ops.sm70.paged_decode`, the rest (chunked prefill, mixed lengths, a draft cut short
near max_model_len) to vLLM's own Triton `unified_attention` on the same cache, or, opt-in
(SM70_PREFILL_ATTENTION=cutlass_fmha), to torch.ops.sm70.fmha_prefill on the same page
(check_prefill_kernel refuses what its stride rule cannot address).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HEAD_SIZE = 256
KV_CACHE_DTYPE = "int8_per_token_head"
MODEL_DTYPE = "float16"
GQA_GROUP = 6
MAX_DECODE_ROWS = 4  # query rows per sequence paged_decode takes (q_per_seq 1..4)
SPEC_TOKENS_SETTING = "SM70_SPEC_TOKENS"
SCALE_BYTES = 4  # the fp32 scale at the end of each int8 row of the page
PREFILL_SETTING = "SM70_PREFILL_ATTENTION"
PREFILL_TRITON = "triton"  # vLLM's own unified_attention (the default)
PREFILL_FMHA = "cutlass_fmha"  # torch.ops.sm70.fmha_prefill (opt-in)
PREFILL_KERNELS = (PREFILL_TRITON, PREFILL_FMHA)
FMHA_STRIDE_BYTES = 4  # the op's narrowest context load (4-byte words): strides must be multiples


class AttentionConfigError(ValueError):
    """A configuration the backend refuses at start-up; one line naming the setting, the
    value and the rule (vllm_patch does not import sm70ctl, so not an Sm70Error)."""


def refusals(head_size: int, dtype: str, kv_cache_dtype: str | None) -> list[str]:
    """One reason per thing the backend cannot serve (empty: it can). dtype as torch names
    it without the prefix ("float16"); kv_cache_dtype as vLLM's --kv-cache-dtype."""
    out = []
    if head_size != HEAD_SIZE:
        out.append(f"head_size {head_size} not supported (the SM70 kernels take {HEAD_SIZE})")
    if dtype != MODEL_DTYPE:
        out.append(f"dtype {dtype} not supported (SM70_PAGED runs {MODEL_DTYPE})")
    if kv_cache_dtype != KV_CACHE_DTYPE:
        out.append(f"kv_cache_dtype {kv_cache_dtype} not supported "
                   f"(SM70_PAGED reads only {KV_CACHE_DTYPE})")
    return out


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    """The decode kernel's GQA group is compiled in: Hq = 6 Hkv."""
    if num_kv_heads <= 0 or num_heads != GQA_GROUP * num_kv_heads:
        raise AttentionConfigError(
            f"attention heads {num_heads} q / {num_kv_heads} kv: SM70_PAGED needs GQA "
            f"{GQA_GROUP}:1 (the decode kernel's group)")


def decode_rows_per_seq(num_speculative_tokens: int | None, parallel_drafting: bool) -> int:
    """Query rows of one verification step per sequence, as vLLM's
    `_init_reorder_batch_threshold(1, supports_spec_as_decode=True)` counts them (1 + k, or
    1 + 2k with parallel drafting); refused above what paged_decode takes."""
    k = num_speculative_tokens or 0
    rows = 1 + (2 if parallel_drafting else 1) * k
    if rows > MAX_DECODE_ROWS:
        raise AttentionConfigError(
            f"{SPEC_TOKENS_SETTING}={k}"
            f"{' with parallel drafting' if parallel_drafting else ''}: a verification step "
            f"has {rows} query rows per sequence, the SM70_PAGED decode kernel takes at most "
            f"{MAX_DECODE_ROWS} (use {SPEC_TOKENS_SETTING} <= {MAX_DECODE_ROWS - 1})")
    return rows


def page_strides(block_size: int, num_kv_heads: int) -> tuple[int, int, int]:
    """Bytes between consecutive blocks, tokens and KV heads of K (or V) in TRITON_ATTN's
    int8_per_token_head page (vllm_patch.attention.layout): the [block, token, head] cache
    strides torch.ops.sm70.fmha_prefill would take on it."""
    row = HEAD_SIZE + SCALE_BYTES
    return 2 * block_size * num_kv_heads * row, num_kv_heads * row, row


def fmha_stride_problem(cache_strides: Sequence[int]) -> str | None:
    """Why torch.ops.sm70.fmha_prefill cannot read a page with these int8 [block, token,
    head] strides (its binding's rule), or None."""
    bad = [s for s in cache_strides if s < 0 or s % FMHA_STRIDE_BYTES]
    if not bad:
        return None
    return (f"cache strides {list(cache_strides)} bytes: fmha_prefill takes only multiples "
            f"of {FMHA_STRIDE_BYTES} (its narrowest load is one {FMHA_STRIDE_BYTES}-byte word)")


def prefill_route(config: Any) -> str:
    """The kernel the metadata builder sends prefill rows to: the plugin config's
    attention.prefill_kernel (SM70_PREFILL_ATTENTION); check_prefill_kernel refuses one
    that is not in PREFILL_KERNELS, right after, with the page it must read."""
    return config.attention.prefill_kernel


def check_prefill_kernel(kernel: str, cache_strides: Sequence[int]) -> None:
    """Refuse, at start-up, a prefill kernel that is not one of PREFILL_KERNELS, or the FMHA
    on a page it cannot address. TRITON_ATTN's int8_per_token_head page (260-byte rows) has
    strides that are multiples of 4, so the FMHA starts on it (its 4-byte load path)."""
    if kernel not in PREFILL_KERNELS:
        raise AttentionConfigError(f"{PREFILL_SETTING}={kernel}: not one of "
                                   f"{', '.join(PREFILL_KERNELS)}")
    if kernel == PREFILL_FMHA:
        problem = fmha_stride_problem(cache_strides)
        if problem is not None:
            raise AttentionConfigError(
                f"{PREFILL_SETTING}={kernel} cannot read this {KV_CACHE_DTYPE} page: "
                f"{problem} (use {PREFILL_SETTING}={PREFILL_TRITON})")


@dataclass(frozen=True)
class RowSplit:
    """How one step's requests split: requests [0, num_decodes) are decode rows of
    q_per_seq query tokens each (tokens [0, num_decode_tokens)), the rest go to the
    prefill path (tokens [num_decode_tokens, num_actual_tokens))."""

    num_decodes: int
    q_per_seq: int
    num_decode_tokens: int
    num_prefills: int
    max_prefill_query_len: int


def split_rows(query_start_loc: Sequence[int], decode_threshold: int) -> RowSplit:
    """The split of a reordered batch (query_start_loc: the CPU copy, num_reqs + 1 entries).

    Decodes are the leading run of requests sharing the first request's query length q,
    when 1 <= q <= min(decode_threshold, MAX_DECODE_ROWS): the decode kernel launches one
    q_per_seq for the batch, so a request of another length (a short prefill chunk, or a
    draft cut near max_model_len) and everything after it takes the prefill path, which
    handles any mix. Requests of no tokens after the run (the padding of a batch) need no
    work: when nothing else follows, there is no prefill part.
    """
    starts = list(query_start_loc)
    lens = [b - a for a, b in itertools.pairwise(starts)]
    n = 0
    q = lens[0] if lens else 0
    if 1 <= q <= min(decode_threshold, MAX_DECODE_ROWS):
        while n < len(lens) and lens[n] == q:
            n += 1
    rest = lens[n:]
    return RowSplit(num_decodes=n, q_per_seq=q if n else 0,
                    num_decode_tokens=starts[n] - starts[0] if lens else 0,
                    num_prefills=len(rest) if sum(rest) > 0 else 0,
                    max_prefill_query_len=max(rest, default=0))
