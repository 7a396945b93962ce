"""MTP k=3 with and without the n-gram assist against plain decoding (issue 24 item 4).

Run on the GPU machine by the lead's round call, from the repository root:

    python3 tests/gpu/serving/device_assist.py --out $OUT_DIR --budget-s N

after the plugin is installed into $SM70_SITE and the tiny A/B checkpoint (it carries the
MTP tensors) is in $SM70_AB_TINY. Three engines on our plugin and the int8 copy, each in
its own process (this file with `engine`), started at once:
  E0  no speculation: the reference output;
  E1  MTP k=3, SM70_PLUGIN_CONFIG spec.ngram_assist false (vLLM's MTP drafts only);
  E2  MTP k=3, spec.ngram_assist true (runtime patch R-ASSIST: per request, MTP or n-gram
      drafts by measured acceptance).
E1 and E2 use FULL_AND_PIECEWISE graphs with the launcher's capture sizes (4..64), so the
assist runs beside captured MTP drafter graphs; greedy, async scheduling off (the
launcher's default).

How the cases are built (random weights make MTP's acceptance meaningless): a random
48-token prompt is continued for 512 tokens by every engine (`seed`); a random model's
greedy output falls into loops, so E0's own continuation is the material. From it
(spec_cases.repetitive_candidates): `tail` = prompt + the first three quarters of that
output (the reference continues it with the rest, which the context already holds when the
output loops), `repeat2` = prompt + output twice, `cycle16` = a 16-token random pattern
repeated, `random` = a fresh random prompt (the non-repetitive case). Each runs alone
(64 new tokens) so vLLM's spec-decode counters and the assist's counters are its own;
`mixed` runs all four together with different lengths (rows finish at different steps, so
vLLM condenses the batch under the assist). The repetitive case reported is the one on
which our n-gram rule, simulated on E0's tokens, accepts most.

summary.json: passed (E1 and E2 equal to E0 on every phase within rounding noise, and the
assist really active in E2 and off in E1), and per case and engine tokens per step,
acceptance, and how often the assist chose n-gram. engines.json holds every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
AB = HERE.parents[0] / "ab"
sys.path.insert(0, str(HERE))
import spec_rules as rules  # noqa: E402
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

ENGINES = ("E0", "E1", "E2")
KV_BYTES = 512 << 20
MAX_LEN = 4096
MARGIN_S = 25  # left to judge and write after the engines are stopped
MIXED_TOKENS = (64, 40, 80, 24)  # `mixed`: each request its own length


# --- plans and configs (pure) ------------------------------------------------------------

def plugin_configs() -> dict[str, dict[str, Any]]:
    return {"E0": {"spec": {"ngram_assist": False}},
            "E1": {"spec": {"ngram_assist": False}},
            "E2": {"spec": {"ngram_assist": True}}}


def engine_configs(model: str, util: float, kv_bytes: int) -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(HERE))
    import spec_cases as sc

    if not 0.0 < util < 1.0:
        raise ValueError(f"gpu_memory_utilization={util}: must be in (0, 1)")
    sys.path.insert(0, str(AB))
    from ab_side import engine_kwargs

    out: dict[str, dict[str, Any]] = {}
    for name in ENGINES:
        kw = engine_kwargs(model, "graphs", sc.MAX_BATCHED, MAX_LEN, 1, util)
        kw["kv_cache_memory_bytes"] = kv_bytes
        kw["disable_log_stats"] = False  # the spec-decode counters
        kw["async_scheduling"] = False
        if name != "E0":
            kw["compilation_config"] = {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                        "cudagraph_capture_sizes": sc.SPEC_CAPTURE_SIZES}
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": sc.K}
        out[name] = kw
    return out


def stage1_plan(seed: int = 0) -> dict[str, Any]:
    import random

    sys.path.insert(0, str(HERE))
    import spec_cases as sc

    rng = random.Random(seed)
    prompt = [rng.randrange(sc.VOCAB_CAP) for _ in range(sc.SEED_PROMPT_LEN)]
    return {"stage": 1, "phases": {"seed": [[{"prompt": prompt,
                                              "max_tokens": sc.SEED_NEW_TOKENS}]]}}


def stage2_plan(seed_prompt: list[int], seed_output: list[int]) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import spec_cases as sc

    cands = sc.repetitive_candidates(seed_prompt, seed_output)
    phases: dict[str, Any] = {f"accept_{n}": [[{"prompt": p, "max_tokens": sc.NEW_TOKENS}]]
                              for n, p in cands.items()}
    phases["mixed"] = [[{"prompt": p, "max_tokens": m}
                        for p, m in zip(cands.values(), MIXED_TOKENS, strict=True)]]
    return {"stage": 2, "phases": phases}


# --- judging (pure: tests/test_spec_assist_device.py runs it on made-up engines) ---------

def stats_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
                ) -> dict[str, Any]:
    """The assist's counters over one phase (after - before; `active` and `why` as after)."""
    if not after:
        return {"active": None}
    out: dict[str, Any] = {"active": after.get("active"), "why": after.get("why")}
    for key in ("calls", "skipped", "rows", "rows_with_ngram_draft", "rows_chose_ngram",
                "rows_measured"):
        if key in after:
            out[key] = after[key] - ((before or {}).get(key) or 0)
    rows = out.get("rows")
    out["chose_ngram_share"] = (None if not rows else
                                round(out.get("rows_chose_ngram", 0) / rows, 4))
    return out


def predicted(prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """Our n-gram rule alone on the reference's tokens (an oracle verifier)."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))  # the driver runs no vLLM: our rule is read from here
    import spec_cases as sc

    from vllm_patch.spec_decode import ngram

    return sc.simulate_acceptance(prompt, tokens, sc.K, lambda c, k: ngram.propose(
        c, k, sc.NGRAM_MIN, sc.NGRAM_MAX))


def judge(engines: Mapping[str, Mapping[str, Any]],
          prompts: Mapping[str, list[int]]) -> dict[str, Any]:
    """The summary's verdict and figures from what the engines wrote. `prompts`: the
    stage-2 prompt of each accept_ phase."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(AB))
    import spec_cases as sc
    from compare import compare_sides

    s: dict[str, Any] = {"engines": {}}
    for n in ENGINES:
        e = engines.get(n) or {}
        s["engines"][n] = {k: e.get(k) for k in (
            "error", "startup_s", "total_s", "engine", "plugin_imported", "phase_errors",
            "phase_seconds", "assist_final", "plugin_report")}
        if e.get("traceback"):
            s["engines"][n]["traceback"] = e["traceback"][-2500:]
    ref = engines.get("E0")
    comps: dict[str, Any] = {**rules.vs_reference(engines, "E0", ("E1", "E2"), compare_sides),
                             **rules.vs_reference(engines, "E1", ("E2",), compare_sides)}
    s["comparisons"] = comps
    cases: dict[str, Any] = {}
    for n in ENGINES:
        e = engines.get(n) or {}
        for phase, rec in (e.get("records") or {}).items():
            rows = (e.get("phases") or {}).get(phase) or []
            gen = sum(len(r["tokens"]) for r in rows)
            d = sc.counter_delta(rec["before"], rec["after"])
            fig = sc.acceptance(d, gen) if n != "E0" else {"generated": gen}
            fig["assist"] = stats_delta(rec.get("assist_before"), rec.get("assist_after"))
            cases.setdefault(phase, {})[n] = fig
    s["cases"] = cases
    pred = {}
    for phase, rows in ((ref or {}).get("phases") or {}).items():
        if phase in prompts and rows:
            pred[phase] = predicted(prompts[phase], rows[0]["tokens"])
    s["predicted_ngram_only_from_E0"] = pred
    best, score = None, 0
    for phase, p in pred.items():
        if phase != "accept_random" and p["num_accepted_tokens"] > score:
            best, score = phase, p["num_accepted_tokens"]
    s["repetitive_case"] = best
    s["non_repetitive_case"] = "accept_random"
    a1 = ((engines.get("E1") or {}).get("assist_final") or {})
    a2 = ((engines.get("E2") or {}).get("assist_final") or {})
    s["assist_active"] = {"E1": a1.get("active"), "E2": a2.get("active"),
                          "E2_rows": a2.get("rows"), "E2_why": a2.get("why")}
    lossless = [comps.get(f"{n}_vs_E0", {}) for n in ("E1", "E2")]
    if not all(c.get("requests") for c in lossless):
        s["passed"] = None  # an engine produced nothing to compare
    else:
        s["passed"] = (all(c["passed"] for c in lossless)
                       and all((c.get("max_abs_dlogprob") or 0.0) <= sc.MAX_DLOGPROB
                               for c in lossless)
                       and a2.get("active") is True and bool(a2.get("rows"))
                       and a1.get("active") is not True)

    def fig(case: str | None, n: str, key: str) -> Any:
        return ((cases.get(case or "") or {}).get(n) or {}).get(key)

    s["headline"] = {
        "lossless": {n: {k: comps.get(f"{n}_vs_E0", {}).get(k) for k in (
            "equal_requests", "requests", "passed", "max_abs_dlogprob")} for n in ("E1", "E2")},
        **{label: {"case": case,
                   "tokens_per_step": {n: fig(case, n, "tokens_per_step") for n in ("E1", "E2")},
                   "acceptance_rate": {n: fig(case, n, "acceptance_rate") for n in ("E1", "E2")},
                   "E2_chose_ngram_share": (fig(case, "E2", "assist") or {}).get(
                       "chose_ngram_share"),
                   "ngram_only_predicted_tokens_per_step": (pred.get(case or "") or {}).get(
                       "tokens_per_step")}
           for label, case in (("repetitive", best), ("non_repetitive", "accept_random"))},
        "assist_active": s["assist_active"],
    }
    return s


# --- one engine (its own process) --------------------------------------------------------

def _assist_stats(worker: Any) -> dict[str, Any]:
    from vllm_patch.spec_decode import runner_hook

    return runner_hook.stats(worker.model_runner)


def _plugin_report(worker: Any) -> dict[str, Any]:
    from vllm_patch import plugin
    from vllm_patch.spec_decode import runner_hook

    rep = plugin.registered()
    return {"ngram_assist": rep.get("ngram_assist"), "outcome": runner_hook.outcome()}


def engine_main(a: argparse.Namespace) -> int:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(AB))
    from ab_side import run_phase
    from spec_engine import engine_facts, greedy, read_counters, run_engine, run_stages

    res: dict[str, Any] = {"name": a.name, "error": None, "phases": {}, "records": {},
                           "phase_errors": {}, "phase_seconds": {}}

    def body(llm: Any, flush: Callable[[], None]) -> None:
        res["engine"] = engine_facts(llm)
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules

        def assist() -> dict[str, Any] | None:
            try:
                return llm.collective_rpc(_assist_stats)[0]
            except Exception as exc:  # the figures describe; the outputs stand without
                return {"active": None, "why": f"stats failed: {type(exc).__name__}: {exc}"}

        try:
            res["plugin_report"] = llm.collective_rpc(_plugin_report)[0]
        except Exception as exc:
            res["plugin_report"] = {"error": f"{type(exc).__name__}: {exc}"}
        flush()

        def one_phase(phase: str, subs: list[list[dict[str, Any]]]) -> None:
            rows: list[dict[str, Any]] = []
            before, a_before = read_counters(llm), assist()
            for sub in subs:
                rows += run_phase(llm, [greedy(r["max_tokens"]) for r in sub],
                                  [r["prompt"] for r in sub])
            res["phases"][phase] = rows
            res["records"][phase] = {"before": before, "after": read_counters(llm),
                                     "assist_before": a_before, "assist_after": assist()}

        run_stages(a.plan_dir, a.deadline, res, flush, one_phase)
        res["assist_final"] = assist()

    return run_engine(res, a.kwargs, a.out, body)


# --- the driver ----------------------------------------------------------------------------

def driver_main(a: argparse.Namespace) -> int:
    sys.path.insert(0, str(AB))
    from run_ab import side_env, start

    t0 = time.time()
    deadline = t0 + a.budget_s - MARGIN_S
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    work: Path = a.work
    plan_dir = fresh_plan_dir(work)
    summary: dict[str, Any] = {"passed": None, "budget_s": a.budget_s, "started": utc_stamp(),
                               "cases_built": __doc__.split("How the cases are built")[1].split(
                                   "summary.json:")[0].strip()}

    flush = summary_writer(out / "summary.json", summary, t0)

    tiny, share, util = engine_share(len(ENGINES), "0.08")
    try:
        configs = engine_configs(str(tiny / "int8"), util, KV_BYTES)
    except ValueError as exc:
        summary["error"] = str(exc)
        flush()
        return 1
    stage1 = stage1_plan()
    atomic_write(plan_dir / "stage1.json", stage1)
    summary.update(model=str(tiny / "int8"), gpu_share=share, util_per_engine=util,
                   engine_kwargs=configs, plugin_configs=plugin_configs())
    flush()
    procs, files = launch(
        configs, work,
        lambda name, kw_path, result: [
            sys.executable, str(Path(__file__).resolve()), "engine", "--name", name,
            "--kwargs", str(kw_path), "--out", str(result), "--plan-dir", str(plan_dir),
            "--deadline", str(deadline)],
        lambda name: side_env("ours", {
            "VLLM_CACHE_ROOT": f"/tmp/vc_assist_{name}",
            "SM70_PLUGIN_CONFIG": json.dumps(plugin_configs()[name])}),
        start)
    log(f"started {list(procs)} at util {util} each")
    engines: dict[str, dict[str, Any]] = {}
    stage2: dict[str, Any] | None = None

    def tick() -> None:
        nonlocal stage2
        snapshot(out, work, files, engines)
        if stage2 is None:
            got = rules.seed_source(engines, rules.seed_order(
                "E0", ENGINES, procs["E0"].poll() is None))
            if got is not None:
                n, tokens = got
                seed_prompt = stage1["phases"]["seed"][0][0]["prompt"]
                try:
                    stage2 = stage2_plan(seed_prompt, tokens)
                except ValueError as exc:
                    summary["stage2_error"] = str(exc)
                    stage2 = {"stage": 2, "phases": {}}
                atomic_write(plan_dir / "stage2.json", stage2)
                summary["stage2_seed_source"] = n
                log(f"stage 2 written from {n}'s seed output")
        summary["progress"] = rules.progress(engines, ENGINES)
        flush()

    watch(procs, deadline, tick)
    stop(procs)
    snapshot(out, work, files, engines)
    prompts = {} if stage2 is None else {ph: subs[0][0]["prompt"]
                                         for ph, subs in stage2["phases"].items()
                                         if ph.startswith("accept_")}
    return finish(summary, flush, lambda: judge(engines, prompts))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="mode")
    eng = sub.add_parser("engine", help="one engine (started by the driver)")
    eng.add_argument("--name", required=True)
    eng.add_argument("--kwargs", type=Path, required=True)
    eng.add_argument("--out", type=Path, required=True)
    eng.add_argument("--plan-dir", type=Path, required=True)
    eng.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    ap.add_argument("--out", type=Path, dest="driver_out")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--work", type=Path, default=Path("/tmp/assist_work"),
                    help="engine JSON, logs and plans (only $OUT comes back)")
    a = ap.parse_args(argv)
    if a.mode is None:
        if a.driver_out is None:
            ap.error("--out is required")
        a.out = a.driver_out
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.mode == "engine":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return engine_main(a)
    return driver_main(a)


if __name__ == "__main__":
    sys.exit(main())
