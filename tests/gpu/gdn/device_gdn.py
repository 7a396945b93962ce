"""The GDN device run (issue 23), one script for the shared H200 call:

    python3 tests/gpu/gdn/device_gdn.py --out $OUT_DIR --budget-s N     (cwd = repo root)

Started by tests/gpu/round_call.sh after our plugin is installed in $SM70_SITE, our ops are
built in $SM70_KERNELS_BUILD_DIR and the A/B checkpoints exist under $SM70_AB_TINY. Steps,
each in its own process (a crashed CUDA context ends only its step), each writing its JSON
as soon as it has it, and summary.json rewritten after every step:
  ab      stock vLLM against vLLM with our GDN decode layer (gdn_side.py) on the tiny fp16
          checkpoint, eager, graphs, and graphs with n-gram speculative decoding (MTP-style
          verification rows), started first (engine start-up is the long pole) and polled to
          the end; ours must have run our op (device-counted) on every GDN layer
  pytest  tests/gpu/test_gdn_gpu.py (log: pytest_gdn.log)
  drift   tests/gpu/gdn/drift.py: 250,000 tokens, int16 state against float32
  bench   bench/bench_gdn.py: our recurrent and conv updates against vLLM's kernels
summary.json: {"passed": pytest and drift and ab passed (null when one did not finish), ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "ab"))

# (pair name, mode, speculative decoding); the pair's sides are stock_<name>, ours_<name>
PAIRS = (("eager", "eager", "none"), ("graphs", "graphs", "none"),
         ("graphs_ngram", "graphs", "ngram"))
GDN_LAYERS_TINY = 3  # make_checkpoint.py's tiny: 3 GDN + 1 full-attention layer
# "single": 4 requests alone, 63 decode-only steps each; with 3 drafts a step may take up
# to 4 tokens, so at least 15 steps each
DECODE_STEPS_SINGLE = {"none": 4 * 60, "ngram": 4 * 15}
OURS_CLASS = "vllm_patch.gdn.layer.Sm70GatedDeltaNet"
MARGIN_S = 20  # stop this long before the budget to write what we have


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def plugin_config() -> str:
    """Our GDN decode layer on; our int8 GEMV off (the checkpoint is fp16 anyway), so the
    only difference between the sides is the GDN layer."""
    return json.dumps({"gdn": {"decode_layer": True, "kernel": "sm70", "state_dtype": "float32"},
                       "gemm": {"int8_gemv": False}})


def ours_ran(side: dict[str, Any], mode: str, spec: str = "none") -> dict[str, Any]:
    """Did our op run on every GDN layer of the "ours" side (pure)? A silent fallback to
    vLLM's kernels shows as a missing class, an unsupported reason or no device count."""
    problems = []
    classes = side.get("gdn_layer_classes") or {}
    if classes.get(OURS_CLASS) != GDN_LAYERS_TINY or len(classes) != 1:
        problems.append(f"GDN layer classes {classes}, want {GDN_LAYERS_TINY} x {OURS_CLASS}")
    if side.get("gdn_unsupported"):
        problems.append(f"layers our ops refused: {side['gdn_unsupported']}")
    counts = side.get("gdn_device_calls") or {}
    device = counts.get("sm70:decode", 0) + counts.get("sm70:spec", 0)
    single = "single" in side.get("phases", {})
    want = GDN_LAYERS_TINY * DECODE_STEPS_SINGLE[spec] if single else 1
    if device < want:
        problems.append(f"our decode op ran {device} times on the device, want >= {want}")
    calls = side.get("gdn_calls") or {}
    python_calls = calls.get("sm70:decode", 0) + calls.get("sm70:spec", 0)
    if mode == "eager" and python_calls != device:
        problems.append(f"eager: {python_calls} Python calls but {device} device counts")
    # whether verification rows reached our MTP path (n-gram drafts exist only where the
    # output repeats itself; recorded, not required)
    return {"ok": not problems, "problems": problems, "device_calls": counts,
            "python_calls": calls, "classes": classes,
            "spec_rows_ran": counts.get("sm70:spec", 0) > 0}


def ab_verdict(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from compare import compare_sides

    res: dict[str, Any] = {"comparisons": {}, "ours_ran": {}}
    ok = True
    for pair, mode, spec in PAIRS:
        stock, ours = sides.get(f"stock_{pair}"), sides.get(f"ours_{pair}")
        if spec != "none" and stock and stock.get("error"):
            # stock vLLM itself cannot run this pair here: nothing to compare ours with
            res["comparisons"][pair] = {"passed": None, "why": "stock side failed; not counted",
                                        "stock_error": stock.get("error")}
            continue
        if not stock or not ours or stock.get("error") or ours.get("error"):
            res["comparisons"][pair] = {"passed": False, "why": "a side failed or is missing",
                                        "stock_error": (stock or {}).get("error", "missing"),
                                        "ours_error": (ours or {}).get("error", "missing")}
            ok = False
            continue
        c = compare_sides(stock, ours)
        res["comparisons"][pair] = {k: v for k, v in c.items() if k != "phases"}
        ran = ours_ran(ours, mode, spec)
        res["ours_ran"][pair] = ran
        ok = ok and c["passed"] and ran["ok"]
    se, sg = sides.get("stock_eager"), sides.get("stock_graphs")
    if se and sg and not se.get("error") and not sg.get("error"):
        c = compare_sides(se, sg)
        res["stock_graphs_vs_stock_eager"] = {k: v for k, v in c.items() if k != "phases"}
    res["passed"] = ok
    return res


class Step:
    """A child process in its own session (so its whole group can be stopped by its id)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 cwd: Path) -> None:
        self.name = name
        self.fh = open(log_path, "w")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.fh, stderr=subprocess.STDOUT,
                                     cwd=str(cwd), start_new_session=True)

    def wait(self, deadline: float) -> int | None:
        """The exit status, or None when it was stopped at the deadline."""
        try:
            rc = self.proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.stop()
            rc = None
        self.fh.close()
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    a = ap.parse_args()
    t0 = time.time()
    deadline = t0 + a.budget_s - MARGIN_S
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    summary: dict[str, Any] = {"passed": None, "budget_s": a.budget_s, "steps": {}}

    def flush() -> None:
        summary["elapsed_s"] = round(time.time() - t0, 1)
        parts = [summary["steps"].get(s, {}).get("passed") for s in ("pytest", "drift", "ab")]
        summary["passed"] = (False if any(p is False for p in parts)
                             else None if any(p is None for p in parts) else True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    flush()
    share = float(os.environ.get("SM70_GPU_SHARE", "0.3"))
    util = round(max(0.02, share / (3 * len(PAIRS))), 3)  # the engines, and room beside them
    env_tests = dict(os.environ)
    env_tests["PYTHONPATH"] = ":".join(filter(None, [str(ROOT), env_tests.get("PYTHONPATH")]))
    env_tests["PYTHONUNBUFFERED"] = "1"

    # --- ab: the engines start first -------------------------------------------------
    sides_dir = out / "ab_sides"
    sides_dir.mkdir(exist_ok=True)
    ab_steps: dict[str, Step] = {}
    if "ab" not in skip:
        try:
            from run_ab import side_env

            tiny = Path(os.environ.get("SM70_AB_TINY", "/tmp/ab/tiny")) / "fp16"
            if not (tiny / "config.json").is_file():
                raise FileNotFoundError(f"no tiny fp16 checkpoint at {tiny}")
            for pair, mode, spec in PAIRS:
                for side in ("stock", "ours"):
                    name = f"{side}_{pair}"
                    extra = {"VLLM_CACHE_ROOT": f"/tmp/vc_gdn_{name}"}
                    if side == "ours":
                        extra["SM70_PLUGIN_CONFIG"] = plugin_config()
                    cmd = [sys.executable, str(HERE / "gdn_side.py"), "--side", side, "--mode",
                           mode, "--model", str(tiny), "--out", str(sides_dir / f"{name}.json"),
                           "--util", str(util), "--kv-gib", "0.5", "--spec", spec]
                    ab_steps[name] = Step(name, cmd, side_env(side, extra),
                                          out / f"ab_{name}.log", Path("/tmp"))
            summary["steps"]["ab"] = {"passed": None, "started": sorted(ab_steps),
                                      "util_per_engine": util}
        except Exception as exc:
            summary["steps"]["ab"] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        flush()
        log(f"ab: {summary['steps']['ab']}")

    # --- pytest -------------------------------------------------------------------------
    if "pytest" not in skip:
        env = dict(env_tests, SM70_GPU_ERROR_LOG=str(out / "pytest_gdn_errors.jsonl"))
        step = Step("pytest", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--noconftest",
                               "-p", "no:cacheprovider", "-rf", "tests/gpu/test_gdn_gpu.py"],
                    env, out / "pytest_gdn.log", ROOT)
        rc = step.wait(min(deadline, time.time() + 420))
        tail = (out / "pytest_gdn.log").read_text(errors="replace").strip().splitlines()[-1:]
        summary["steps"]["pytest"] = {"passed": None if rc is None else rc == 0, "rc": rc,
                                      "last_line": tail[0] if tail else ""}
        flush()
        log(f"pytest: {summary['steps']['pytest']}")

    # --- drift --------------------------------------------------------------------------
    if "drift" not in skip:
        budget = max(30.0, min(420.0, deadline - time.time() - 150))
        step = Step("drift", [sys.executable, str(HERE / "drift.py"), "--out",
                              str(out / "drift.json"), "--budget-s", str(budget)],
                    env_tests, out / "drift.log", ROOT)
        rc = step.wait(min(deadline, time.time() + budget + 60))
        d = read_json(out / "drift.json") or {"passed": None, "error": "no drift.json"}
        summary["steps"]["drift"] = {k: d.get(k) for k in (
            "passed", "why", "error", "tokens_run", "worst_state_rel", "worst_out_rel_rms",
            "growth_last_over_first", "tolerance", "elapsed_s")}
        summary["steps"]["drift"]["rc"] = rc
        flush()
        log(f"drift: {summary['steps']['drift']}")

    # --- bench --------------------------------------------------------------------------
    if "bench" not in skip:
        budget = max(20.0, min(150.0, deadline - time.time() - 60))
        step = Step("bench", [sys.executable, str(ROOT / "bench" / "bench_gdn.py"), "--out",
                              str(out / "bench_gdn.json"), "--budget-s", str(budget)],
                    env_tests, out / "bench_gdn.log", ROOT)
        rc = step.wait(min(deadline, time.time() + budget + 90))
        b = read_json(out / "bench_gdn.json") or {}
        summary["steps"]["bench"] = {
            "rc": rc, "errors": len(b.get("errors", [])), "state_bytes": b.get("state_bytes"),
            "ratios": [{k: r.get(k) for k in ("op", "heads", "batch", "tokens", "ours_f32_us",
                                              "ours_i16_us", "fla_f32_us", "fla_over_ours_f32",
                                              "ours_us", "vllm_triton_us", "vllm_over_ours")
                        if k in r} for r in b.get("rows", [])]}
        flush()
        log(f"bench: rc={rc}, {len(b.get('rows', []))} rows")

    # --- ab: wait for the sides, compare ------------------------------------------------
    if ab_steps:
        rcs = {name: s.wait(deadline) for name, s in ab_steps.items()}
        sides = {name: read_json(sides_dir / f"{name}.json") or {"error": "no output"}
                 for name in ab_steps}
        for name, rc in rcs.items():
            if rc is None and not sides[name].get("error"):
                sides[name]["error"] = "stopped at the budget"
        try:
            verdict = ab_verdict(sides)
        except Exception as exc:
            verdict = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        verdict["rc"] = rcs
        verdict["startup_s"] = {n: s.get("startup_s") for n, s in sides.items()}
        verdict["errors"] = {n: s.get("error") for n, s in sides.items() if s.get("error")}
        summary["steps"]["ab"] = verdict
        (out / "ab_gdn.json").write_text(json.dumps(verdict, indent=1))
        flush()
        log(f"ab: passed={verdict.get('passed')}")
    log(f"passed={summary['passed']}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
