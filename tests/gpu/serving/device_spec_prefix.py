"""Prefix caching and speculation on our stack against plain decoding (issue 24 items 2-4).

Run on the GPU machine by the lead's round call, from the repository root:

    python3 tests/gpu/serving/device_spec_prefix.py --out $OUT_DIR --budget-s N

after the plugin is installed into $SM70_SITE, our ops are built and the tiny A/B
checkpoint (it carries the MTP tensors) is in $SM70_AB_TINY. Three engines, each in its own
process (spec_engine.py), all on our plugin and the int8 copy, started at once:
  E0  no speculation, prefix caching off: the reference output;
  E1  MTP k=3, prefix caching on, mamba_cache_mode align (the launcher's), FULL_AND_PIECEWISE
      with capture sizes 4..64 (1-16 sequences x 4 tokens);
  E2  vLLM's n-gram speculation k=3 (n 2..8), prefix caching on.
The first of E1/E2 to report its block size decides the stage-1 prompts (spec_cases.py
says which and why); E0's output of the seed request decides the stage-2 prompts. Then
E1 and E2 are compared with E0 phase by phase (compare.compare_sides), the truncation
requests are checked for length, vLLM's cache hits are read per request, and the n-gram
cases' acceptance is taken from vLLM's spec-decode counters (and, for comparison, from a
simulation of the n-gram rule on E0's tokens). Everything lands in $OUT_DIR/summary.json
(rewritten as it goes) beside engines.json (every row) and logs.txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parents[0] / "ab"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))  # this driver runs no vLLM: our n-gram rule is read from here
import spec_cases as sc  # noqa: E402
import spec_rules as rules  # noqa: E402
from compare import compare_sides  # noqa: E402
from device_io import (  # noqa: E402
    atomic_write,
    engine_share,
    finish,
    fresh_plan_dir,
    launch,
    log,
    snapshot,
    stop,
    summary_writer,
    utc_stamp,
    watch,
)
from run_ab import side_env, start  # noqa: E402

from vllm_patch.spec_decode import ngram  # noqa: E402

KV_BYTES = 1 << 30
# Leave time to compare and write after the engines are stopped.
MARGIN_S = 25


def acceptance_report(engines: dict[str, dict[str, Any]], prompts: dict[str, list[int]]
                      ) -> dict[str, Any]:
    """Per stage-2 case: what vLLM's counters say for E1 (MTP) and E2 (n-gram), and what
    the two n-gram rules (vLLM's, ours) would accept on the reference's (E0's) tokens."""
    out: dict[str, Any] = {"measured": {}, "predicted_from_E0": {}}
    for name in ("E1", "E2"):
        e = engines.get(name) or {}
        for phase, deltas in (e.get("counters") or {}).items():
            if not phase.startswith("accept_") or not deltas:
                continue
            rows = e["phases"].get(phase) or []
            d = sc.counter_delta(deltas[0]["before"], deltas[-1]["after"])
            gen = sum(len(r["tokens"]) for r in rows)
            out["measured"].setdefault(phase[7:], {})[name] = sc.acceptance(d, gen)
    ref = engines.get("E0") or {}
    for phase, rows in (ref.get("phases") or {}).items():
        if phase in prompts and rows:
            prompt = prompts[phase]
            toks = rows[0]["tokens"]
            out["predicted_from_E0"][phase[7:]] = {
                "vllm_rule": sc.simulate_acceptance(
                    prompt, toks, sc.K, lambda c, k: sc.propose_upto_k_earliest(
                        c, k, sc.NGRAM_MIN, sc.NGRAM_MAX)),
                "ours_exactly_k": sc.simulate_acceptance(
                    prompt, toks, sc.K, lambda c, k: ngram.propose(
                        c, k, sc.NGRAM_MIN, sc.NGRAM_MAX)),
            }
    out["repetitive_case"] = sc.pick_repetitive(
        {n: p["vllm_rule"] for n, p in out["predicted_from_E0"].items()})
    out["non_repetitive_case"] = "random"
    return out


def judge(engines: dict[str, dict[str, Any]], block: int,
          prompts: dict[str, list[int]]) -> dict[str, Any]:
    """The summary's verdict part from what the engines wrote (pure: the CPU tests run it on
    made-up engine outputs). `prompts`: the stage-2 prompt of each accept_ phase."""
    summary: dict[str, Any] = {}
    summary["engines"] = {
        n: {k: (engines.get(n) or {}).get(k) for k in (
            "error", "startup_s", "total_s", "engine", "plugin_imported", "phase_errors",
            "phase_seconds", "sm70_op_calls", "summary_error")}
        for n in sc.ENGINES}
    for n in sc.ENGINES:
        e = engines.get(n) or {}
        if e.get("traceback"):
            summary["engines"][n]["traceback"] = e["traceback"][-2500:]
        ms = e.get("model_summary") or {}
        summary["engines"][n]["target_methods"] = ms.get("methods")
        summary["engines"][n]["lm_head_method"] = ms.get("lm_head_method")
        summary["engines"][n]["drafter"] = e.get("drafter_summary")
    # The plan's block size is the first reporter's; a different one elsewhere would put
    # that engine's cases off its own block boundaries.
    summary["block_sizes"] = {n: ((engines.get(n) or {}).get("engine") or {}).get(
        "block_size") for n in sc.ENGINES}
    summary["plan_block_matches"] = {n: b == block for n, b in summary["block_sizes"].items()
                                     if b is not None and n != "E0"}
    # A start-up error is vLLM refusing the combination (or failing on it): the finding.
    summary["refused"] = {n: e["error"] for n, e in engines.items()
                          if e.get("error") and not e.get("engine")}
    comps = rules.vs_reference(engines, "E0", ("E1", "E2"), compare_sides,
                               with_per_phase=True)
    summary["comparisons"] = comps
    summary["truncation"] = {}
    summary["prefix_cache"] = {}
    for n in sc.ENGINES:
        phases = (engines.get(n) or {}).get("phases") or {}
        if block:
            summary["truncation"][n] = {
                ph: sc.truncation_check(phases[ph], block)
                for ph in ("trunc_cold", "trunc_warm") if ph in phases}
            summary["prefix_cache"][n] = sc.cache_hits(phases, block)
        if phases:
            summary.setdefault("whole_outputs", {})[n] = sc.whole_outputs(phases)
        for ph, deltas in ((engines.get(n) or {}).get("counters") or {}).items():
            if deltas and ph.startswith(("prefix_", "together_", "trunc_warm")):
                d = sc.counter_delta(deltas[0]["before"], deltas[-1]["after"])
                summary["prefix_cache"].setdefault(n, {}).setdefault("counters", {})[ph] = {
                    "queries": d["vllm:prefix_cache_queries"],
                    "hits": d["vllm:prefix_cache_hits"]}
    summary["acceptance"] = acceptance_report(engines, prompts)
    trunc_all = {f"{n}_{ph}": v for n, t in summary["truncation"].items()
                 for ph, v in t.items() if n != "E0"}
    for n, w in summary.get("whole_outputs", {}).items():
        if n != "E0":  # every phase, not only the truncation cases
            trunc_all[f"{n}_all_phases"] = w
    summary["passed"] = sc.verdict(comps, trunc_all,
                                   {n: v for n, v in summary["prefix_cache"].items()})
    acc = summary["acceptance"]
    summary["headline"] = {
        "block_size": block or None,
        "equal": {n: {k: comps.get(f"{n}_vs_E0", {}).get(k) for k in (
            "equal_requests", "requests", "passed")} for n in ("E1", "E2")},
        "truncation_whole": {k: v["passed"] for k, v in trunc_all.items()},
        "cache_exercised": {n: v.get("exercised") for n, v in summary["prefix_cache"].items()},
        "tokens_per_step": {case: {n: (acc["measured"].get(case) or {}).get(n, {}).get(
            "tokens_per_step") for n in ("E1", "E2")}
            for case in (acc.get("repetitive_case"), "random") if case},
        "repetitive_case": acc.get("repetitive_case"),
    }
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--work", type=Path, default=Path("/tmp/spec_prefix"),
                    help="engine JSON, logs and plans (only $OUT comes back)")
    a = ap.parse_args()
    t0 = time.time()
    deadline = t0 + a.budget_s - MARGIN_S
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    work: Path = a.work
    plan_dir = fresh_plan_dir(work)
    summary: dict[str, Any] = {"passed": None, "started": utc_stamp(), "budget_s": a.budget_s}

    flush = summary_writer(out / "summary.json", summary, t0)

    tiny, share, util = engine_share(len(sc.ENGINES), "0.3")
    try:
        configs = sc.engine_configs(str(tiny / "int8"), util, KV_BYTES)
    except sc.CaseError as exc:
        summary["error"] = str(exc)
        flush()
        return 1
    summary.update(model=str(tiny / "int8"), gpu_share=share, util_per_engine=util,
                   engine_kwargs=configs)
    flush()
    procs, files = launch(
        configs, work,
        lambda name, kw_path, result: [
            sys.executable, str(HERE / "spec_engine.py"), "--name", name, "--kwargs",
            str(kw_path), "--out", str(result), "--plan-dir", str(plan_dir),
            "--deadline", str(deadline)],
        lambda name: side_env("ours", {"VLLM_CACHE_ROOT": f"/tmp/vc_spec_{name}"}),
        start)
    log(f"started {list(procs)} at util {util} each")

    stage1: dict[str, Any] | None = None
    stage2: dict[str, Any] | None = None
    engines: dict[str, dict[str, Any]] = {}

    def tick() -> None:
        nonlocal stage1, stage2
        snapshot(out, work, files, engines)
        if stage1 is None:
            # E1 first: the MTP + align engine is the one under test
            got = rules.first_block_size(engines, ("E1", "E2"))
            block = None
            if got is not None:
                summary["block_size_source"], block = got
            elif all(procs[n].poll() is not None for n in ("E1", "E2")):
                block = 16 * 34  # neither started: E0 still runs a plan of its own size
                summary["block_size_source"] = "none (E1 and E2 failed to start)"
            if block is not None:
                stage1 = sc.stage1_plan(int(block))
                atomic_write(plan_dir / "stage1.json", stage1)
                summary["block_size"] = stage1["block_size"]
                summary["skipped_phases"] = stage1["skipped"]
                log(f"stage 1 written for block size {block}")
                flush()
        if stage1 is not None and stage2 is None:
            seed = rules.seed_source(engines, rules.seed_order(
                "E0", sc.ENGINES, procs["E0"].poll() is None))
            if seed is not None:
                n, tokens = seed
                seed_prompt = stage1["phases"]["seed"][0][0]["prompt"]
                stage2 = sc.stage2_plan(seed_prompt, tokens, n)
                atomic_write(plan_dir / "stage2.json", stage2)
                summary["stage2_seed_source"] = n
                log(f"stage 2 written from {n}'s seed output")
                flush()
        summary["progress"] = rules.progress(engines, sc.ENGINES)
        flush()

    watch(procs, deadline, tick)
    stop(procs)
    snapshot(out, work, files, engines)

    prompts = {} if stage2 is None else {ph: subs[0][0]["prompt"]
                                         for ph, subs in stage2["phases"].items()}
    return finish(summary, flush,
                  lambda: judge(engines, int(summary.get("block_size") or 0), prompts))


if __name__ == "__main__":
    sys.exit(main())
