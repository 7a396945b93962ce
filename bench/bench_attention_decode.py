"""Our paged decode against vLLM 0.22.1's Triton decode on the same int8 KV (issue 22 item 6).

    TORCH_CUDA_ARCH_LIST=9.0 python bench/bench_attention_decode.py --out FILE [--quick]

Both kernels read one TRITON_ATTN int8_per_token_head page (vllm_patch.attention.layout:
260-byte rows, the fp32 scale in each row's last 4 bytes), the block size the backend gets
from vLLM for this model (--block-size), Qwen3.8-27B's per-GPU heads at TP = 2 (12 query,
2 KV): ours is torch.ops.sm70.paged_decode through the backend's views with the split count
the backend picks (reference.decode_num_splits with the driver's occupancy), vLLM's is
`unified_attention` with the arguments TritonAttentionImpl passes for a decode batch (its
3D/segmented path below seq_threshold_3D sequences, as its builder sizes it). Cases: 4K, 64K
and 262K tokens of context, batch 1 and 16, 1 and 4 query rows per sequence (4: an MTP
verification step, causal within the rows). Every timed call reads its own block-table
copy of the KV, rotating through at least 512 MiB, replayed from a CUDA graph
(bench/gpu_timing.py), so L2 does not flatter the short contexts. The two outputs are
compared too (max_abs_diff). Prints the table; the JSON goes to --out (or stdout).
The target: ours faster than vLLM's Triton decode at every length (`ours_faster_everywhere`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_cases as C
from bench_io import md_table, write_json

CONTEXTS = (4096, 65536, 262144)
BATCHES = (1, 16)
Q_ROWS = (1, 4)
QUICK_CONTEXTS = (4096, 65536)
BLOCK_SIZE = 1584  # the full-attention block vLLM's hybrid alignment gives this model
SOFTMAX_SCALE = 0.0625  # 1 / sqrt(256)
TRITON_MIN_GRID_2D = 128  # TRITON_ATTN's builder: 3D kernel below 128 // Hkv sequences
TRITON_SEGMENTS = 16


# ------------------------------------------------------------------ pure parts
def cases(quick: bool = False) -> list[tuple[int, int, int]]:
    """(context, batch, q rows) in the order they run: short contexts first."""
    ctxs = QUICK_CONTEXTS if quick else CONTEXTS
    return [(c, b, q) for c in ctxs for b in BATCHES for q in Q_ROWS]


def blocks_per_seq(context: int, block_size: int) -> int:
    if context < 1 or block_size < 1:
        raise ValueError(f"context {context} and block size {block_size} must be >= 1")
    return math.ceil(context / block_size)


def case_bytes(context: int, batch: int, block_size: int, hkv: int = C.KV_HEADS) -> int:
    """Bytes of K, V and scales one call reads: whole blocks, as both kernels do."""
    return C.kv_bytes(batch * blocks_per_seq(context, block_size) * block_size, hkv)


def block_tables(batch: int, nblk: int, copy: int) -> list[list[int]]:
    """Block-table rows of one rotating copy: copy c's sequences own the contiguous run of
    blocks after copies 0 .. c - 1, sequence s the s-th nblk of it (pure)."""
    base = copy * batch * nblk
    return [list(range(base + s * nblk, base + (s + 1) * nblk)) for s in range(batch)]


def triton_threshold(hkv: int = C.KV_HEADS) -> int:
    """seq_threshold_3D as TRITON_ATTN's builder sizes it without decode CUDA graphs."""
    return TRITON_MIN_GRID_2D // hkv


def row(context: int, batch: int, q_rows: int, ours_s: float, triton_s: float,
        nbytes: int, splits: int, max_abs_diff: float) -> dict[str, Any]:
    """One case's JSON row from its two measured times (seconds per call)."""
    if ours_s <= 0 or triton_s <= 0:
        raise ValueError(f"times must be > 0, got ours {ours_s}, triton {triton_s}")
    return {"context": context, "batch": batch, "q_rows": q_rows, "splits": splits,
            "kv_bytes": nbytes, "ours_us": ours_s * 1e6, "triton_us": triton_s * 1e6,
            "triton_over_ours": triton_s / ours_s, "ours_gbps": nbytes / ours_s / 1e9,
            "triton_gbps": nbytes / triton_s / 1e9, "max_abs_diff": max_abs_diff,
            "v100_floor_us": C.v100_floor_us(nbytes)}


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The target over all rows: ours faster than Triton at every case; the slowest ratio."""
    if not rows:
        return {"ours_faster_everywhere": None, "worst": None}
    worst = min(rows, key=lambda r: r["triton_over_ours"])
    return {"ours_faster_everywhere": all(r["triton_over_ours"] > 1.0 for r in rows),
            "worst": {k: worst[k] for k in ("context", "batch", "q_rows", "triton_over_ours")}}


def table(rows: list[dict[str, Any]]) -> str:
    return md_table(
        ("context", "batch", "q rows", "splits", "ours us", "Triton us", "Triton/ours",
         "ours GB/s", "max abs diff"),
        [(r["context"], r["batch"], r["q_rows"], r["splits"], f"{r['ours_us']:.1f}",
          f"{r['triton_us']:.1f}", f"{r['triton_over_ours']:.2f}", f"{r['ours_gbps']:.0f}",
          f"{r['max_abs_diff']:.2e}") for r in rows])


# ------------------------------------------------------------------ the GPU
def measure(context: int, batch: int, q_rows: int, block_size: int, sms: int,
            copy_limit: int) -> dict[str, Any]:
    import torch
    from gpu_timing import time_graph
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    from vllm_patch.attention import layout
    from vllm_patch.ops import kernels
    from vllm_patch.ops.reference import decode_num_splits

    hq, hkv = C.Q_HEADS, C.KV_HEADS
    nblk = blocks_per_seq(context, block_size)
    nbytes = case_bytes(context, batch, block_size)
    copies = min(copy_limit, C.copies_for(nbytes))
    gen = torch.Generator(device="cuda").manual_seed(context + batch + q_rows)
    page = layout.new_page(copies * batch * nblk, block_size, hkv, "cuda")
    page[..., :256] = torch.randint(-127, 128, page[..., :256].shape, dtype=torch.int8,
                                    device="cuda", generator=gen)
    ks, vs = layout.scale_views(page)
    ks.copy_(torch.rand(ks.shape, device="cuda", generator=gen) * 0.02 + 1e-3)
    vs.copy_(torch.rand(vs.shape, device="cuda", generator=gen) * 0.02 + 1e-3)
    k, v, oks, ovs = layout.op_views(page, ks, vs)
    key_cache, value_cache = page.unbind(1)
    tables = [torch.tensor(block_tables(batch, nblk, c), dtype=torch.int32, device="cuda")
              for c in range(copies)]
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = (torch.randn(batch * q_rows, hq, 256, device="cuda", generator=gen) * 0.5).half()
    cu = torch.arange(0, batch * q_rows + 1, q_rows, dtype=torch.int32, device="cuda")
    splits = decode_num_splits(context, batch, hkv, sms,
                               ctas_per_sm=kernels.paged_decode_blocks_per_sm(q_rows))
    thr = triton_threshold(hkv)
    seg_out = torch.empty(thr, hq, TRITON_SEGMENTS, 256, dtype=torch.float32, device="cuda")
    seg_max = torch.empty(thr, hq, TRITON_SEGMENTS, dtype=torch.float32, device="cuda")
    seg_sum = torch.empty_like(seg_max)
    out_triton = torch.empty_like(q)
    outs: list[Any] = [None]

    def ours(bt: Any) -> Any:
        return lambda: outs.__setitem__(0, kernels.paged_decode(
            q, k, v, oks, ovs, bt, seq, q_rows, SOFTMAX_SCALE, splits))

    def triton(bt: Any) -> Any:
        return lambda: unified_attention(
            q=q, k=key_cache, v=value_cache, out=out_triton, cu_seqlens_q=cu,
            max_seqlen_q=q_rows, seqused_k=seq, max_seqlen_k=context,
            softmax_scale=SOFTMAX_SCALE, causal=True, window_size=(-1, -1), block_table=bt,
            softcap=0, q_descale=None, k_descale=None, v_descale=None, seq_threshold_3D=thr,
            num_par_softmax_segments=TRITON_SEGMENTS, softmax_segm_output=seg_out,
            softmax_segm_max=seg_max, softmax_segm_expsum=seg_sum,
            kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, k_scale_cache=ks, v_scale_cache=vs)

    ours(tables[0])()
    triton(tables[0])()
    torch.cuda.synchronize()
    diff = float((outs[0].float() - out_triton.float()).abs().max())
    t_ours = time_graph([ours(bt) for bt in tables])
    t_triton = time_graph([triton(bt) for bt in tables])
    del page
    torch.cuda.empty_cache()
    r = row(context, batch, q_rows, t_ours, t_triton, nbytes, splits, diff)
    r["copies"] = copies
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="4K and 64K only")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--max-copies", type=int, default=64)
    a = ap.parse_args()
    import torch

    from vllm_patch.ops import kernels

    props = torch.cuda.get_device_properties(0)
    doc: dict[str, Any] = {
        "bench": "attention_decode", "device": props.name, "arch_path": kernels.arch_path(),
        "block_size": a.block_size, "q_heads": C.Q_HEADS, "kv_heads": C.KV_HEADS,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rows": [], "errors": {}}
    for ctx, batch, qn in cases(a.quick):
        name = f"{ctx}x{batch}x{qn}"
        try:
            r = measure(ctx, batch, qn, a.block_size, props.multi_processor_count,
                        a.max_copies)
            doc["rows"].append(r)
            print(json.dumps(r), flush=True)
        except Exception as exc:  # one failed case is recorded, the rest still run
            doc["errors"][name] = f"{type(exc).__name__}: {exc}"
            torch.cuda.empty_cache()
    doc.update(verdict(doc["rows"]))
    if a.out:
        write_json(a.out, doc)
    else:
        print(json.dumps(doc, indent=1))
    print(table(doc["rows"]))
    return 0 if doc["rows"] and not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
