"""What TRITON_ATTN's 260-byte rows cost the paged decode and the FMHA prefill: the same
cache content read through the packed layout (16-byte aligned rows, 16-byte loads) and
through TRITON_ATTN's page (4-byte aligned rows, 4-byte loads of the same bytes), timed with
CUDA events. FMHA rows: one chunk after a context, in the tiny checkpoint's 528-token blocks.

    python3 tests/gpu/attention/layout_cost.py --out FILE [--quick]

The rows are (context, batch, q_per_seq, arch path) with the split count the backend would
pick (reference.decode_num_splits with the driver's occupancy). When other work shares the
GPU the absolute times are noisy; the ratio of the two layouts, timed alternately in the
same loop, is the figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

CASES = [(4096, 1, 1), (65536, 1, 1), (262144, 1, 1), (4096, 16, 4), (32768, 16, 1)]
QUICK = [(4096, 1, 1), (65536, 1, 1), (4096, 16, 4)]
FMHA_CASES = [(3072, 1024), (14336, 2048)]  # (context, chunk) of one sequence
FMHA_QUICK = [(3072, 1024)]


def caches(ctx: int, batch: int, gen: Any) -> tuple[list[Any], list[Any]]:
    import torch

    from vllm_patch.attention import layout

    bs, hkv = 16, 2
    nb = batch * math.ceil(ctx / bs)
    k = torch.randint(-127, 128, (nb, hkv, bs, 256), dtype=torch.int8, device="cuda",
                      generator=gen)
    v = torch.randint(-127, 128, (nb, hkv, bs, 256), dtype=torch.int8, device="cuda",
                      generator=gen)
    ks = torch.rand(nb, hkv, bs, device="cuda", generator=gen) * 0.02 + 1e-3
    vs = torch.rand(nb, hkv, bs, device="cuda", generator=gen) * 0.02 + 1e-3
    tables = torch.randperm(nb, device="cuda", generator=gen).int().view(batch, -1)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    page = layout.new_page(nb, bs, hkv, "cuda")
    pk, pv = layout.scale_views(page)
    views = list(layout.op_views(page, pk, pv))
    for dst, src in zip(views, (k, v, ks, vs), strict=True):
        dst.copy_(src)
    return [k, v, ks, vs, tables, seq], [*views, tables, seq]


def fmha_inputs(ctx: int, q_len: int, gen: Any) -> tuple[list[Any], list[Any]]:
    """The fmha_prefill arguments (q .. max_q_len) for the packed cache and for TRITON_ATTN's
    page holding the same codes and scales."""
    import torch

    from vllm_patch.attention import layout

    bs, hkv, hq = 528, 2, 12
    nb = math.ceil(ctx / bs) + 1
    k = torch.randint(-127, 128, (nb, hkv, bs, 256), dtype=torch.int8, device="cuda",
                      generator=gen)
    v = torch.randint(-127, 128, (nb, hkv, bs, 256), dtype=torch.int8, device="cuda",
                      generator=gen)
    ks = torch.rand(nb, hkv, bs, device="cuda", generator=gen) * 0.02 + 1e-3
    vs = torch.rand(nb, hkv, bs, device="cuda", generator=gen) * 0.02 + 1e-3
    page = layout.new_page(nb, bs, hkv, "cuda")
    pk, pv = layout.scale_views(page)
    for dst, src in zip(layout.op_views(page, pk, pv), (k, v, ks, vs), strict=True):
        dst.copy_(src)
    kc, vc, cs, ss = layout.fmha_views(page, pk, pv)
    q = torch.randn(q_len, hq, 256, device="cuda", generator=gen).half()
    kn = torch.randn(q_len, hkv, 256, device="cuda", generator=gen).half()
    vn = torch.randn(q_len, hkv, 256, device="cuda", generator=gen).half()
    table = torch.randperm(nb, device="cuda", generator=gen).int().view(1, -1)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    tail = [table, qsl, ctx_t, bs, q_len]
    packed = [q, kn, vn, k, v, ks, vs, (hkv * bs * 256, 256, bs * 256), (hkv * bs, 1, bs),
              *tail]
    return packed, [q, kn, vn, kc, vc, pk, pv, cs, ss, *tail]


def time_pair(fa: Any, fb: Any, reps: int) -> tuple[float, float]:
    """Median microseconds of fa and fb, timed alternately."""
    import torch

    for _ in range(3):
        fa()
        fb()
    ta, tb = [], []
    for _ in range(reps):
        for f, acc in ((fa, ta), (fb, tb)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            f()
            e.record()
            e.synchronize()
            acc.append(s.elapsed_time(e) * 1000)
    return sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2]


def measure(packed: list[Any], triton: list[Any], q: Any, qn: int, splits: int,
            reps: int) -> tuple[float, float, bool]:
    """(packed us, triton us, whether both layouts gave bit-identical outputs)."""
    import torch

    from vllm_patch.ops import kernels

    outs: dict[str, Any] = {}

    def run(cache: list[Any], tag: str) -> None:
        outs[tag] = kernels.paged_decode(q, *cache, qn, 0.0625, splits)

    tp, tt = time_pair(lambda: run(packed, "p"), lambda: run(triton, "t"), reps)
    return tp, tt, bool(torch.equal(outs["p"], outs["t"]))


def measure_fmha(packed: list[Any], triton: list[Any], reps: int) -> tuple[float, float, bool]:
    """(packed us, triton us, bit-identical outputs) of fmha_prefill on the two layouts."""
    import torch

    from vllm_patch.ops import kernels

    outs: dict[str, Any] = {}

    def run(args: list[Any], tag: str) -> None:
        outs[tag] = kernels.fmha_prefill(*args, 0.0625)

    tp, tt = time_pair(lambda: run(packed, "p"), lambda: run(triton, "t"), reps)
    return tp, tt, bool(torch.equal(outs["p"], outs["t"]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    res: dict[str, Any] = {"rows": [], "fmha_rows": [], "errors": [],
                           "note": "medians of alternated runs; the GPU may be shared with "
                           "other work"}
    t0 = time.time()
    try:
        import torch

        from vllm_patch.ops import kernels
        from vllm_patch.ops.reference import decode_num_splits

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        res["device"] = torch.cuda.get_device_name(0)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for path in ("native", "sm70"):
            kernels.set_arch_path(path)
            for ctx, batch, qn in (QUICK if a.quick else CASES):
                try:
                    packed, triton = caches(ctx, batch, gen)
                    q = torch.randn(batch * qn, 12, 256, device="cuda", generator=gen).half()
                    splits = decode_num_splits(ctx, batch, 2, sms,
                                               ctas_per_sm=kernels.paged_decode_blocks_per_sm(qn))
                    tp, tt, same = measure(packed, triton, q, qn, splits, a.reps)
                    res["rows"].append({
                        "arch_path": path, "context": ctx, "batch": batch, "q_per_seq": qn,
                        "splits": splits, "packed_us": round(tp, 2), "triton_us": round(tt, 2),
                        "triton_over_packed": round(tt / tp, 4),
                        "same_output": same,
                    })
                    del packed, triton
                except Exception as exc:  # one case's failure keeps the others
                    res["errors"].append(f"{path} {ctx}x{batch}x{qn}: {type(exc).__name__}: {exc}")
                a.out.write_text(json.dumps(res, indent=1))
            for ctx, q_len in (FMHA_QUICK if a.quick else FMHA_CASES):
                try:
                    fp, ft = fmha_inputs(ctx, q_len, gen)
                    tp, tt, same = measure_fmha(fp, ft, max(5, a.reps // 3))
                    res["fmha_rows"].append({
                        "arch_path": path, "context": ctx, "chunk": q_len,
                        "packed_us": round(tp, 2), "triton_us": round(tt, 2),
                        "triton_over_packed": round(tt / tp, 4), "same_output": same,
                    })
                    del fp, ft
                except Exception as exc:  # one case's failure keeps the others
                    res["errors"].append(f"fmha {path} {ctx}+{q_len}: "
                                         f"{type(exc).__name__}: {exc}")
                a.out.write_text(json.dumps(res, indent=1))
        kernels.set_arch_path("native")
    except Exception as exc:
        res["errors"].append(f"{type(exc).__name__}: {exc}")
    res["seconds"] = round(time.time() - t0, 1)
    a.out.write_text(json.dumps(res, indent=1))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
