"""Prove the GPU tests catch the bugs they are meant to: build mutated copies of the ops
library (each from a copy of csrc/ with one bug written into the kernel source) and run the
tests aimed at that bug against each; every such test must fail, and a control test the
mutation does not touch must pass (so a failure is the bug's, not a broken build's).

    python3 tests/gpu/mutants.py [--only NAME ...] [--build-only | --run-only] [--out FILE]

Test-side only: the production code path never sees a mutant (the copies live under
$SM70_MUTANTS_DIR, default /tmp/sm70_mutants, and each runs in its own process, which loads
the mutated library before the tests ask the loader for the ops). Exit status 0 when every
mutant was killed and every control passed; the JSON summary goes to --out.
A mutation whose source text is no longer found is an error: update MUTANTS with the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GEMV = "tests/gpu/test_gemv_gpu.py"
ATTN = "tests/gpu/test_attention_gpu.py"
GDN = "tests/gpu/test_gdn_gpu.py"
GDN_DECODE = "gdn/recurrent_decode.cuh"
GDN_CONV = "gdn/conv1d.cuh"
GDN_CHUNK = "gdn/chunk_prefill.cuh"
GDN_TWO_PASS = "gdn/chunk_two_pass.cuh"
GDN_CHUNK_TEST = "tests/gpu/test_gdn_chunk_gpu.py"
FMHA = "tests/gpu/test_fmha_gpu.py"
KV_CONTROL = (ATTN, "test_kv_int8_write", {"block_size": 16})


@dataclass(frozen=True)
class Edit:
    path: str  # under csrc/
    pattern: str  # a regular expression
    replacement: str
    count: int  # how many matches the mutation expects (else the source moved on)


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[Edit, ...]
    # (test file, test function, parameters the test's callspec must have)
    expect_fail: tuple[tuple[str, str, dict], ...]
    expect_pass: tuple[tuple[str, str, dict], ...] = field(default=(KV_CONTROL,))


PD = "attention/paged_decode_kernel.cuh"
FULL = r"min\(t_end, ctx - QN \+ 1\)"  # the tile needs no mask
LIMIT = r"ctx - QN \+ \(sm_row % QN\)\)"  # the newest key a query row may see
TC_MMA = (r"(mma_m(?:16n8k16|8n8k4)\(\*reinterpret_cast<float\(\*\)\[(\d)\]>"
          r"\(cc\[j % CH\]\), (?:a|az), b\);)")

# The GDN chunk kernels' call of the shared gate scan (gdn/chunk_common.cuh, gc_chunk_gates,
# which ends at a barrier) and what a decay-one-token-late mutant writes after it: G_i made
# exclusive, G_i - g_i = G_(i-1), the values an exclusive scan stores (both kernels have lane
# and warp in scope there).
GC_GATES_CALL = r"( *)(gc_chunk_gates\(p, hg, c0, len, hv, gcum, bet\);\n)"
GC_EXCLUSIVE_SCAN = (
    r"\1\2\1if (warp == 0) {\n"
    r"\1  const float i0 = gcum[2 * lane], i1 = gcum[2 * lane + 1];\n"
    r"\1  float prev = __shfl_up_sync(0xffffffffu, i1, 1);\n"
    r"\1  if (lane == 0) prev = 0.f;\n"
    r"\1  gcum[2 * lane] = prev;\n"
    r"\1  gcum[2 * lane + 1] = i0;\n"
    r"\1}\n"
    r"\1__syncthreads();\n"
)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "gemv-zero-point-plus-one",
        "every GEMV kernel subtracts zero + 1 (an off-by-one zero point: the v1 offset "
        "applied twice)",
        (
            Edit("gemv/tensor_core.cuh",
                 r"__hneg\(__hadd\(__high2half\(st\.s\[i\]\), __float2half\(1024\.f\)\)\)",
                 "__hneg(__hadd(__high2half(st.s[i]), __float2half(1025.f)))", 1),
            Edit("gemv/gemv_common.cuh",
                 r"__hmul\(__hadd\(__high2half\(s\), __float2half\(1024\.f\)\),",
                 "__hmul(__hadd(__high2half(s), __float2half(1025.f)),", 1),
            Edit("gemv/classic.cuh", r"8388608\.f \+ __high2float\(s\[u\]\[r\]\)",
                 "8388609.f + __high2float(s[u][r])", 1),
        ),
        (
            (GEMV, "test_gemv_model_shapes", {"name": "qkv_proj", "m": 1}),
            (GEMV, "test_gemv_model_shapes", {"name": "qkv_proj", "m": 4, "arch": "native"}),
            (GEMV, "test_gemv_model_shapes", {"name": "down_proj", "m": 8, "arch": "sm70"}),
            (GEMV, "test_gemv_lm_head_full_vocab_slice", {"m": 1}),
            (GEMV, "test_gemv_lm_head_full_vocab_slice", {"m": 5, "arch": "native"}),
            (GEMV, "test_gemv_lm_head_full_vocab_slice", {"m": 8, "arch": "sm70"}),
            (GEMV, "test_gemv_tensor_core_edges", {"arch": "native"}),
            (GEMV, "test_gemv_small_n_and_k_tails", {"n": 130}),
        ),
    ),
    Mutant(
        "gemv-tensor-core-fp16-accumulation",
        "the tensor-core GEMV rounds its unit accumulators to fp16 after every mma (an fp16 "
        "instead of an fp32 accumulator)",
        (Edit("gemv/tensor_core.cuh", TC_MMA,
              r"\1 for (int r_ = 0; r_ < \2; ++r_) "
              r"cc[j % CH][r_] = __half2float(__float2half_rn(cc[j % CH][r_]));", 4),),
        (
            (GEMV, "test_gemv_model_shapes", {"name": "qkv_proj", "m": 4, "arch": "native"}),
            (GEMV, "test_gemv_model_shapes", {"name": "o_proj", "m": 8, "arch": "native"}),
            (GEMV, "test_gemv_model_shapes", {"name": "gate_up_proj", "m": 2, "arch": "sm70"}),
            (GEMV, "test_gemv_lm_head_full_vocab_slice", {"m": 2, "arch": "native"}),
            (GEMV, "test_gemv_lm_head_full_vocab_slice", {"m": 8, "arch": "sm70"}),
            (GEMV, "test_gemv_tensor_core_edges", {"arch": "native"}),
            (GEMV, "test_gemv_tensor_core_edges", {"arch": "sm70"}),
        ),
        (
            (GEMV, "test_gemv_model_shapes", {"name": "qkv_proj", "m": 1}),
            (GEMV, "test_gemv_small_n_and_k_tails", {"n": 17}),
        ),
    ),
    Mutant(
        "decode-mask-one-key-short",
        "paged decode's causal mask one key short, in the masked and the full-tile test alike "
        "(each query row loses its newest key)",
        (Edit(PD, FULL, "min(t_end, ctx - QN)", 1),
         Edit(PD, LIMIT, "ctx - QN + (sm_row % QN) - 1)", 1)),
        (
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [37], "qn": 1, "arch": "native"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [1000], "qn": 3, "arch": "sm70"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [40000], "qn": 4, "arch": "native"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [4097, 600, 33], "arch": "sm70"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [262144], "qn": 1, "arch": "native"}),
        ),
    ),
    Mutant(
        "decode-mask-limit-one-key-short",
        "the same in the masked tiles only (a context whose last tile is full, 262144 at one "
        "query row, never runs that branch: the other contexts must catch it)",
        (Edit(PD, LIMIT, "ctx - QN + (sm_row % QN) - 1)", 1),),
        (
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [37], "qn": 1, "arch": "native"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [40000], "qn": 4, "arch": "sm70"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [262144], "qn": 4, "arch": "native"}),
        ),
    ),
    Mutant(
        "decode-mask-one-key-ahead",
        "paged decode's causal mask one key long (each query row but the last sees the next "
        "query's token)",
        (Edit(PD, FULL, "min(t_end, ctx - QN + 2)", 1),
         Edit(PD, LIMIT, "ctx - QN + (sm_row % QN) + 1)", 1)),
        (
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [37], "qn": 4, "arch": "native"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [1000], "qn": 3, "arch": "sm70"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [4097, 600, 33], "arch": "native"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [262144], "qn": 4, "arch": "sm70"}),
        ),
        # one query row has no future: the same bug cannot show there
        (KV_CONTROL, (ATTN, "test_paged_decode_tail_dominated",
                      {"ctxs": [40000], "qn": 1, "arch": "native"})),
    ),
    Mutant(
        "decode-zero-output",
        "paged decode writes zeros (its normalisation factor is 0)",
        (Edit(PD,
              r"const float inv = lsum > 0\.f \? 1\.f / lsum : 0\.f;", "const float inv = 0.f;",
              1),),
        (
            (ATTN, "test_paged_decode_262k", {"qn": 1, "arch": "native"}),
            (ATTN, "test_paged_decode_262k", {"qn": 4, "arch": "sm70"}),
            (ATTN, "test_paged_decode", {"ctxs": [40000, 3, 900], "arch": "native"}),
        ),
    ),
    Mutant(
        "decode-tail-tokens-skipped",
        "paged decode (one sequence) never reads its last 4 tokens",
        (Edit(PD,
              r"w\.t_end = min\(w\.ctx, w\.t_begin \+ per_split\);",
              "w.t_end = min(w.ctx - 4, w.t_begin + per_split);", 1),),
        (
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [40000], "qn": 1, "arch": "native"}),
            (ATTN, "test_paged_decode_tail_dominated",
             {"ctxs": [262144], "qn": 4, "arch": "sm70"}),
        ),
    ),
    Mutant(
        "decode-packed-token-stride",
        "paged decode steps from token to token by 256 bytes (the packed layout's stride) "
        "instead of the cache's token stride: right on the packed cache, wrong on "
        "TRITON_ATTN's page of 260-byte rows",
        (Edit(PD, r"\(int64_t\)s\.y \* p\.kv_tok_stride", "(int64_t)s.y * 256", 1),),
        (
            (ATTN, "test_paged_decode",
             {"ctxs": [17], "qn": 2, "arch": "native", "kv_layout": "triton"}),
            (ATTN, "test_paged_decode",
             {"ctxs": [1000, 7, 4096], "arch": "sm70", "kv_layout": "triton"}),
        ),
        (KV_CONTROL, (ATTN, "test_paged_decode",
                      {"ctxs": [17], "qn": 2, "arch": "native", "kv_layout": "packed"})),
    ),
    Mutant(
        "kv-write-scale-at-row-start",
        "the KV write stores each scale at the codes' byte offset / 256 (the packed "
        "cache's scale index) instead of through the scale strides",
        (Edit("attention/kv_int8.cuh",
              r"const int64_t sc = blk \* st\.sc_blk \+ off \* st\.sc_tok \+ h \* st\.sc_head;",
              "const int64_t sc = (blk * st.blk + off * st.tok + h * st.head) / 256;", 1),),
        (
            (ATTN, "test_kv_int8_write", {"block_size": 64, "kv_layout": "triton"}),
            (ATTN, "test_kv_int8_write", {"block_size": 528, "kv_layout": "triton"}),
        ),
        # on the packed cache that offset is the scale's own: the mutant passes there
        ((ATTN, "test_kv_int8_write", {"block_size": 16, "kv_layout": "packed"}),),
    ),
    Mutant(
        "gdn-chunk-decay-one-token-late",
        "the chunked prefill's within-chunk cumulative decay G_i leaves out token i's own "
        "gate (an exclusive scan), so every decay is applied one token late; the scan is "
        "gdn/chunk_common.cuh's, shared with the two-pass prefill, so the bug is written after "
        "this kernel's call of it (G shifted by one token) and the two-pass kernel stays right",
        (Edit(GDN_CHUNK, GC_GATES_CALL, GC_EXCLUSIVE_SCAN, 1),),
        (
            (GDN_CHUNK_TEST, "test_gdn_chunk_lengths",
             {"length": 200, "init": True, "op": "one_pass"}),
            (GDN_CHUNK_TEST, "test_gdn_chunk_varlen_batch", {"heads": "tp2", "op": "one_pass"}),
        ),
        (KV_CONTROL, (GDN_CHUNK_TEST, "test_gdn_chunk_lengths",
                      {"length": 200, "init": True, "op": "two_pass"})),
    ),
    Mutant(
        "gdn-two-pass-decay-one-token-late",
        "the two-pass prefill's first pass scans the gates exclusively (each decay one token "
        "late) in the G it hands the state pass and in its own A, T and P (written after its "
        "call of the shared scan, as gdn-chunk-decay-one-token-late does in the one-pass kernel)",
        (Edit(GDN_TWO_PASS, GC_GATES_CALL, GC_EXCLUSIVE_SCAN, 1),),
        (
            (GDN_CHUNK_TEST, "test_gdn_chunk_lengths",
             {"length": 200, "init": True, "op": "two_pass"}),
            (GDN_CHUNK_TEST, "test_gdn_chunk_varlen_batch", {"heads": "tp2", "op": "two_pass"}),
        ),
        (KV_CONTROL, (GDN_CHUNK_TEST, "test_gdn_chunk_lengths",
                      {"length": 200, "init": True, "op": "one_pass"})),
    ),
    Mutant(
        "gdn-gqa-interleaved",
        "the recurrent decode maps value head hv to key head hv % H (an interleaved GQA "
        "layout) instead of hv / (HV / H)",
        (Edit(GDN_DECODE, r"const int h = hv / \(p\.num_v_heads / p\.num_k_heads\);",
              "const int h = hv % p.num_k_heads;", 1),),
        (
            (GDN, "test_gdn_recurrent_model_shapes",
             {"heads": "tp2", "mode": "decode", "state_dtype": "float32"}),
            (GDN, "test_gdn_recurrent_model_shapes",
             {"heads": "tp1", "mode": "mtp", "state_dtype": "int16"}),
        ),
    ),
    Mutant(
        "gdn-int16-scale-per-lane",
        "the int16 state store takes each lane's own max as the row's (no max over the "
        "row's 8 lanes), so the stored scale fits only lane 0's values",
        (Edit(GDN_DECODE, r"    amax = gdn_row_max\(amax\);\n", "", 1),),
        (
            (GDN, "test_gdn_recurrent_model_shapes",
             {"heads": "tp2", "mode": "mtp", "state_dtype": "int16"}),
            (GDN, "test_gdn_recurrent_model_shapes",
             {"heads": "tp1", "mode": "decode", "state_dtype": "int16"}),
        ),
        (KV_CONTROL, (GDN, "test_gdn_recurrent_model_shapes",
                      {"heads": "tp2", "mode": "mtp", "state_dtype": "float32"})),
    ),
    Mutant(
        "gdn-conv-update-ignores-accepted",
        "the conv update always reads its window from state row 0, as if every draft token "
        "had been rejected (num_accepted ignored)",
        (Edit(GDN_CONV,
              r"const int off = spec \? min\(max\(p\.num_accepted\[n\] - 1, 0\), "
              r"p\.state_rows - 3\) : 0;", "const int off = 0;", 1),),
        ((GDN, "test_gdn_conv1d_update", {"heads": "tp2", "mode": "mtp"}),
         (GDN, "test_gdn_conv1d_update", {"heads": "tp1", "mode": "mtp"})),
        (KV_CONTROL, (GDN, "test_gdn_conv1d_update", {"heads": "tp2", "mode": "decode"})),
    ),
    Mutant(
        "gdn-conv-prefill-chunk-window-shifted",
        "the conv prefill's later chunks read their window one token late (x[s-2..s] "
        "instead of x[s-3..s-1])",
        (Edit(GDN_CONV, r"win\[j\] = ld_h2\(x \+ \(int64_t\)\(s - 3 \+ j\)",
              "win[j] = ld_h2(x + (int64_t)(s - 2 + j)", 1),),
        ((GDN, "test_gdn_conv1d_prefill", {"lens": [1, 2, 3, 5, 64, 65, 200, 3000]}),
         (GDN, "test_gdn_conv1d_prefill", {"lens": [6000]})),
    ),
    Mutant(
        "fmha-mask-one-key-ahead",
        "the prefill attention's causal mask one key long (each query also sees the next "
        "token's key)",
        (Edit("attention/fmha_prefill.cuh", r"if \(j0 \+ c > sm_limit\)",
              "if (j0 + c > sm_limit + 1)", 1),),
        (
            (FMHA, "test_fmha_prefill_matches_reference",
             {"q_lens": [600], "ctxs": [0], "hq": 24, "layout": "heads_outer", "arch": "sm70"}),
            (FMHA, "test_fmha_prefill_matches_reference",
             {"q_lens": [129, 1, 300], "hq": 4, "layout": "page", "arch": "native"}),
        ),
        ((FMHA, "test_fmha_tc_peak_runs", {}),),  # the control: no attention in it
    ),
    Mutant(
        "fmha-ctx-word-loads-off-by-4",
        "the prefill attention's 4-byte context loads (TRITON_ATTN's 260-byte rows) start 4 "
        "bytes late: every code shifted by four dims, the last word read from the scale",
        (Edit("attention/fmha_prefill.cuh", r"reinterpret_cast<const unsigned\*>\(src\)",
              "reinterpret_cast<const unsigned*>(src + 4)", 1),),
        (
            (FMHA, "test_fmha_prefill_on_triton_attn_page",
             {"q_lens": [129, 1, 300], "hq": 24, "arch": "sm70"}),
            (FMHA, "test_fmha_prefill_on_triton_attn_page",
             {"q_lens": [77, 5, 600], "hq": 12, "arch": "native"}),
        ),
        # the control: the same kernel on 16-byte-aligned rows (its 16-byte loads)
        ((FMHA, "test_fmha_prefill_matches_reference",
          {"q_lens": [129, 1, 300], "hq": 24, "layout": "page", "arch": "sm70"}),),
    ),
)


def work_dir() -> Path:
    return Path(os.environ.get("SM70_MUTANTS_DIR", "/tmp/sm70_mutants"))


def apply_edits(csrc: Path, edits: tuple[Edit, ...]) -> None:
    for e in edits:
        path = csrc / e.path
        text = path.read_text()
        new, n = re.subn(e.pattern, e.replacement, text)
        if n != e.count:
            raise SystemExit(f"mutation {e.pattern!r} matched {n} times in {e.path}, "
                             f"expected {e.count}: update tests/gpu/mutants.py")
        path.write_text(new)


def prepare(m: Mutant) -> Path:
    from vllm_patch.ops import sources

    base = work_dir() / m.name
    shutil.rmtree(base / "csrc", ignore_errors=True)
    shutil.copytree(sources.csrc_dir(), base / "csrc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    apply_edits(base / "csrc", m.edits)
    return base


BUILD = ("import sys; from pathlib import Path; from vllm_patch.ops import build; "
         "print(build.build_library(Path(sys.argv[1]), Path(sys.argv[2])))")


def build_all(mutants: list[Mutant], jobs: int) -> dict[str, str]:
    """Build every mutant's library at once (one process each); returns name -> error."""
    procs = {}
    for m in mutants:
        base = prepare(m)
        shutil.rmtree(base / "lib", ignore_errors=True)
        env = {**os.environ, "MAX_JOBS": str(jobs), "PYTHONPATH": str(ROOT)}
        log = open(base / "build.log", "w")  # noqa: SIM115 (closed when the build ends)
        procs[m.name] = (subprocess.Popen(
            [sys.executable, "-c", BUILD, str(base / "lib"), str(base / "csrc")],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log)
    errors = {}
    for name, (proc, log) in procs.items():
        rc = proc.wait()
        log.close()
        if rc != 0:
            tail = (work_dir() / name / "build.log").read_text().splitlines()[-15:]
            errors[name] = f"build failed (rc {rc}): " + " | ".join(tail)
    return errors


def library(m: Mutant) -> Path | None:
    libs = sorted((work_dir() / m.name / "lib").glob("sm70_ops_*.so"))
    return libs[0] if len(libs) == 1 else None


class Select:
    """pytest plugin: keep the items a mutant names; record each one's outcome."""

    def __init__(self, specs: list[tuple[str, str, dict]]) -> None:
        self.specs = specs
        self.outcome: dict[str, str] = {}
        self.spec_of: dict[str, int] = {}

    def _match(self, item) -> int | None:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for i, (path, func, want) in enumerate(self.specs):
            if (item.path.as_posix().endswith(path) and item.originalname == func
                    and all(params.get(k) == v for k, v in want.items())):
                return i
        return None

    def pytest_collection_modifyitems(self, session, config, items) -> None:
        keep = []
        for item in items:
            i = self._match(item)
            if i is not None:
                keep.append(item)
                self.spec_of[item.nodeid] = i
        items[:] = keep

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed or (report.when == "call" and report.nodeid not in self.outcome):
            self.outcome[report.nodeid] = report.outcome
        elif report.skipped:
            self.outcome.setdefault(report.nodeid, "skipped")


def run_child(name: str, lib: Path) -> int:
    """In a fresh process: load the mutated library, run the mutant's tests, print JSON."""
    import pytest
    import torch

    torch.ops.load_library(str(lib))
    from gpu_common import arch_paths

    m = next(x for x in MUTANTS if x.name == name)
    paths = set(arch_paths())
    specs = [s for s in (*m.expect_fail, *m.expect_pass)
             if s[2].get("arch", "native") in paths]
    plugin = Select(specs)
    files = sorted({s[0] for s in specs})
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "-m", "gpu", *files],
                     plugins=[plugin])
    by_spec: dict[int, list[str]] = {}
    for node, i in plugin.spec_of.items():
        by_spec.setdefault(i, []).append(plugin.outcome.get(node, "not run"))
    nfail = len([s for s in m.expect_fail if s in specs])
    result = []
    for i, (path, func, want) in enumerate(specs):
        outcomes = by_spec.get(i, [])
        ran = [o for o in outcomes if o != "skipped"]  # e.g. M = 1 on the sm70 path
        expected = "failed" if i < nfail else "passed"
        ok = bool(ran) and all(o == expected for o in ran)
        result.append({"test": f"{Path(path).name}::{func}", "params": want,
                       "expected": expected, "outcomes": outcomes, "ok": ok})
    print("MUTANT-RESULT " + json.dumps({"pytest_rc": int(rc), "checks": result}), flush=True)
    return 0


def run_one(m: Mutant, build_errors: dict[str, str]) -> dict:
    entry = {"mutant": m.name, "what": m.what}
    lib = library(m)
    if m.name in build_errors or lib is None:
        error = build_errors.get(m.name, f"no library built in {work_dir() / m.name}")
        return {**entry, "ok": False, "error": error}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "--child", m.name, str(lib)],
        capture_output=True, text=True, timeout=1800, check=False, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k != "SM70_GPU_ERROR_LOG"},
             "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'gpu'}"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MUTANT-RESULT ")]
    if not lines:
        return {**entry, "ok": False, "error": (proc.stdout + proc.stderr)[-3000:]}
    res = json.loads(lines[-1].removeprefix("MUTANT-RESULT "))
    ok = bool(res["checks"]) and all(c["ok"] for c in res["checks"])
    print(f"{m.name}: {'killed' if ok else 'NOT KILLED / control failed'}", flush=True)
    return {**entry, "ok": ok, "seconds": round(time.monotonic() - start, 1), **res,
            **({} if ok else {"log_tail": proc.stdout[-4000:]})}


def run_all(mutants: list[Mutant], build_errors: dict[str, str], parallel: int) -> list[dict]:
    """Each mutant's tests in its own process, `parallel` at a time on the one GPU."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(lambda m: run_one(m, build_errors), mutants))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="mutant names (default: all)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--run-only", action="store_true", help="reuse the libraries built before")
    ap.add_argument("--jobs", type=int, default=4, help="compile jobs per mutant build")
    ap.add_argument("--parallel", type=int, default=1, help="mutant test processes at once")
    ap.add_argument("--out", type=Path, default=None, help="JSON summary")
    ap.add_argument("--child", nargs=2, metavar=("NAME", "LIB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args.child[0], Path(args.child[1]))
    names = {m.name for m in MUTANTS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        ap.error(f"unknown mutant {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    mutants = [m for m in MUTANTS if args.only is None or m.name in args.only]
    errors: dict[str, str] = {}
    if not args.run_only:
        errors = build_all(mutants, args.jobs)
        for name, err in errors.items():
            print(f"{name}: {err}", flush=True)
        if args.build_only:
            return 1 if errors else 0
    summary = run_all(mutants, errors, args.parallel)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    killed = sum(s["ok"] for s in summary)
    print(f"mutants: {killed} of {len(summary)} killed with their controls passing", flush=True)
    return 0 if killed == len(summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
