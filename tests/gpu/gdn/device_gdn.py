"""The GDN device run (issue 23), one script for the shared H200 call:

    python3 tests/gpu/gdn/device_gdn.py --out $OUT_DIR --budget-s N     (cwd = repo root)

Started by tests/gpu/round_call.py after our plugin is installed in $SM70_SITE, our ops are
built in $SM70_KERNELS_BUILD_DIR and the A/B checkpoints exist under $SM70_AB_TINY. Steps,
each in its own process (a crashed CUDA context ends only its step), each writing its JSON
as soon as it has it, and summary.json rewritten after every step:
  ab      four engines in parallel (gdn_side.py, CUDA graphs, max_model_len 33792), each
          compared with `stock` on ~100-, ~4K- and ~32K-token prompts, ab_side's batch16
          (decode and prefill rows in one step) and its prefix-sharing batches:
            stock       vLLM as released on the tiny fp16 copy (FLA prefill and decode,
                        float32 state), no speculation, no prefix caching: the reference
            ours_chunk  our plugin on the int8 copy (its exact fp16 dequantization is the
                        stock side's checkpoint) with our GDN layer, decode and prefill
                        (SM70_GDN_KERNEL=sm70_chunk: gdn.prefill "sm70"), float32 state
            ours_mtp    ours_chunk + MTP k=3 + prefix caching (align); R7 and R8 are on
                        by default (vllm_patch/spec_decode)
            ours_int16  ours_chunk on the int16 state pool (SM70_GDN_STATE_DTYPE=int16)
          Each ours side must also prove our ops ran: every GDN layer of our class, no layer
          refused, every prefill step on our prefill ops (`sm70:prefill*` route counts, none
          `stock:prefill`), decode steps counted on the device (graph replays included).
  drift   tests/gpu/gdn/drift.py: 250,000 tokens, int16 state against float32
  pytest  tests/gpu/test_gdn_gpu.py (log: pytest_gdn.log)     } not in the default
  bench   bench/bench_gdn.py                                  } --steps (the suite runs them)
Writes ab_gdn.json (the lead copies it to tests/gpu/results/h200_gdn_ab.json) and
summary.json: {"passed": the ab and drift verdicts (null when one did not finish), ...}.
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
sys.path.insert(0, str(HERE.parent / "serving"))
from device_io import atomic_write, log, read_json  # noqa: E402

GDN_LAYERS_TINY = 3  # make_checkpoint.py's tiny: 3 GDN + 1 full-attention layer
OURS_CLASSES = {"float32": "vllm_patch.gdn.layer.Sm70GatedDeltaNet",
                "int16": "vllm_patch.gdn.layer.Sm70GatedDeltaNetInt16"}
# Prefill steps each GDN layer must have run on our ops: p100 1 chunk, p4k 2, p32k 16 (2048-
# token chunks); batch16 and the prefix batches add more
MIN_PREFILL_STEPS = GDN_LAYERS_TINY * (1 + 2 + 16)
# Decode steps on the device: p100, p4k and p32k each decode 63 steps alone (fewer with MTP,
# which takes up to 4 tokens a step)
MIN_DECODE_STEPS = {"none": GDN_LAYERS_TINY * 3 * 63, "mtp3": GDN_LAYERS_TINY * 3 * 16}
# The largest |logprob difference| on agreeing tokens. Rounding alone (our int8 GEMV against
# cuBLAS on the exact fp16 copy, our GDN ops against FLA) moves this tiny model's log-probs by
# about a tenth of a nat (the earlier A/Bs in tests/gpu/results/h200_*_ab.json), more with a
# 32K prompt's context; a wrong slot, a lost initial state or a shifted row moves them by
# nats (h200_spec_diag.json). float32 state: 0.25. int16: each store rounds every state row
# to 1/32767 of its largest entry (the drift test's bound is 2e-3 relative), a small addition
# to the rounding above, so 0.3.
MAX_DLOGPROB = {"float32": 0.25, "int16": 0.3}
MARGIN_S = 20  # stop this long before the budget to write what we have


def gdn_config(state_dtype: str) -> str:
    """What SM70_GDN_KERNEL=sm70_chunk gives the plugin (sm70ctl/runtime/plugin_config.py)."""
    return json.dumps({"gdn": {"decode_layer": True, "kernel": "sm70", "prefill": "sm70",
                               "state_dtype": state_dtype}})


# name: (side, checkpoint, gdn_side.py arguments, state dtype or None for stock)
SIDES: dict[str, tuple[str, str, list[str], str | None]] = {
    "stock": ("stock", "fp16", [], None),
    "ours_chunk": ("ours", "int8", [], "float32"),
    "ours_mtp": ("ours", "int8", ["--spec", "mtp3", "--prefix-caching"], "float32"),
    "ours_int16": ("ours", "int8", [], "int16"),
}


def ours_ran(side: dict[str, Any], state_dtype: str, spec: str) -> dict[str, Any]:
    """Did our ops run every GDN step of this ours side (pure)? A silent fallback to vLLM's
    kernels shows as a missing class, a refused layer, a prefill on `stock:prefill` or no
    device count."""
    problems = []
    want = OURS_CLASSES[state_dtype]
    classes = side.get("gdn_layer_classes") or {}
    if classes.get(want) != GDN_LAYERS_TINY or len(classes) != 1:
        problems.append(f"GDN layer classes {classes}, want {GDN_LAYERS_TINY} x {want}")
    if side.get("gdn_unsupported"):
        problems.append(f"layers our ops refused: {side['gdn_unsupported']}")
    if side.get("gdn_prefill_mode") != "sm70":
        problems.append(f"the layer's prefill mode is {side.get('gdn_prefill_mode')!r}")
    calls = side.get("gdn_calls") or {}
    start = side.get("gdn_calls_at_start") or {}
    prefill = sum(v - start.get(k, 0) for k, v in calls.items() if k.startswith("sm70:prefill"))
    if prefill < MIN_PREFILL_STEPS:
        problems.append(f"{prefill} prefill steps on our ops, want >= {MIN_PREFILL_STEPS}")
    stock_prefill = calls.get("stock:prefill", 0)
    if stock_prefill:
        problems.append(f"{stock_prefill} prefill steps went to vLLM's path")
    device = side.get("gdn_device_calls") or {}
    decode = device.get("sm70:decode", 0) + device.get("sm70:spec", 0)
    if decode < MIN_DECODE_STEPS[spec]:
        problems.append(f"our decode ops ran {decode} times on the device, want >= "
                        f"{MIN_DECODE_STEPS[spec]}")
    if spec != "none" and not device.get("sm70:spec"):
        problems.append("no MTP verification step ran on our decode op")
    ops = side.get("gdn_prefill_ops") or {}
    if not ops.get("chunk_two_pass"):  # vLLM's FLA-backed builder always has the table
        problems.append(f"no prefill step ran the two-pass chunk op: {ops}")
    return {"ok": not problems, "problems": problems, "prefill_steps": prefill,
            "prefill_ops": ops, "calls": calls, "device_calls": device, "classes": classes}


def ab_verdict(sides: dict[str, dict[str, Any]],
               wanted: frozenset[str] | None = None) -> dict[str, Any]:
    """Each of our `wanted` sides (default: all of SIDES) against stock; a wanted side
    without output fails, an unwanted one is not judged."""
    from compare import compare_sides

    res: dict[str, Any] = {"comparisons": {}, "ours_ran": {}, "max_dlogprob": MAX_DLOGPROB}
    stock = sides.get("stock") or {"error": "missing"}
    ok = True
    for name, (_side, _ckpt, args, dtype) in SIDES.items():
        if dtype is None or (wanted is not None and name not in wanted):
            continue
        ours = sides.get(name) or {"error": "missing"}
        if stock.get("error") or ours.get("error") or ours.get("phase_errors"):
            res["comparisons"][name] = {
                "passed": False, "why": "a side or a phase failed",
                "stock_error": stock.get("error"), "ours_error": ours.get("error"),
                "phase_errors": ours.get("phase_errors")}
            ok = False
            continue
        c = compare_sides(stock, ours)
        bound = MAX_DLOGPROB[dtype]
        worst = c["max_abs_dlogprob"]
        c["dlogprob_within_bound"] = worst is not None and worst <= bound
        c["passed"] = bool(c["passed"] and c["dlogprob_within_bound"])
        c["per_phase_max_dlogprob"] = {
            ph: max((r["max_abs_dlogprob"] for r in rs), default=None)
            for ph, rs in c["phases"].items()}
        res["comparisons"][name] = {k: v for k, v in c.items() if k != "phases"}
        spec = "mtp3" if "mtp3" in args else "none"
        ran = ours_ran(ours, dtype, spec)
        if spec != "none":
            ran["spec_metrics"] = ours.get("spec_metrics")
        res["ours_ran"][name] = ran
        ok = ok and c["passed"] and ran["ok"]
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



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--steps", default="ab,drift",
                    help="comma-separated, from ab, drift, pytest, bench")
    ap.add_argument("--phases", default="", help="gdn_side.py --phases (default: all)")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help="engines of the A/B (stock is always among them), e.g. stock,ours_int16")
    a = ap.parse_args()
    t0 = time.time()
    deadline = t0 + a.budget_s - MARGIN_S
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    steps = set(filter(None, a.steps.split(",")))
    wanted = frozenset(filter(None, a.sides.split(","))) | {"stock"}
    if wanted - set(SIDES):
        raise SystemExit(f"--sides: unknown side(s) {sorted(wanted - set(SIDES))}")
    unknown = steps - {"ab", "drift", "pytest", "bench"}
    if unknown:
        raise SystemExit(f"--steps: unknown step(s) {sorted(unknown)}")
    summary: dict[str, Any] = {"passed": None, "budget_s": a.budget_s, "steps": {}}

    def flush() -> None:
        summary["elapsed_s"] = round(time.time() - t0, 1)
        parts = [summary["steps"].get(s, {}).get("passed")
                 for s in ("pytest", "drift", "ab") if s in steps]
        summary["passed"] = (False if any(p is False for p in parts)
                             else None if any(p is None for p in parts) else True)
        atomic_write(out / "summary.json", summary)

    flush()
    share = float(os.environ.get("SM70_GPU_SHARE", "0.15"))
    util = round(max(0.02, share / (len(wanted) + 1)), 3)  # the engines, and room beside them
    env_tests = dict(os.environ)
    env_tests["PYTHONPATH"] = ":".join(filter(None, [str(ROOT), env_tests.get("PYTHONPATH")]))
    env_tests["PYTHONUNBUFFERED"] = "1"

    # --- ab: the engines start first (start-up is the long pole) ---------------------
    sides_dir = out / "ab_sides"
    sides_dir.mkdir(exist_ok=True)
    ab_steps: dict[str, Step] = {}
    if "ab" in steps:
        try:
            from run_ab import side_env

            tiny = Path(os.environ.get("SM70_AB_TINY", "/tmp/ab/tiny"))
            for ckpt in ("fp16", "int8"):
                if not (tiny / ckpt / "config.json").is_file():
                    raise FileNotFoundError(f"no tiny {ckpt} checkpoint at {tiny / ckpt}")
            for name, (side, ckpt, args, dtype) in SIDES.items():
                if name not in wanted:
                    continue
                cmd = [sys.executable, str(HERE / "gdn_side.py"), "--side", side,
                       "--model", str(tiny / ckpt), "--out", str(sides_dir / f"{name}.json"),
                       "--util", str(util), "--kv-gib", "1", *args]
                if a.phases:
                    cmd += ["--phases", a.phases]
                if dtype is not None:
                    cmd += ["--plugin-config", gdn_config(dtype)]
                env = side_env(side, {"VLLM_CACHE_ROOT": f"/tmp/vc_gdn_{name}"})
                ab_steps[name] = Step(name, cmd, env, out / f"ab_{name}.log", Path("/tmp"))
            summary["steps"]["ab"] = {"passed": None, "started": sorted(ab_steps),
                                      "util_per_engine": util}
        except Exception as exc:
            summary["steps"]["ab"] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        flush()
        log(f"ab: {summary['steps']['ab']}")

    # --- pytest -------------------------------------------------------------------------
    if "pytest" in steps:
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
    if "drift" in steps:
        budget = max(30.0, min(240.0, deadline - time.time() - 150))
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
    if "bench" in steps:
        budget = max(20.0, min(150.0, deadline - time.time() - 60))
        step = Step("bench", [sys.executable, str(ROOT / "bench" / "bench_gdn.py"), "--out",
                              str(out / "bench_gdn.json"), "--budget-s", str(budget)],
                    env_tests, out / "bench_gdn.log", ROOT)
        rc = step.wait(min(deadline, time.time() + budget + 90))
        b = read_json(out / "bench_gdn.json") or {}
        summary["steps"]["bench"] = {"rc": rc, "errors": len(b.get("errors", [])),
                                     "rows": len(b.get("rows", []))}
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
            verdict = ab_verdict(sides, wanted)
        except Exception as exc:
            verdict = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        verdict["rc"] = rcs
        verdict["startup_s"] = {n: s.get("startup_s") for n, s in sides.items()}
        verdict["phase_seconds"] = {n: s.get("phase_seconds") for n, s in sides.items()}
        verdict["errors"] = {n: s.get("error") for n, s in sides.items() if s.get("error")}
        verdict["tracebacks"] = {n: s.get("traceback") or s.get("tracebacks")
                                 for n, s in sides.items()
                                 if s.get("traceback") or s.get("tracebacks")}
        verdict["plugin"] = {n: s.get("plugin") for n, s in sides.items() if s.get("plugin")}
        verdict["mamba_ssm_cache_dtype"] = {n: s.get("mamba_ssm_cache_dtype")
                                            for n, s in sides.items()}
        summary["steps"]["ab"] = {k: v for k, v in verdict.items()
                                  if k not in ("tracebacks", "plugin")}
        atomic_write(out / "ab_gdn.json", verdict)
        flush()
        log(f"ab: passed={verdict.get('passed')}")
    log(f"passed={summary['passed']}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
