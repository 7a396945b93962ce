"""Where speculation with prefix caching loses tokens: our stack and stock vLLM, one matrix.

The proof run (device_spec_prefix.py) found greedy output with speculation differing from
plain decoding beyond rounding: with n-gram drafts that get accepted, and with MTP on
requests that hit the prefix cache. This driver runs, in one call, every engine needed to
say which component is at fault (GPU machine, lead's round call, after the plugin, ops and
the tiny checkpoints exist):

    python3 tests/gpu/serving/device_spec_diag.py --out $OUT_DIR --budget-s N

Engines, each in its own process (spec_engine.py), on the same stage plans as the proof:
  O0 ours int8, plain, no prefix caching     S0 stock fp16, plain, no prefix caching
  ON ours, n-gram k=3, no prefix caching     SN stock, n-gram k=3, no prefix caching
  OA ours, n-gram, prefix caching (align)    SA stock, n-gram, prefix caching (align)
  OM ours, MTP k=3, prefix caching (align)   SM stock, MTP k=3, prefix caching (align)
Each speculative engine is compared with the plain engine of its own side. The verdict per
pair is strict: a first divergence whose reference top-1/top-2 margin exceeds
STRICT_MARGIN, or a log-prob difference above STRICT_DLOGPROB on tokens both sides agree
on, is a loss; rounding between a 1-row and a 4-row verification step stays far below
both (the no-speculation A/Bs of this tree measured <= 0.1 on the tiny model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "ab"))
sys.path.insert(0, str(HERE))
import spec_cases as sc  # noqa: E402
import spec_rules as rules  # noqa: E402
from compare import compare_sides  # noqa: E402
from device_io import (  # noqa: E402
    atomic_write,
    engine_share,
    fresh_plan_dir,
    launch,
    read_engines,
    stop,
    summary_writer,
    watch,
    write_logs,
)
from run_ab import side_env, start  # noqa: E402

KV_BYTES = 1 << 30
MARGIN_S = 25
STRICT_MARGIN = 0.25
STRICT_DLOGPROB = 0.2

# name: (side, checkpoint, prefix caching, speculative method or None, plugin config)
MATRIX: dict[str, tuple[str, str, bool, str | None, dict[str, Any] | None]] = {
    "O0": ("ours", "int8", False, None, None),
    "ON": ("ours", "int8", False, "ngram", None),
    "OA": ("ours", "int8", True, "ngram", None),
    "OM": ("ours", "int8", True, "mtp", None),
    # R7 off: the same engine as ON with vLLM's stale-state read left in
    "ONx": ("ours", "int8", False, "ngram", {"spec": {"settle_accepted_state": False}}),
    # R10 off: the same engine as ON with vLLM's ungathered gates of mixed speculative steps
    "ONg": ("ours", "int8", False, "ngram", {"spec": {"gather_spec_gates": False}}),
    "S0": ("stock", "fp16", False, None, None),
    "SN": ("stock", "fp16", False, "ngram", None),
    "SA": ("stock", "fp16", True, "ngram", None),
    "SM": ("stock", "fp16", True, "mtp", None),
}
# The run after R7 and R8: the launcher's cells (prefix caching on) on our side with both
# fixes (the first matrix run, all nine cells but ONx, found the two losses in stock vLLM
# and ours alike: tests/gpu/results/h200_spec_diag.json).
DEFAULT = ("O0", "OA", "OM")


def engine_kwargs(tiny: Path, util: float, only: set[str]) -> dict[str, dict[str, Any]]:
    """The proof's E0 / E1 / E2 keyword arguments, recombined per matrix cell."""
    out: dict[str, dict[str, Any]] = {}
    for name, (_side, ckpt, prefix, spec, _cfg) in MATRIX.items():
        if name not in only:
            continue
        base = sc.engine_configs(str(tiny / ckpt), util, KV_BYTES)
        kw = dict(base["E1" if spec == "mtp" else "E2" if spec else "E0"])
        if not prefix:
            kw["enable_prefix_caching"] = False
            kw.pop("mamba_cache_mode", None)
        out[name] = kw
    return out


def reference_of(name: str) -> str:
    return name[0] + "0"


def engine_env(name: str) -> dict[str, str]:
    _side, _ckpt, _prefix, _spec, cfg = MATRIX[name]
    env = {"VLLM_CACHE_ROOT": f"/tmp/vc_diag_{name}"}
    if cfg is not None:
        env["SM70_PLUGIN_CONFIG"] = json.dumps(cfg)
    return env


def strict(c: dict[str, Any]) -> dict[str, Any]:
    lost = [d for d in c["divergences"]
            if d["ref_margin"] is None or d["ref_margin"] > STRICT_MARGIN]
    worst = max((r["max_abs_dlogprob"] for rs in c["phases"].values() for r in rs),
                default=0.0)
    bad_dlp = [(ph, i, round(r["max_abs_dlogprob"], 3)) for ph, rs in c["phases"].items()
               for i, r in enumerate(rs) if r["max_abs_dlogprob"] > STRICT_DLOGPROB]
    return {"requests": c["requests"], "equal_requests": c["equal_requests"],
            "max_abs_dlogprob": worst, "lost": [
                {k: d[k] for k in ("phase", "request", "step", "ref_margin")} for d in lost],
            "dlogprob_over": bad_dlp, "missing_phases": c["missing_phases"],
            "passed": bool(c["requests"]) and not lost and not bad_dlp
            and not c["missing_phases"]}


def judge(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, eng in engines.items():
        ref = engines.get(reference_of(name))
        if name in ("O0", "S0") or not ref or not eng.get("phases"):
            continue
        out[name] = strict(compare_sides(ref, eng))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--only", default=",".join(DEFAULT),
                    help="comma-separated engine names, or all")
    ap.add_argument("--work", type=Path, default=Path("/tmp/spec_diag"))
    a = ap.parse_args()
    t0 = time.time()
    deadline = t0 + a.budget_s - MARGIN_S
    out, work = a.out, a.work
    out.mkdir(parents=True, exist_ok=True)
    plan_dir = fresh_plan_dir(work)
    only = set(MATRIX) if a.only == "all" else {s for s in a.only.split(",") if s}
    unknown = sorted(only - set(MATRIX))
    if unknown or not only:
        ap.error(f"--only {a.only!r}: engines {unknown or 'none'} not in {sorted(MATRIX)}")
    tiny, _share, util = engine_share(len(only), "0.3")
    configs = engine_kwargs(tiny, util, only)
    summary: dict[str, Any] = {"passed": None, "matrix": {k: MATRIX[k] for k in configs},
                               "engine_kwargs": configs, "strict_margin": STRICT_MARGIN,
                               "strict_dlogprob": STRICT_DLOGPROB}

    flush = summary_writer(out / "summary.json", summary, t0)

    procs, files = launch(
        configs, work,
        lambda name, kw_path, result: [
            sys.executable, str(HERE / "spec_engine.py"), "--name", name, "--kwargs",
            str(kw_path), "--out", str(result), "--plan-dir", str(plan_dir), "--deadline",
            str(deadline)],
        lambda name: side_env(MATRIX[name][0], engine_env(name)),
        start)
    engines: dict[str, dict[str, Any]] = {}
    stage1: dict[str, Any] | None = None
    stage2: dict[str, Any] | None = None

    def tick() -> None:
        nonlocal stage1, stage2
        read_engines(files, engines)
        if stage1 is None:
            got = rules.first_block_size(engines, list(engines))
            if got:
                stage1 = sc.stage1_plan(int(got[1]))
                atomic_write(plan_dir / "stage1.json", stage1)
                summary["block_size"] = got[1]
        if stage1 is not None and stage2 is None:
            seed = rules.seed_source(engines, ("O0", "S0", *configs))
            if seed:
                src, tokens = seed
                stage2 = sc.stage2_plan(stage1["phases"]["seed"][0][0]["prompt"], tokens, src)
                atomic_write(plan_dir / "stage2.json", stage2)
                summary["stage2_seed_source"] = src
        summary["progress"] = rules.progress(engines, engines, count_key="phases")
        summary["verdicts"] = judge(engines)
        flush()

    watch(procs, deadline, tick)
    stop(procs, say=False)
    (out / "engines.json").write_text(json.dumps(engines))
    write_logs(out / "logs.txt", work, configs, tail=12000)
    summary["verdicts"] = judge(engines)
    summary["errors"] = {k: e.get("error") for k, e in engines.items() if e.get("error")}
    summary["settled"] = {k: e.get("settled") for k, e in engines.items()}
    v = summary["verdicts"]
    summary["passed"] = bool(v) and all(x["passed"] for x in v.values())
    flush()
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
