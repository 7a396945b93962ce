"""The A/B on the GPU machine: stock vLLM 0.22.1 on the fp16 copy vs vLLM + our plugin on the
int8 copy of the same random checkpoint. One call does everything and writes JSON.

Steps (overlapped where they are independent, to fit one device call):
1. install our package with its `vllm.general_plugins` entry point into a private folder
   (pip --target; that folder goes on PYTHONPATH of our side only);
2. build our ops (`vllm_patch.ops.loader.load_ops`, TORCH_CUDA_ARCH_LIST=9.0 there) while
   the checkpoints are made (`make_checkpoint.py`);
3. four `ab_side.py` processes at once, each with its own GPU memory share: stock eager,
   stock graphs, ours eager, ours graphs (stock ones start as soon as the checkpoint exists);
4. compare ours against stock in each mode, and stock eager against stock graphs (the
   reference's own rounding noise); write `<out>/ab_<shape>.json` and the logs.

Run: python tests/gpu/ab/run_ab.py --shape tiny --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SITE = Path("/tmp/sm70-site")
OPS_CACHE = Path("/tmp/sm70-ops-cache")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def install_plugin(logs: Path) -> dict[str, Any]:
    """pip --target our package (a real dist-info with the entry point). Where the image's
    Python cannot build it (no setuptools), the same entry point is declared by a minimal
    dist-info beside a link to the checkout's vllm_patch: importlib.metadata, which vLLM's
    plugin loader uses, finds either the same way."""
    t = time.time()
    if SITE.exists():
        shutil.rmtree(SITE)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--no-index", "--target", str(SITE), str(ROOT)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp")
    (logs / "pip_install.log").write_text(r.stdout + r.stderr)
    how = "pip --target"
    if r.returncode != 0:
        how = "minimal dist-info (pip failed, see pip_install.log)"
        if SITE.exists():
            shutil.rmtree(SITE)
        dist = SITE / "sm70ctl-0.1.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sm70ctl\nVersion: 0.1.0\n")
        (dist / "entry_points.txt").write_text(
            "[vllm.general_plugins]\nsm70 = vllm_patch.plugin:register\n")
        (SITE / "vllm_patch").symlink_to(ROOT / "vllm_patch")
    eps = sorted(p.name for p in SITE.glob("*.dist-info")) if SITE.exists() else []
    return {"how": how, "rc": r.returncode, "dist_info": eps,
            "seconds": round(time.time() - t, 1),
            "tail": (r.stdout + r.stderr)[-800:] if r.returncode else ""}


def side_env(side: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(":") if p and Path(p) != ROOT]
    if side == "ours":
        env["VLLM_PLUGINS"] = "sm70"
        path = [str(SITE), *path]
    else:
        env["VLLM_PLUGINS"] = ""  # no plugin is loaded, even if one were discoverable
    env["PYTHONPATH"] = ":".join(path)
    env.update({"PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "TORCH_CUDA_ARCH_LIST": "9.0",
                "SM70_KERNELS_BUILD_DIR": str(OPS_CACHE)})
    env.update(extra or {})
    return env


def start(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    fh = open(log_path, "w")  # noqa: SIM115 (closed when the process is reaped)
    return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd="/tmp")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    # Seconds from this driver's start; the device call's limit also covers the bundle
    # install before it (about 30-45 s on a fresh machine): leave that much.
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--side-args", default="",
                    help="extra ab_side.py arguments, e.g. '--max-len 33792 --bench'")
    ap.add_argument("--ours-args", default="",
                    help="extra ab_side.py arguments for our side only, e.g. "
                    "'--attention-backend CUSTOM' (stock has no plugin backend)")
    a = ap.parse_args()
    extra = a.side_args.split()
    ours_extra = a.ours_args.split()
    t0 = time.time()
    deadline = t0 + a.budget_s
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    # Only a few files come back from the device: per-side JSON and logs stay in /tmp and are
    # folded into sides_<shape>.json and logs_<shape>.txt at the end.
    work = Path("/tmp/ab") / a.shape
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    side_dir = work / "sides"
    side_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"shape": a.shape, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                          time.gmtime())}
    result_path = out / f"ab_{a.shape}.json"

    def flush() -> None:
        summary["elapsed_s"] = round(time.time() - t0, 1)
        result_path.write_text(json.dumps(summary, indent=1))

    def snapshot(procs: dict[str, subprocess.Popen]) -> None:
        sides = {}
        for n in procs:
            f = side_dir / f"{n}.json"
            try:
                sides[n] = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
        (out / f"sides_{a.shape}.json").write_text(json.dumps(sides))

    def write_logs() -> None:
        with open(out / f"logs_{a.shape}.txt", "w") as fh:
            for f in sorted(logs.glob("*.log")):
                text = f.read_text(errors="replace")
                fh.write(f"===== {f.name} ({len(text)} chars, last 12000)\n{text[-12000:]}\n")

    # Inside tests/gpu/round_call.py the plugin is installed and the checkpoints are made
    # once for every job; reinstalling would pull /tmp/sm70-site from under the others.
    prepared = os.environ.get("SM70_AB_PREPARED") == "1"
    summary["install"] = {"how": "prepared by round_call"} if prepared else install_plugin(logs)
    log(f"plugin install: {summary['install']}")
    flush()
    py = sys.executable
    build = start([py, "-c", "import time; t=time.time(); from vllm_patch.ops.loader import "
                   "load_ops; print(load_ops(verbose=False)); print('build_s', time.time()-t)"],
                  side_env("ours"), logs / "ops_build.log")
    made = prepared and (work / "made.json").exists()
    make = start(["true"] if made else
                 [py, str(HERE / "make_checkpoint.py"), "--shape", a.shape, "--out", str(work)],
                 side_env("stock", {"PYTHONPATH": str(ROOT) + ":" + os.environ.get(
                     "PYTHONPATH", "")}), logs / "make_checkpoint.log")
    rc = make.wait()
    summary["checkpoint"] = (json.loads((work / "made.json").read_text()) if rc == 0
                             else {"rc": rc})
    if rc == 0:
        summary["checkpoint"].pop("quantized_layers", None)
    log(f"checkpoint rc={rc}")
    flush()
    if rc != 0:
        write_logs()
        return 1
    modes = a.modes.split(",")
    procs: dict[str, subprocess.Popen] = {}
    if "--bench" in extra or "--profile" in extra:
        # Timed work must not share the GPU: the sides take turns once all have started.
        ready = work / "ready"
        shutil.rmtree(ready, ignore_errors=True)
        os.environ["AB_READY_DIR"] = str(ready)
        os.environ["AB_PEERS"] = str(2 * len(modes))
    for mode in modes:
        name = f"stock_{mode}"
        procs[name] = start([py, str(HERE / "ab_side.py"), "--side", "stock", "--mode", mode,
                             "--model", str(work / "fp16"),
                             "--out", str(side_dir / f"{name}.json"), *extra],
                            side_env("stock", {"VLLM_CACHE_ROOT": f"/tmp/vc_{name}"}),
                            logs / f"{name}.log")
    brc = build.wait(timeout=max(1, deadline - time.time()))
    summary["ops_build"] = {"rc": brc, "log_tail": (logs / "ops_build.log").read_text()[-600:]}
    log(f"ops build rc={brc}")
    flush()
    if brc == 0:
        for mode in modes:
            name = f"ours_{mode}"
            procs[name] = start([py, str(HERE / "ab_side.py"), "--side", "ours", "--mode", mode,
                                 "--model", str(work / "int8"),
                                 "--out", str(side_dir / f"{name}.json"), *extra,
                                 *ours_extra],
                                side_env("ours", {"VLLM_CACHE_ROOT": f"/tmp/vc_{name}"}),
                                logs / f"{name}.log")
    # Poll rather than wait: every few seconds what the sides wrote so far is copied to $OUT,
    # so a run stopped from outside (the device call's own limit) still returns it.
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(5)
        snapshot(procs)
        write_logs()
    for name, p in procs.items():
        if p.poll() is None:
            p.kill()
            p.wait()
            log(f"{name}: killed at the budget")
        log(f"{name}: rc={p.returncode}")

    from compare import compare_sides

    sides: dict[str, dict[str, Any]] = {}
    for name in procs:
        f = side_dir / f"{name}.json"
        sides[name] = json.loads(f.read_text()) if f.exists() else {"error": "no output"}
    summary["sides"] = {
        n: {k: s.get(k) for k in ("error", "startup_s", "total_s", "quantization",
                                  "cudagraph_mode", "capture_sizes", "model_summary",
                                  "plugin_imported", "plugin", "sm70_op_calls", "arch_path",
                                  "phase_seconds", "max_memory_allocated", "bench", "profile",
                                  "profile_error")}
        for n, s in sides.items()
    }
    for n, s in sides.items():
        if s.get("traceback"):
            summary["sides"][n]["traceback"] = s["traceback"][-2500:]
    comps: dict[str, Any] = {}
    for mode in modes:
        if f"ours_{mode}" in sides and f"stock_{mode}" in sides:
            comps[f"ours_vs_stock_{mode}"] = compare_sides(sides[f"stock_{mode}"],
                                                           sides[f"ours_{mode}"])
    if {"stock_eager", "stock_graphs"} <= set(sides):
        comps["stock_graphs_vs_stock_eager"] = compare_sides(sides["stock_eager"],
                                                             sides["stock_graphs"])
    summary["comparisons"] = {k: {kk: vv for kk, vv in v.items() if kk != "phases"}
                              for k, v in comps.items()}
    summary["per_request"] = {k: {ph: [{kk: r[kk] for kk in ("prompt_len", "equal",
                                                             "max_abs_dlogprob")}
                                       for r in rs] for ph, rs in v["phases"].items()}
                              for k, v in comps.items()}
    (out / f"sides_{a.shape}.json").write_text(json.dumps(sides))
    write_logs()
    summary["passed"] = bool(comps) and all(
        v["passed"] for k, v in comps.items() if k.startswith("ours_vs_stock")) and all(
        f"ours_vs_stock_{m}" in comps for m in modes)
    flush()
    log(json.dumps({k: {kk: v.get(kk) for kk in ("all_equal", "equal_requests", "requests",
                                                  "max_abs_dlogprob", "passed")}
                    for k, v in summary["comparisons"].items()}))
    log(f"passed={summary['passed']}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
