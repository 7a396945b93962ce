"""The SM70 attention backend on the GPU (issue 22 items 2, 3, 5), one device call:

1. pytest tests/gpu/test_attention_gpu.py: the KV write and paged decode against their
   references on the packed cache and on TRITON_ATTN's page, both arch paths; then
   layout_cost.py: the decode's time on the two layouts (what 260-byte rows cost);
   with --decode-bench also bench/bench_attention_decode.py (our decode against vLLM's
   Triton decode on the same int8 page, 4K-262K tokens; recorded, not in the verdict);
   beside them, with budget, the mutant fmha-ctx-word-loads-off-by-4 (tests/gpu/mutants.py:
   the FMHA tests on TRITON_ATTN's page must kill it; recorded, not in the verdict);
2. an A/B on the tiny checkpoint (tests/gpu/ab machinery): stock vLLM 0.22.1 (TRITON_ATTN)
   against ours (the plugin, `--attention-backend CUSTOM`), both on the same fp16 weights so
   the attention backend is the only difference (the fp16 checkpoint has no GPTQ layer, so
   sm70_gptq does not run; the GDN override is off by default). Three sets of sides:
   - `--set mtp` (the default, four engines through mtp_side.py, all CUDA graphs
     FULL_AND_PIECEWISE, max_model_len 33,792, 2,048-token steps): what `sm70ctl serve`
     runs, MTP k=3 with prefix caching (align; R7, R8 and the n-gram assist on through the
     plugin's defaults), capture sizes 4..64 (1-16 sequences of 1 + 3 rows): stock
     TRITON_ATTN (`stock_mtp`), ours SM70_PAGED with Triton prefill (`ours_mtp`), ours with
     the FMHA prefill on the Volta m8n8k4 instantiations (`fmha_mtp`), and ours without
     speculation or prefix caching (`ours_plain`, capture sizes 1-16). Phases: ~100, ~4K and
     ~32.7K-token prompts, 8 short prompts decoding beside 3 long ones' chunks, the 32K
     prompt's first 32,000 tokens again (a ~60-block cache hit), shared prefixes around the
     528-token block, and a 512-token continuation where the assist's drafts can be
     accepted. Judged: ours_mtp and fmha_mtp against ours_plain strictly (device_spec_diag's
     rule: speculation and prefix caching must not change greedy tokens), and against
     stock_mtp with compare.py's noise rule on the requests stock did not serve from its
     cache (stock 0.22.1 loses tokens there, bug B of docs/spec_decode.md; stock against
     plain is reported as `stock_mtp_vs_plain`, not judged). A side counts only with its
     evidence (mtp_check): the model's and the drafter's attention on the expected backend;
     for ours the target's verification steps (1 + 3 rows) on our decode alone and beside
     prefill rows of its prefill kernel and never the other kernel (step_kinds.py counts the
     builder's splits, graph replays included), some request served from the cache.
     `served_by` in summary.json gives, per side and phase, the kernel calls and step kinds.
   - `--set fmha` (four engines): ours with SM70_PREFILL_ATTENTION=cutlass_fmha
     (plugin config), so prefill chunks run torch.ops.sm70.fmha_prefill on TRITON_ATTN's
     260-byte-row page, against stock, eager (ours on the Volta m8n8k4 instantiations,
     prefix caching on for both sides) and graphs (FULL_AND_PIECEWISE, capture sizes 1-16,
     the H200's own path); fmha_side.py's phases: a ~100-token prompt, a ~4K-token prompt
     chunked by 1024-token steps, 8 short prompts decoding beside 3 long ones' prefill
     chunks, and (eager) shared prefixes around the block size. A side passes only if every
     prefill ran on the FMHA (Python and device counters), none on Triton, and some step
     mixed decode rows with FMHA prefill rows.
   - `--set triton` (six engines, the default route): eager, graphs and one pair with prefix
     caching on (align mode, eager, Volta instantiations); ab_side.py's phases: single
     prompts of 5-33 tokens, batch4, the batch16 mix, one ~100- and one ~3000-token prompt.

    python3 tests/gpu/attention/device_backend_ab.py --out DIR --budget-s N [--set fmha|triton]

Env (the lead's round_call.sh): SM70_AB_TINY (/tmp/ab/tiny, holding fp16/), SM70_SITE,
SM70_KERNELS_BUILD_DIR, TORCH_CUDA_ARCH_LIST, SM70_GPU_SHARE (this script's share of the GPU
memory: the set's engines split it). Every step writes its JSON when it finishes; a failed
step is recorded and the rest go on. summary.json: passed (pytest passed, every comparison
passed, every ours side ran its attention layers on Sm70PagedBackend and its decode op, and
on the fmha set its FMHA prefill as above, on the mtp set mtp_check's evidence, every stock
side on TritonAttentionBackend), the comparisons and the figures behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
AB = ROOT / "tests" / "gpu" / "ab"
SERVING = ROOT / "tests" / "gpu" / "serving"
HERE = Path(__file__).resolve().parent
for _p in (str(AB), str(SERVING)):  # compare.py, run_ab.py, device_spec_diag.py (pure)
    if _p not in sys.path:
        sys.path.insert(0, _p)
OURS_CLASS = "vllm_patch.attention.backend.Sm70PagedBackend"
STOCK_CLASS = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
PHASES = "single,batch4,batch16,p100,p3000"  # the triton set's ab_side phases
MUTANT = "fmha-ctx-word-loads-off-by-4"
MUTANT_MIN_S = 300  # a whole-extension build, then its tests: not started with less left

# per set: the side runner and name: (side, mode, extra runner arguments)
RUNNERS = {"fmha": HERE / "fmha_side.py", "triton": AB / "ab_side.py",
           "mtp": HERE / "mtp_side.py"}
KV_GIB = {"fmha": 1, "triton": 1, "mtp": 2}  # mtp: room for the 32K prompt beside the rest
MTP = ["--spec", "mtp3", "--prefix-caching"]
SETS: dict[str, dict[str, tuple[str, str, list[str]]]] = {
    "fmha": {
        # eager with prefix caching (align mode: the 528-token block within a step)
        "stock_eager": ("stock", "eager", ["--prefix-caching"]),
        "fmha_eager": ("ours", "eager", ["--fmha", "--arch-path", "sm70", "--prefix-caching"]),
        "stock_graphs": ("stock", "graphs", []),
        "fmha_graphs": ("ours", "graphs", ["--fmha"]),
    },
    "triton": {
        "stock_eager": ("stock", "eager", ["--phases", PHASES]),
        "ours_eager": ("ours", "eager", ["--phases", PHASES, "--attention-backend", "CUSTOM"]),
        "stock_graphs": ("stock", "graphs", ["--phases", PHASES]),
        "ours_graphs": ("ours", "graphs", ["--phases", PHASES, "--attention-backend",
                                           "CUSTOM"]),
        # align mode needs the block (528 tokens on tiny) within one step's tokens
        "stock_prefix": ("stock", "eager", ["--phases", PHASES, "--prefix-caching",
                                            "--max-batched", "1024"]),
        "ours_prefix": ("ours", "eager", ["--phases", PHASES, "--prefix-caching",
                                          "--max-batched", "1024", "--attention-backend",
                                          "CUSTOM", "--arch-path", "sm70"]),
    },
    # MTP k=3 with prefix caching (align), graphs: what `sm70ctl serve` runs
    "mtp": {
        "stock_mtp": ("stock", "graphs", MTP),
        "ours_mtp": ("ours", "graphs", MTP),
        # the FMHA route on the Volta m8n8k4 instantiations (the decode too)
        "fmha_mtp": ("ours", "graphs", [*MTP, "--fmha", "--arch-path", "sm70"]),
        # plain decoding, no prefix caching: what speculation must reproduce
        "ours_plain": ("ours", "graphs", []),
    },
}
# pairs are compared stock -> ours
PAIR_SETS = {
    "fmha": {"fmha_eager": ("stock_eager", "fmha_eager"),
             "fmha_graphs": ("stock_graphs", "fmha_graphs")},
    "triton": {"eager": ("stock_eager", "ours_eager"), "graphs": ("stock_graphs", "ours_graphs"),
               "prefix_caching": ("stock_prefix", "ours_prefix")},
    "mtp": {"ours_vs_stock": ("stock_mtp", "ours_mtp"), "fmha_vs_stock": ("stock_mtp", "fmha_mtp"),
            "ours_vs_plain": ("ours_plain", "ours_mtp"),
            "fmha_vs_plain": ("ours_plain", "fmha_mtp")},
}
# judged strictly (device_spec_diag.strict): speculation and prefix caching must not change
# greedy tokens; the pairs against stock skip the requests stock served from its prefix
# cache, where stock 0.22.1 loses tokens itself (bug B, docs/spec_decode.md)
PLAIN_PAIRS = ("ours_vs_plain", "fmha_vs_plain")
MTP_REQUIRED = ("p100", "mix", "p4k", "p32k", "p32k_hit", "prefix")  # "loop" is extra
MTP_ROLES = {"stock_mtp": "stock", "ours_mtp": "triton", "fmha_mtp": "fmha",
             "ours_plain": "plain"}
SIDES = SETS["triton"]  # the names the earlier results use
PAIRS = PAIR_SETS["triton"]


def backend_check(side: dict[str, Any], want: str, ours: bool,
                  fmha: bool = False) -> dict[str, Any]:
    """Did this side's attention layers run on `want`, and (ours) did our decode op run?
    A side that fell back to TRITON_ATTN, or never reached our decode, fails. fmha: also
    every prefill on torch.ops.sm70.fmha_prefill (Python and device counters), none on
    vLLM's Triton, and at least one step with decode rows beside FMHA prefill rows."""
    layers = side.get("attention_layers") or {}
    classes = sorted({k.split(":")[0] for k in layers})
    out: dict[str, Any] = {"classes": classes, "layers": sum(layers.values())}
    ok = bool(layers) and classes == [want]
    if ours:
        calls = side.get("attention_calls") or {}
        dev_counts = side.get("attention_device") or {}
        device = dev_counts.get("decode", side.get("attention_device_decodes"))
        out.update(calls=calls, device_decodes=device)
        ok = ok and calls.get("decode", 0) > 0 and calls.get("kv_write", 0) > 0
        ok = ok and device is not None and device > 0
        if fmha:
            dev_fmha = dev_counts.get("prefill_fmha")
            out.update(device_prefill_fmha=dev_fmha, prefill_kernel=side.get("prefill_kernel"))
            ok = ok and side.get("prefill_kernel") == "cutlass_fmha"
            ok = ok and calls.get("prefill_fmha", 0) > 0 and calls.get("prefill_triton", 0) == 0
            ok = ok and calls.get("prefill_fmha_beside_decode", 0) > 0
            ok = ok and dev_fmha is not None and dev_fmha > 0
    out["ok"] = ok
    return out


def junit_counts(path: Path) -> dict[str, Any]:
    """tests / failures / errors / skipped of a pytest junit file, and the failed ids."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    out: dict[str, Any] = {k: sum(int(s.get(k, 0)) for s in suites)
                           for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites
                     for c in s.iter("testcase")
                     if c.find("failure") is not None or c.find("error") is not None][:40]
    return out


def verdict(pytest_res: dict[str, Any] | None, checks: dict[str, dict[str, Any]],
            comparisons: dict[str, dict[str, Any]], which: str = "triton",
            tests_asked: bool = True) -> bool:
    """passed: the GPU tests passed with none skipped (unless the run was asked to skip
    them, --skip-pytest: they ran in another job), every pair of the set compared and
    passed, and every side of the set ran on the backend it should."""
    tests_ok = not tests_asked or (
        pytest_res is not None and pytest_res.get("rc") == 0
        and pytest_res.get("tests", 0) > 0 and pytest_res.get("skipped", 1) == 0)
    pairs_ok = set(comparisons) == set(PAIR_SETS[which]) and all(
        c.get("passed") for c in comparisons.values())
    sides_ok = set(checks) == set(SETS[which]) and all(c["ok"] for c in checks.values())
    return bool(tests_ok and pairs_ok and sides_ok)


def side_util(share: float, engines: int = len(SIDES)) -> float:
    """gpu_memory_utilization of one engine: the script's share over its engines."""
    # three quarters: the kernel tests run beside the engines (their references at 262K
    # tokens hold a few GB); with kv_cache_memory_bytes set, vLLM only checks that this
    # much is free at start-up
    return round(max(0.03, min(0.18, 0.75 * share / engines)), 3)


def side_command(which: str, name: str, model: Path, out: Path, util: float) -> list[str]:
    """The runner command of one side of a set."""
    side, mode, extra = SETS[which][name]
    return [sys.executable, str(RUNNERS[which]), "--side", side, "--mode", mode,
            "--model", str(model), "--out", str(out / "sides" / f"{name}.json"),
            "--util", str(util), "--kv-gib", str(KV_GIB[which]), *extra]


def mutant_result(path: Path) -> dict[str, Any]:
    """The mutant run's verdict from mutants.py's JSON (a list of one entry)."""
    try:
        (entry,) = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"killed": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"killed": bool(entry.get("ok")), "checks": entry.get("checks"),
            "error": entry.get("error")}


# ------------------------------------------------------------------ the MTP set (pure)
def common_phases(sides: dict[str, dict[str, Any]]) -> list[str]:
    """The phases every side finished, in the first side's order (a side killed at the
    budget keeps what it wrote; the pairs are judged on what all of them have)."""
    names = list(sides.values())
    if not names:
        return []
    first = list(names[0].get("phases") or {})
    return [p for p in first if all(p in (s.get("phases") or {}) for s in names)]


def only_phases(side: dict[str, Any], phases: list[str]) -> dict[str, Any]:
    return dict(side, phases={p: side["phases"][p] for p in phases})


def drop_cache_hits(ref: dict[str, Any], sut: dict[str, Any]) -> tuple[
        dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Both sides without the requests the reference served from its prefix cache
    (num_cached_tokens > 0), and which those were."""
    dropped: list[dict[str, Any]] = []
    rp: dict[str, list[Any]] = {}
    sp: dict[str, list[Any]] = {}
    for phase, rows in ref["phases"].items():
        other = sut["phases"][phase]
        keep = []
        for i, row in enumerate(rows):
            if (row.get("num_cached_tokens") or 0) > 0:
                dropped.append({"phase": phase, "request": i,
                                "cached": row["num_cached_tokens"]})
            else:
                keep.append(i)
        rp[phase] = [rows[i] for i in keep]
        sp[phase] = [other[i] for i in keep] if len(other) == len(rows) else other
    return dict(ref, phases=rp), dict(sut, phases=sp), dropped


def judge_mtp(sides: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each pair of the MTP set on the phases both of its sides finished: against plain
    decoding strictly; against stock with compare.py's noise rule on the requests stock did
    not serve from its cache. A pair fails when a required phase is missing."""
    from compare import compare_sides
    from device_spec_diag import strict

    ok = {n: s for n, s in sides.items() if s.get("phases")}
    out: dict[str, dict[str, Any]] = {}
    for pair, (ref_name, sut_name) in PAIR_SETS["mtp"].items():
        if ref_name not in ok or sut_name not in ok:
            continue
        phases = common_phases({"ref": ok[ref_name], "sut": ok[sut_name]})
        missing = [p for p in MTP_REQUIRED if p not in phases]
        ref, sut = only_phases(ok[ref_name], phases), only_phases(ok[sut_name], phases)
        if pair in PLAIN_PAIRS:
            c = compare_sides(ref, sut)
            res = strict(c) | {"noise_rule_passed": c["passed"],
                               "divergences": c["divergences"]}
        else:
            ref, sut, dropped = drop_cache_hits(ref, sut)
            c = compare_sides(ref, sut)
            res = {k: v for k, v in c.items() if k != "phases"} | {"stock_hits_skipped": dropped}
            res["per_request"] = {ph: [{k: r[k] for k in ("prompt_len", "equal",
                                                         "max_abs_dlogprob")} for r in rs]
                                  for ph, rs in c["phases"].items()}
        res["phases_judged"] = phases
        res["missing_required"] = missing
        res["passed"] = bool(res["passed"]) and not missing
        out[pair] = res
    return out


def stock_loss(sides: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Stock MTP + prefix caching against our plain decoding, strictly (not in the verdict:
    it shows where stock itself loses, which the pairs against stock skip)."""
    from compare import compare_sides
    from device_spec_diag import strict

    ref, sut = sides.get("ours_plain"), sides.get("stock_mtp")
    if not ref or not sut or not ref.get("phases") or not sut.get("phases"):
        return None
    phases = common_phases({"a": ref, "b": sut})
    c = compare_sides(only_phases(ref, phases), only_phases(sut, phases))
    hits = [(ph, i) for ph in phases for i, r in enumerate(sut["phases"][ph])
            if (r.get("num_cached_tokens") or 0) > 0]
    return strict(c) | {"stock_cache_hits": len(hits),
                        "lost_on_stock_hits": sum((d["phase"], d["request"]) in hits
                                                  for d in c["divergences"])}


def progress(path: Path) -> dict[str, Any] | None:
    """A running side's start-up time, finished phases and error, from its JSON."""
    try:
        side = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {"startup_s": side.get("startup_s"), "phases": list(side.get("phases") or {}),
            "error": side.get("error")}


def _classes(layers: dict[str, int] | None) -> list[str]:
    return sorted({k.split(":")[0] for k in (layers or {})})


def mtp_check(side: dict[str, Any], role: str) -> dict[str, Any]:
    """Did this MTP-set side run what it should? stock: TRITON_ATTN for the model and the
    drafter, MTP k=3 and prefix caching. ours (triton / fmha): backend_check's evidence,
    the drafter on our backend too, the target's verification steps (1 + 3 rows) on our
    decode both alone and beside prefill rows of its prefill kernel, only that kernel for
    prefill, and some request served from the prefix cache. plain: our decode on 1-row
    steps, no drafter."""
    eng = side.get("engine") or {}
    spec = eng.get("speculative") or {}
    kinds = (side.get("step_kinds") or {}).get("target", {})
    calls = side.get("attention_calls") or {}
    hits = sum((r.get("num_cached_tokens") or 0) > 0
               for rows in (side.get("phases") or {}).values() for r in rows)
    out: dict[str, Any] = {"role": role, "speculative": spec or None,
                           "prefix_caching": eng.get("enable_prefix_caching"),
                           "drafter_classes": _classes(side.get("drafter_attention")),
                           "target_step_kinds": kinds, "cache_hit_requests": hits}
    if role == "plain":
        base = backend_check(side, OURS_CLASS, True)
        ok = base["ok"] and not spec and kinds.get("decode_q1", 0) > 0
        ok = ok and side.get("drafter_attention") is None
    else:
        want = STOCK_CLASS if role == "stock" else OURS_CLASS
        base = backend_check(side, want, role != "stock", fmha=role == "fmha")
        ok = base["ok"] and spec.get("method") == "mtp" and spec.get(
            "num_speculative_tokens") == 3 and eng.get("enable_prefix_caching") is True
        ok = ok and out["drafter_classes"] == [want] and hits > 0
        if role != "stock":
            kernel = "cutlass_fmha" if role == "fmha" else "triton"
            ok = ok and side.get("prefill_kernel") == kernel
            ok = ok and kinds.get("decode_q4", 0) > 0
            ok = ok and kinds.get(f"decode_q4+prefill:{kernel}", 0) > 0
            ok = ok and not any(k.endswith(f"prefill:{other}") for k in kinds
                                for other in ("triton", "cutlass_fmha") if other != kernel)
            if role == "triton":
                ok = ok and calls.get("prefill_triton", 0) > 0 and calls.get(
                    "prefill_fmha", 0) == 0
            else:
                ok = ok and side.get("arch_path") == "sm70"
    out.update({k: v for k, v in base.items() if k != "ok"}, ok=bool(ok))
    return out


def _minus(after: Any, before: Any) -> Any:
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        d = {k: _minus(v, before.get(k)) for k, v in after.items()}
        return {k: v for k, v in d.items() if v not in (0, {}, None)}
    if isinstance(after, int | float) and isinstance(before, int | float):
        return after - before
    return after if before is None else None


def served_by(side: dict[str, Any]) -> dict[str, Any]:
    """Per phase, what the phase added to the backend's counters and step kinds: which
    kernel served which kind of step there."""
    out: dict[str, Any] = {}
    prev: dict[str, Any] = {"calls": side.get("calls_after_startup") or {},
                            "step_kinds": side.get("step_kinds_after_startup") or {}}
    for phase, snap in (side.get("calls_by_phase") or {}).items():
        out[phase] = _minus(snap, prev)
        prev = snap
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--skip-ab", action="store_true")
    ap.add_argument("--decode-bench", action="store_true",
                    help="also run bench/bench_attention_decode.py (ours vs Triton decode)")
    ap.add_argument("--set", choices=sorted(SETS), default="mtp", dest="which",
                    help="mtp: MTP k=3 + prefix caching, graphs, prompts up to 32K, ours "
                    "(both prefill kernels) vs stock and vs plain decoding (4 engines); "
                    "fmha: ours with SM70_PREFILL_ATTENTION=cutlass_fmha (4 engines); "
                    "triton: the default prefill route with prefix caching (6 engines)")
    ap.add_argument("--skip-mutant", action="store_true")
    a = ap.parse_args()
    sides_of, pairs_of = SETS[a.which], PAIR_SETS[a.which]
    t0 = time.time()
    deadline = t0 + a.budget_s - 25  # leave time to compare and write
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "sides").mkdir(exist_ok=True)
    summary: dict[str, Any] = {"passed": None, "started": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": a.budget_s, "set": a.which,
        "errors": {}}

    def flush() -> None:
        summary["elapsed_s"] = round(time.time() - t0, 1)
        tmp = out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(out / "summary.json")

    flush()
    sys.path.insert(0, str(AB))
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Any] = {}
    try:
        from run_ab import side_env

        tiny = Path(os.environ.get("SM70_AB_TINY", "/tmp/ab/tiny"))
        share = float(os.environ.get("SM70_GPU_SHARE", "0.3"))
        util = side_util(share, len(sides_of))
        summary["engine"] = {"checkpoint": str(tiny / "fp16"), "util_each": util,
                             "kv_gib": KV_GIB[a.which], "runner": RUNNERS[a.which].name,
                             "phases": {"triton": PHASES, "mtp": "p100,mix,p4k,p32k,"
                                        "p32k_hit,prefix,loop",
                                        "fmha": "p100,p4k,mix (+prefix on the eager pair)"}[
                                            a.which]}
        if not a.skip_ab:
            for name, (side, _mode, _extra) in sides_of.items():
                cmd = side_command(a.which, name, tiny / "fp16", out, util)
                env = side_env(side, {"VLLM_CACHE_ROOT": f"/tmp/vc_attn_{a.which}_{name}"})
                logs[name] = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed below)
                procs[name] = subprocess.Popen(cmd, env=env, stdout=logs[name],
                                               stderr=subprocess.STDOUT, cwd="/tmp")
            summary["sides_started_s"] = round(time.time() - t0, 1)
            flush()
    except Exception as exc:
        summary["errors"]["ab_start"] = f"{type(exc).__name__}: {exc}"
        summary["errors"]["ab_start_tb"] = traceback.format_exc()[-3000:]
        flush()

    # 0. the FMHA context-load mutant, built at low priority beside everything else
    mutant: subprocess.Popen | None = None
    mutant_log = None
    if not a.skip_mutant and deadline - time.time() > MUTANT_MIN_S:
        try:
            menv = dict(os.environ, SM70_MUTANTS_DIR="/tmp/sm70_mutants_attn")
            mutant_log = open(out / "mutant.log", "w")  # noqa: SIM115 (closed below)
            mutant = subprocess.Popen(
                ["nice", "-n", "15", sys.executable, str(ROOT / "tests/gpu/mutants.py"),
                 "--only", MUTANT, "--jobs", "2", "--out", str(out / "mutant.json")],
                cwd=ROOT, env=menv, stdout=mutant_log, stderr=subprocess.STDOUT)
        except Exception as exc:
            summary["errors"]["mutant_start"] = f"{type(exc).__name__}: {exc}"

    # 1. the kernel tests, beside the engines' start-up (they need little GPU memory)
    pytest_res: dict[str, Any] | None = None
    if not a.skip_pytest:
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"]
                                             if env.get("PYTHONPATH") else "")
            junit = out / "attention_gpu_junit.xml"
            t = time.time()
            with open(out / "attention_gpu_pytest.log", "w") as fh:
                r = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--noconftest",
                     "-p", "no:cacheprovider", "-rf", f"--junitxml={junit}",
                     "tests/gpu/test_attention_gpu.py"],
                    cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                    timeout=max(30, deadline - time.time()), check=False)
            pytest_res = {"rc": r.returncode, "seconds": round(time.time() - t, 1)}
            if junit.exists():
                pytest_res.update(junit_counts(junit))
        except Exception as exc:
            pytest_res = {"rc": None, "error": f"{type(exc).__name__}: {exc}"}
        summary["pytest"] = pytest_res
        flush()
    else:
        summary["pytest"] = "skipped (--skip-pytest: the GPU tests run in another job)"

    # 1b. what TRITON_ATTN's 260-byte rows cost the decode (timed beside the engines:
    # the ratio of the two layouts, timed alternately, is the figure)
    if not a.skip_pytest and time.time() < deadline - 60:
        try:
            r = subprocess.run([sys.executable, str(Path(__file__).parent / "layout_cost.py"),
                                "--out", str(out / "layout_cost.json"), "--quick"],
                               cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=max(20, min(120, deadline - time.time() - 30)),
                               check=False)
            cost = json.loads((out / "layout_cost.json").read_text())
            summary["layout_cost"] = {"rc": r.returncode, "errors": cost.get("errors"),
                                      "rows": cost.get("rows"),
                                      "fmha_rows": cost.get("fmha_rows")}
        except Exception as exc:
            summary["layout_cost"] = {"error": f"{type(exc).__name__}: {exc}"}
        flush()

    # 1c. optional: our decode against vLLM's Triton decode on the same int8 page (not
    # part of the verdict; beside the engines, so its times are for the ratio only)
    if a.decode_bench and time.time() < deadline - 90:
        try:
            bench = ROOT / "bench" / "bench_attention_decode.py"
            r = subprocess.run([sys.executable, str(bench), "--out",
                                str(out / "attention_decode.json")],
                               cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                               timeout=max(30, min(400, deadline - time.time() - 60)),
                               check=False)
            res = json.loads((out / "attention_decode.json").read_text())
            summary["attention_decode_bench"] = {
                "rc": r.returncode, "errors": res.get("errors"), "rows": len(res["rows"]),
                "ours_faster_everywhere": res.get("ours_faster_everywhere"),
                "worst": res.get("worst")}
        except Exception as exc:
            summary["attention_decode_bench"] = {"error": f"{type(exc).__name__}: {exc}"}
        flush()

    # 2. the A/B: wait for the sides (what each has done so far goes into summary.json, so
    # a call stopped from outside still says where each side was), then compare
    last = 0.0
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(5)
        if time.time() - last > 20:
            last = time.time()
            summary["progress"] = {n: progress(out / "sides" / f"{n}.json") for n in procs}
            flush()
    for name, p in procs.items():
        if p.poll() is None:
            p.kill()
            p.wait()
            summary["errors"][name] = "killed at the budget"
        logs[name].close()
    summary["side_rc"] = {n: p.returncode for n, p in procs.items()}
    if mutant is not None:
        try:
            mutant.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            mutant.kill()
            mutant.wait()
            summary["errors"]["mutant"] = "killed at the budget"
        if mutant_log is not None:
            mutant_log.close()
        summary["mutant"] = {"name": MUTANT, "rc": mutant.returncode,
                             **mutant_result(out / "mutant.json")}
        flush()
    try:
        from compare import compare_sides

        sides: dict[str, dict[str, Any]] = {}
        for name in procs:
            f = out / "sides" / f"{name}.json"
            try:
                sides[name] = json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                sides[name] = {"error": f"no output: {exc}"}
        summary["sides"] = {n: {k: s.get(k) for k in (
            "error", "startup_s", "total_s", "cudagraph_mode", "capture_sizes", "arch_path",
            "attention_layers", "attention_calls", "attention_device_decodes",
            "attention_device", "prefill_kernel", "block_size", "plugin", "phase_seconds",
            "max_memory_allocated", "engine", "step_kinds", "drafter_attention",
            "phase_errors", "drafter_attention_error")} for n, s in sides.items()}
        for n, s in sides.items():
            if s.get("traceback"):
                summary["sides"][n]["traceback"] = s["traceback"][-2500:]
        if a.which == "mtp":
            checks = {n: mtp_check(s, MTP_ROLES[n]) for n, s in sides.items()}
            summary["served_by"] = {n: served_by(s) for n, s in sides.items()
                                    if MTP_ROLES[n] != "stock"}
            summary["spec_counters"] = {n: s.get("counters_by_phase") for n, s in sides.items()}
        else:
            checks = {n: backend_check(s, OURS_CLASS if sides_of[n][0] == "ours"
                                       else STOCK_CLASS, sides_of[n][0] == "ours",
                                       a.which == "fmha")
                      for n, s in sides.items()}
        summary["backend_checks"] = checks
        if a.which == "fmha":  # the evidence that our FMHA op ran, side by side
            summary["fmha_evidence"] = {
                n: {k: c.get(k) for k in ("prefill_kernel", "device_prefill_fmha",
                                          "device_decodes")}
                | {k: (c.get("calls") or {}).get(k) for k in (
                    "prefill_fmha", "prefill_fmha_beside_decode", "prefill_triton")}
                for n, c in checks.items() if sides_of[n][0] == "ours"}
        comps: dict[str, dict[str, Any]] = {}
        if a.which == "mtp":
            comps = judge_mtp(sides)
            summary["stock_mtp_vs_plain"] = stock_loss(sides)
        for pair, (ref, sut) in pairs_of.items():
            if a.which != "mtp" and ref in sides and sut in sides \
                    and not sides[ref].get("error") and not sides[sut].get("error"):
                comps[pair] = compare_sides(sides[ref], sides[sut])
        if "stock_eager" in sides and "stock_graphs" in sides:
            noise = compare_sides(sides["stock_eager"], sides["stock_graphs"])
            summary["stock_graphs_vs_stock_eager"] = {k: v for k, v in noise.items()
                                                      if k != "phases"}
        summary["comparisons"] = {k: {kk: vv for kk, vv in v.items() if kk != "phases"}
                                  for k, v in comps.items()}
        if a.which != "mtp":
            summary["per_request"] = {
                k: {ph: [{kk: r[kk] for kk in ("prompt_len", "equal", "max_abs_dlogprob")}
                         for r in rs] for ph, rs in v["phases"].items()}
                for k, v in comps.items()}
        summary["passed"] = verdict(pytest_res, checks, comps, a.which,
                                    tests_asked=not a.skip_pytest)
    except Exception as exc:
        summary["errors"]["compare"] = f"{type(exc).__name__}: {exc}"
        summary["errors"]["compare_tb"] = traceback.format_exc()[-3000:]
        summary["passed"] = False
    flush()
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
