"""The Gated DeltaNet chunked prefill (torch.ops.sm70.gdn_chunk_prefill) against FLA's
Triton chunk_gated_delta_rule (vLLM 0.22.1's bundled copy, what stock vLLM runs for a
prefill) and the tensor-core ceiling measured in the same run, one layer at the model's
TP=1 shapes (16 key heads, 48 value heads, 128 x 128), N tokens (N = 8K, 32K) as one
sequence and as 4 equal sequences (--seqs), each starting from a state.

    python3 bench/bench_gdn_chunk.py --out bench_gdn_chunk.json [--tokens 8192,32768]

Our kernel runs 4 blocks per value head and sequence (192 for one sequence at TP=1, fewer
than two per SM), each walking its sequence's chunks in order, so one long sequence leaves
much of the GPU idle; the 4-sequence rows show the same tokens with 4x the blocks.

Rows (JSON "rows", a markdown table beside it), impl:
- sm70_volta: ours through set_arch_path("sm70"), the arch::Sm70 (m8n8k4) code a V100
  runs; frac_of_m8n8k4_peak divides its TFLOP/s by the m8n8k4 loop's (fmha_tc_peak, as
  bench_fmha.py measures it; on an H200 m8n8k4 is emulated, so the fraction says how close
  the kernel's pipeline gets to what that instruction gives there).
- sm70_native: the arch::Sm80 tag (m16n8k16 products), against that loop's ceiling.
- two_pass_volta, two_pass_native: gdn_chunk_prefill_two_pass (csrc/gdn/chunk_two_pass.cuh:
  the chunk-parallel products in a first pass, the state recurrence in a second).
- fla_chunk: FLA's chunk_gated_delta_rule on q, k, v, g, beta already split, normalised
  and gated; fla_prep_chunk adds vLLM's fused_post_conv_prep (split, l2norm, gating), the
  work our op fuses, so it is the like-for-like row. Both in fp16, as ours.
TFLOP/s use one count for every impl (chunk_flops: the WY-form products of the algorithm,
not what each kernel executes: ours recomputes the key-side products per value slice).
ours_rel_err_vs_fla compares our output with FLA's (a cross-check, not the test: the tests
compare against the float64 recurrence). The JSON is rewritten after each row.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # vllm_patch
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' helpers

from bench_io import (
    cell,
    md_table,
    new_result,
    parse_tokens,
    run_and_report,
    tensor_core_parser,
    write_result,
)
from gpu_timing import record_peaks, time_against_peaks, time_on_arch_path

CHUNK = 64
D = 128


def chunk_flops(lens: list[int], num_v_heads: int, dk: int = D, dv: int = D,
                chunk: int = CHUNK) -> int:
    """FLOPs of the chunked gated delta rule over sequences of `lens` tokens (pure): per
    value head and chunk of L tokens, the products K K^T, Q K^T, T K (L x L x dk each),
    T V and P V' (L x L x dv), W H, Q H and K^T V' (L x dk x dv each), 2 FLOPs per
    multiply-add; the triangular solve (L^3 / 3) is counted too."""
    total = 0
    for n in lens:
        full, tail = divmod(n, chunk)
        for length, count in ((chunk, full), (tail, 1 if tail else 0)):
            per = (2 * length * length * (3 * dk + 2 * dv) + 6 * length * dk * dv
                   + length**3 // 3)
            total += per * count
    return total * num_v_heads


def split_lengths(tokens: int, seqs: int) -> list[int]:
    """`tokens` as `seqs` sequences as equal as possible, the longer first (pure)."""
    if seqs < 1 or tokens < seqs:
        raise ValueError(f"cannot split {tokens} tokens into {seqs} sequences")
    base, extra = divmod(tokens, seqs)
    return [base + 1 if i < extra else base for i in range(seqs)]


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (pure)."""
    cells = [(r.get("tokens", "-"), r.get("seqs", 1), r["impl"], cell(r.get("ms"), ".3f"),
              cell(r.get("tflops"), ".2f"), cell(r.get("frac_of_m8n8k4_peak"), ".1f", 100, " %"),
              cell(r.get("speedup_vs_fla"), ".2f", suffix="x"),
              (r.get("error") or r.get("note") or "")[:80]) for r in rows]
    return md_table(("tokens", "seqs", "impl", "ms", "TFLOP/s", "of m8n8k4 peak",
                     "vs FLA (prep+chunk)", "note"), cells) + "\n"


def build_case(torch, tokens: int, seqs: int, h: int, hv: int, seed: int):
    """Random conv output, gates and a state pool of 1 + seqs slots (sequence n on n + 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(tokens, 2 * h * D + hv * D, generator=gen, device="cuda").half()
    ab = (torch.randn(tokens, 2 * hv, generator=gen, device="cuda") * 2.0).half()
    a, b = ab[:, :hv], ab[:, hv:]
    a_log = (torch.rand(hv, generator=gen, device="cuda") * 4.5 - 3.0).float()
    dt_bias = (torch.randn(hv, generator=gen, device="cuda") * 0.5).half()
    state = torch.randn(1 + seqs, hv, D, D, generator=gen, device="cuda") * 0.3
    return qkv, a.contiguous(), b.contiguous(), a_log, dt_bias, state


def run(args: argparse.Namespace) -> dict:
    import torch

    from vllm_patch.ops import kernels

    out_path = Path(args.out)
    h, hv = args.k_heads, args.v_heads
    result = new_result(
        "GDN chunked prefill vs FLA chunk_gated_delta_rule and the m8n8k4 ceiling",
        torch.cuda.get_device_name(0), {"k_heads": h, "v_heads": hv, "head": D, "chunk": CHUNK})
    t_stop = time.monotonic() + args.budget_s

    def save() -> None:
        write_result(out_path, result, markdown)

    peaks = record_peaks(kernels, result)
    save()
    try:
        from vllm.model_executor.layers.fla.ops import (
            chunk_gated_delta_rule,
            fused_post_conv_prep,
        )
        from vllm.model_executor.layers.fla.ops.index import (
            prepare_chunk_indices,
            prepare_chunk_offsets,
        )
    except Exception as exc:
        chunk_gated_delta_rule = None
        result["errors"].append(f"fla import: {exc!r}")
    scale = D**-0.5

    cases = [(t, s) for t in parse_tokens(args.tokens) for s in parse_tokens(args.seqs)]
    for n, (tokens, seqs) in enumerate(cases):
        if time.monotonic() > t_stop:
            result["errors"].append(f"budget spent before {tokens} tokens in {seqs}")
            break
        lens = split_lengths(tokens, seqs)
        flops = chunk_flops(lens, hv)
        base = {"tokens": tokens, "seqs": seqs, "gflop": flops / 1e9}
        qkv, a, b, a_log, dt_bias, state = build_case(torch, tokens, seqs, h, hv, seed=n)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                           device="cuda")
        idx = torch.arange(1, seqs + 1, dtype=torch.int32, device="cuda")
        init = torch.ones(seqs, dtype=torch.bool, device="cuda")
        work = state.clone()

        chunk_indices = kernels.gdn_chunk_indices(qsl)

        def one_pass(qkv=qkv, a=a, b=b, a_log=a_log, dt_bias=dt_bias, work=work, qsl=qsl,
                     idx=idx, init=init):
            return kernels.gdn_chunk_prefill(qkv, a, b, a_log, dt_bias, work, qsl, idx, init,
                                             h, scale)

        def two_pass(qkv=qkv, a=a, b=b, a_log=a_log, dt_bias=dt_bias, work=work, qsl=qsl,
                     idx=idx, init=init, ci=chunk_indices):
            return kernels.gdn_chunk_prefill_two_pass(qkv, a, b, a_log, dt_bias, work, qsl, idx,
                                                      init, h, scale, chunk_indices=ci)

        def from_first_state(fn, work=work, state=state):
            """fn's output and the sequences' final states, from the case's first state."""
            work.copy_(state)
            return fn(), work[1:].clone()

        ours_out = {}
        for impl, path, ours in (("sm70_volta", "sm70", one_pass),
                                 ("sm70_native", "native", one_pass),
                                 ("two_pass_volta", "sm70", two_pass),
                                 ("two_pass_native", "native", two_pass)):
            row = {**base, "impl": impl}
            got = time_on_arch_path(kernels, row, path, ours, flops, peaks, result["errors"],
                                    then=partial(from_first_state, ours))
            if got is not None:
                ours_out[impl] = got
            result["rows"].append(row)
            save()

        if chunk_gated_delta_rule is not None:
            fla_ms = None
            try:
                chunk_indices = prepare_chunk_indices(qsl, CHUNK)
                chunk_offsets = prepare_chunk_offsets(qsl, CHUNK)
                init_state = state[1:].clone()

                def prep(qkv=qkv, a=a, b=b, a_log=a_log, dt_bias=dt_bias):
                    return fused_post_conv_prep(conv_output=qkv, a=a, b=b, A_log=a_log,
                                                dt_bias=dt_bias, num_k_heads=h, head_k_dim=D,
                                                head_v_dim=D, apply_l2norm=True,
                                                output_g_exp=False)

                def chunk(parts, init_state=init_state, qsl=qsl, ci=chunk_indices,
                          co=chunk_offsets):
                    q, k, v, g, beta = (x.unsqueeze(0) for x in parts)
                    return chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                                  initial_state=init_state,
                                                  output_final_state=True, cu_seqlens=qsl,
                                                  chunk_indices=ci, chunk_offsets=co,
                                                  use_qk_l2norm_in_kernel=False)

                parts = prep()
                for impl, fn in (("fla_chunk", lambda p=parts: chunk(p)),
                                 ("fla_prep_chunk", lambda: chunk(prep()))):
                    row = {**base, "impl": impl}
                    # FLA's rows: the m8n8k4 fraction only (the table's column)
                    time_against_peaks(row, fn, flops,
                                       {k: v for k, v in peaks.items() if k == "m8n8k4"})
                    if impl == "fla_prep_chunk":
                        fla_ms = row["ms"]
                        o, final = chunk(parts)
                        want = o[0].float()
                        for name, (got, st) in ours_out.items():
                            rel = float((got.float() - want).norm() / want.norm())
                            srel = float((st - final.float()).norm() / final.norm())
                            row[f"{name}_rel_err_vs_fla"] = rel
                            row[f"{name}_state_rel_err_vs_fla"] = srel
                        if "sm70_volta" in ours_out:
                            row["note"] = ("ours (volta) vs fla: rel "
                                           f"{row['sm70_volta_rel_err_vs_fla']:.2e}")
                        if "sm70_volta" in ours_out and "two_pass_volta" in ours_out:
                            one, two = ours_out["sm70_volta"][0], ours_out["two_pass_volta"][0]
                            row["two_pass_vs_one_pass_max_abs"] = float(
                                (one.float() - two.float()).abs().max())
                    result["rows"].append(row)
                    save()
            except Exception as exc:
                result["rows"].append({**base, "impl": "fla", "error": repr(exc)[:300]})
                result["errors"].append(f"fla {tokens}: {traceback.format_exc()[-800:]}")
            if fla_ms is not None:
                for row in result["rows"]:
                    if row.get("tokens") == tokens and row.get("seqs") == seqs and row.get("ms"):
                        row["speedup_vs_fla"] = fla_ms / row["ms"]
            save()
        del qkv, a, b, state, work, from_first_state
        ours_out.clear()
        torch.cuda.empty_cache()
    save()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = tensor_core_parser(__doc__, "8192,32768", "tokens per case")
    ap.add_argument("--seqs", default="1,4", help="equal sequences the tokens are split into")
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=48)
    args = ap.parse_args(argv)
    try:
        for t in parse_tokens(args.tokens):
            for s in parse_tokens(args.seqs):
                split_lengths(t, s)
    except ValueError as exc:
        ap.error(str(exc))
    if args.k_heads < 1 or args.v_heads % args.k_heads:
        ap.error(f"--v-heads {args.v_heads} must be a multiple of --k-heads {args.k_heads}")
    return run_and_report(run, args, markdown)


if __name__ == "__main__":
    sys.exit(main())
