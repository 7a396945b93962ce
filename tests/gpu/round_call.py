"""Every GPU job of a round in ONE device call: shared preparation once, then the jobs side by
side, each within its own GPU memory share and the call's time budget.

Run on the GPU machine from the repository root (the `run` tool, carry .device/vllm and
.device/extra):

    . .device/vllm/install.sh && . tests/gpu/device_env.sh && \
        python3 tests/gpu/round_call.py --out $OUT --budget-s 520 [--only suite,fmha]

Preparation (overlapped): our package with its entry point into /tmp/sm70-site (run_ab's
`install_plugin`), our ops built once into /tmp/sm70-ops-cache, the tiny and the real-shape
slice checkpoints (make_checkpoint.py) in /tmp/ab/{tiny,slice}. A job starts as soon as what it
needs exists, as `python3 <script> --out <dir> --budget-s <seconds left>` with SM70_AB_TINY,
SM70_AB_SLICE, SM70_SITE, SM70_KERNELS_BUILD_DIR and SM70_GPU_SHARE in its environment, in its
own process group (killed whole at the deadline). Only a few files may come back from the
device, so everything a job writes lands in $OUT/results.tgz (rewritten every minute, so a
call stopped from outside still returns what was done) and $OUT/round.json says per job its
exit status, seconds and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AB = ROOT / "tests" / "gpu" / "ab"
OPS_CACHE = "/tmp/sm70-ops-cache"
CKPT = Path("/tmp/ab")


@dataclass
class Job:
    name: str
    cmd: list[str]
    needs: set[str]
    share: float
    proc: subprocess.Popen | None = None
    started: float | None = None
    ended: float | None = None
    rc: int | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    own_args: bool = False  # takes no --out/--budget-s (OUT is in its environment)


NEW_MUTANTS = ["decode-packed-token-stride", "kv-write-scale-at-row-start",
               "gdn-gqa-interleaved", "gdn-int16-scale-per-lane",
               "gdn-conv-update-ignores-accepted", "gdn-conv-prefill-chunk-window-shifted",
               # written this pass, not run yet
               "fmha-ctx-word-loads-off-by-4", "gdn-chunk-decay-one-token-late",
               "gdn-two-pass-decay-one-token-late"]


GDN_MUTANTS = ["gdn-chunk-decay-one-token-late", "gdn-two-pass-decay-one-token-late",
               "gdn-gqa-interleaved", "gdn-int16-scale-per-lane"]


def jobs(py: str) -> list[Job]:
    """The round's jobs; a missing script is reported as such, not skipped silently."""
    def script(rel: str, name: str, needs: set[str], share: float) -> Job:
        return Job(name, [py, str(ROOT / rel)], needs, share)

    return [
        Job("suite", ["bash", str(ROOT / "tests/gpu/run_on_device.sh"), "-n", "3"],
            {"ops"}, 0.04, extra_env={"MUTANT_PARALLEL": "2"}, own_args=True),
        Job("allreduce1", [py, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p",
                           "no:cacheprovider", "-rf", str(ROOT / "tests/test_allreduce_gpu.py")],
            {"ops"}, 0.02, own_args=True),
        # the GDN kernels' GPU tests and mutants alone: the check of a GDN-only change (the
        # chunk kernels' tests are the gdn_chunk job's)
        Job("gdn_tests", [py, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p",
                          "no:cacheprovider", "-rf", str(ROOT / "tests/gpu/test_gdn_gpu.py")],
            {"ops"}, 0.03, own_args=True),
        Job("mutants_gdn", ["bash", "-c", f"nice -n 15 {py} {ROOT}/tests/gpu/mutants.py --only "
                            f"{' '.join(GDN_MUTANTS)} --jobs 2 --parallel 2 "
                            '--out "$OUT/mutants_gdn.json"'],
            {"ops"}, 0.03, own_args=True),
        # the mutants of this round's kernels (the suite's full list did not fit beside the
        # vLLM jobs), built at low priority
        Job("mutants_new", ["bash", "-c", f"nice -n 15 {py} {ROOT}/tests/gpu/mutants.py --only "
                            f"{' '.join(NEW_MUTANTS)} --jobs 2 --parallel 2 "
                            '--out "$OUT/mutants.json"'],
            {"ops"}, 0.03, own_args=True),
        script("tests/gpu/ab/run_stack.py", "stack", {"ops", "tiny", "warm"}, 0.12),
        script("tests/gpu/fmha/device_fmha.py", "fmha", {"ops"}, 0.04),
        script("tests/gpu/gdn_chunk/device_gdn_chunk.py", "gdn_chunk", {"ops"}, 0.04),
        script("tests/gpu/clef/device_clef.py", "clef", {"ops"}, 0.04),
        script("tests/gpu/clef/device_clef_vllm.py", "clef_vllm", {"ops", "tiny", "warm"}, 0.12),
        Job("backend", [py, str(ROOT / "tests/gpu/attention/device_backend_ab.py"),
                        "--skip-pytest", "--skip-mutant"], {"ops", "tiny", "warm"}, 0.2),
        script("tests/gpu/gdn/device_gdn.py", "gdn", {"ops", "tiny", "warm"}, 0.15),
        # the int16 pool against stock alone (its first start-up fix)
        Job("gdn_int16", [py, str(ROOT / "tests/gpu/gdn/device_gdn.py"), "--steps", "ab",
                          "--sides", "stock,ours_int16"], {"ops", "tiny", "warm"}, 0.08),
        script("tests/gpu/serving/device_spec_prefix.py", "spec_prefix", {"ops", "tiny", "warm"},
               0.12),
        script("tests/gpu/serving/device_openai.py", "openai", {"ops", "tiny", "warm"}, 0.07),
        script("tests/gpu/serving/device_draft_int8.py", "draft_int8", {"ops", "tiny", "warm"},
               0.08),
        script("tests/gpu/serving/device_assist.py", "assist", {"ops", "tiny", "warm"}, 0.08),
        script("tests/gpu/logprobs/device_logprobs.py", "logprobs", {"ops", "slice", "warm"},
               0.28),
        # which of speculation, prefix caching and our stack loses tokens (issue 24 item 2)
        script("tests/gpu/serving/device_spec_diag.py", "spec_diag", {"ops", "tiny", "warm"},
               0.16),
        # R10's proof: n-gram with it (ON, OA) and without it (ONg) against plain decoding
        Job("spec_gates", [py, str(ROOT / "tests/gpu/serving/device_spec_diag.py"), "--only",
                           "O0,ON,ONg,OA", "--work", "/tmp/spec_gates"],
            {"ops", "tiny", "warm"}, 0.12),
        # the real-shape slice A/B with the decode / prefill bench and the CUPTI op split;
        # it needs no warm-up engine (its own shapes), so it starts as soon as its
        # checkpoint exists
        Job("slice_bench", ["bash", "-c", f"{py} {AB}/run_ab.py --shape slice --out $OUT "
                            "--budget-s 470 --modes graphs --side-args '--max-len 33792 "
                            "--max-batched 2048 --kv-gib 8 --util 0.25 --bench --quick-bench "
                            "--profile --phases single,batch16' ; "
                            f"{py} {ROOT}/bench/bench_vllm_decode.py $OUT/sides_slice.json "
                            "--out $OUT/h200_vllm_decode.json ; "
                            f"{py} {ROOT}/bench/profile_vllm_ops.py $OUT/sides_slice.json "
                            "--out $OUT/h200_vllm_op_split.json"],
            {"ops", "slice"}, 0.5, own_args=True),
        # the same slice with our side on the whole stack: the plugin's attention backend
        # (SM70_PAGED: our KV write and paged decode, Triton prefill) and our GDN layer with
        # the chunked prefill on float32 state (SM70_GDN_KERNEL=sm70_chunk): the real-shape
        # run that gates their defaults
        Job("slice_paged", ["bash", "-c", f"{py} {AB}/run_ab.py --shape slice --out $OUT "
                            "--budget-s 470 --modes graphs --side-args '--max-len 33792 "
                            "--max-batched 2048 --kv-gib 8 --util 0.25 --bench --quick-bench "
                            "--phases single,batch16' --ours-args '--attention-backend CUSTOM "
                            "--plugin-config {\"gdn\":{\"decode_layer\":true,"
                            "\"kernel\":\"sm70\",\"prefill\":\"sm70\","
                            "\"state_dtype\":\"float32\"}}' ; "
                            f"{py} {ROOT}/bench/bench_vllm_decode.py $OUT/sides_slice.json "
                            "--out $OUT/h200_vllm_decode_paged.json"],
            {"ops", "slice"}, 0.5, own_args=True),
        Job("attn_decode_bench", ["bash", "-c", f"{py} {ROOT}/bench/bench_attention_decode.py "
                                  "--out $OUT/h200_attention_decode.json"],
            {"ops"}, 0.1, own_args=True),
        # the FMHA prefill on vLLM's TRITON_ATTN page (4-byte context loads) and its refusals
        Job("fmha_page", [py, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p",
                          "no:cacheprovider", "-rf", str(ROOT / "tests/gpu/test_fmha_gpu.py"),
                          "-k", "triton_attn_page or row_alignments or refuses"],
            {"ops"}, 0.04, own_args=True),
        # the tiny A/B with our side on the Volta m8n8k4 instantiations (set_arch_path)
        Job("ab_tiny_sm70", [py, str(AB / "run_ab.py"), "--shape", "tiny", "--side-args",
                             "--arch-path sm70 --util 0.03 --kv-gib 1"],
            {"ops", "tiny", "warm"}, 0.12, extra_env={"SM70_AB_PREPARED": "1"}),
    ]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pack(out: Path, work: Path) -> None:
    """results.tgz of everything under work (logs capped by the jobs themselves)."""
    tmp = out / "results.tgz.tmp"
    with tarfile.open(tmp, "w:gz") as tf:
        tf.add(work, arcname="round")
    tmp.replace(out / "results.tgz")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=520)
    ap.add_argument("--only", default="", help="comma-separated job names (default: all)")
    ap.add_argument("--no-warm", action="store_true",
                    help="start the vLLM jobs without the warm-up engine (short calls)")
    a = ap.parse_args()
    t0 = time.time()
    deadline = t0 + a.budget_s
    out = a.out
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    sys.path.insert(0, str(AB))
    from run_ab import install_plugin, side_env

    state: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "prep": {}, "jobs": {}}

    def flush() -> None:
        state["elapsed_s"] = round(time.time() - t0, 1)
        (out / "round.json").write_text(json.dumps(state, indent=1))

    prep_logs = work / "prep"
    prep_logs.mkdir(exist_ok=True)
    state["prep"]["install"] = install_plugin(prep_logs)
    base_env = {"SM70_KERNELS_BUILD_DIR": OPS_CACHE, "TORCH_CUDA_ARCH_LIST": "9.0",
                "SM70_AB_TINY": str(CKPT / "tiny"), "SM70_AB_SLICE": str(CKPT / "slice"),
                "SM70_SITE": "/tmp/sm70-site", "PYTHONUNBUFFERED": "1", "MAX_JOBS": "16",
                "SM70_AB_PREPARED": "1",
                # one Triton and one Inductor cache for every engine: the warm-up engine below
                # compiles vLLM's and FLA's Triton kernels once instead of each engine doing so
                # at the same time (the previous round call's engines spent 4 minutes there)
                "TRITON_CACHE_DIR": "/tmp/triton-cache",
                "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor-cache"}
    os.environ.update(base_env)

    def bg(cmd: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        fh = open(prep_logs / f"{name}.log", "w")  # noqa: SIM115 (lives with the process)
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)

    ops_env = side_env("ours", {"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
                                **base_env})
    build = bg([py, "-c", "import time; t=time.time(); from vllm_patch.ops.loader import "
                "load_ops; print(load_ops(verbose=True)); print('build_s', time.time()-t)"],
               ops_env, "ops_build")
    ck_env = side_env("stock", {"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    ck_cmd = (f"{py} {AB / 'make_checkpoint.py'} --shape tiny --out {CKPT / 'tiny'} && "
              f"touch {CKPT / 'tiny.done'} && "
              f"{py} {AB / 'make_checkpoint.py'} --shape slice --out {CKPT / 'slice'} && "
              f"touch {CKPT / 'slice.done'}")
    ckpt = bg(["bash", "-c", ck_cmd], ck_env, "checkpoints")

    warm: subprocess.Popen | None = None
    warm_started = 0.0
    selected = {s for s in a.only.split(",") if s}
    todo = [j for j in jobs(py) if not selected or j.name in selected]
    for j in todo:
        if not j.own_args and not Path(j.cmd[1]).exists():
            state["jobs"][j.name] = {"rc": None, "error": f"script {j.cmd[1]} does not exist"}
            j.rc = -999
    todo = [j for j in todo if j.rc is None]
    have: set[str] = {"warm"} if a.no_warm else set()
    last_pack = 0.0
    while time.time() < deadline:
        if "ops" not in have and build.poll() is not None:
            state["prep"]["ops_build_rc"] = build.returncode
            state["prep"]["ops_build_tail"] = (prep_logs / "ops_build.log").read_text()[-1500:]
            if build.returncode == 0:
                have.add("ops")
            else:
                have.add("ops_failed")
            log(f"ops build rc={build.returncode}")
        for shape in ("tiny", "slice"):
            if shape not in have and (CKPT / f"{shape}.done").exists():
                have.add(shape)
                log(f"checkpoint {shape} ready")
        if ckpt.poll() not in (None, 0):
            state["prep"]["checkpoints_rc"] = ckpt.returncode
        if warm is None and not a.no_warm and {"ops", "tiny"} <= have:
            # stock vLLM, eager, on the tiny fp16 copy: a short prompt and a chunked long one
            warm = bg([py, str(AB / "ab_side.py"), "--side", "stock", "--mode", "eager",
                       "--model", str(CKPT / "tiny" / "fp16"), "--phases", "single,p3000",
                       "--util", "0.03", "--kv-gib", "1", "--out", str(prep_logs / "warm.json")],
                      side_env("stock", {"VLLM_CACHE_ROOT": "/tmp/vc_warm"}), "warm")
            warm_started = time.time()
            log("warm-up engine started")
        if warm is not None and "warm" not in have and (
                warm.poll() is not None or time.time() - warm_started > 150):
            have.add("warm")
            state["prep"]["warm_rc"] = warm.poll()
            state["prep"]["warm_s"] = round(time.time() - warm_started, 1)
            log(f"warm-up done rc={warm.poll()} after {time.time() - warm_started:.0f} s")
        for j in todo:
            if j.proc is None and j.needs <= have:
                left = deadline - time.time() - 10
                jd = work / j.name
                jd.mkdir(exist_ok=True)
                cmd = [*j.cmd, "--out", str(jd), "--budget-s", str(int(left))]
                env = dict(os.environ, SM70_GPU_SHARE=str(j.share), OUT=str(jd), **j.extra_env)
                env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
                if j.own_args:
                    cmd = list(j.cmd)
                fh = open(jd / "run.log", "w")  # noqa: SIM115 (lives with the process)
                j.proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                          cwd=ROOT, start_new_session=True)
                j.started = time.time()
                log(f"{j.name} started ({int(left)} s left)")
        for j in todo:
            if j.proc is not None and j.rc is None and j.proc.poll() is not None:
                j.rc, j.ended = j.proc.returncode, time.time()
                log(f"{j.name} rc={j.rc} after {j.ended - (j.started or j.ended):.0f} s")
        for j in todo:
            info: dict[str, Any] = {"rc": j.rc, "needs": sorted(j.needs), "share": j.share}
            if j.started:
                info["seconds"] = round((j.ended or time.time()) - j.started, 1)
            summ = work / j.name / "summary.json"
            if summ.exists():
                try:
                    info["summary"] = json.loads(summ.read_text())
                except ValueError:
                    info["summary"] = "unreadable"
            state["jobs"][j.name] = info
        state["have"] = sorted(have)
        flush()
        if all(j.rc is not None for j in todo) or "ops_failed" in have:
            break
        warm_over = "warm" in have or (warm is None and not {"ops", "tiny"} <= have)
        if ckpt.poll() is not None and build.poll() is not None and warm_over:
            # prep is over: a job still waiting now waits for a checkpoint that failed
            waiting = [j for j in todo if j.proc is None]
            running = [j for j in todo if j.proc is not None and j.rc is None]
            if not running and all(not j.needs <= have for j in waiting):
                break
        if time.time() - last_pack > 60:
            pack(out, work)
            last_pack = time.time()
        time.sleep(3)
    for j in todo:
        if j.proc is not None and j.rc is None:
            try:
                os.killpg(j.proc.pid, signal.SIGTERM)
                time.sleep(2)
                os.killpg(j.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            j.proc.wait()
            state["jobs"][j.name]["rc"] = "killed at the deadline"
            log(f"{j.name}: killed at the deadline")
        elif j.proc is None:
            state["jobs"][j.name]["rc"] = "never started (needs: " + ",".join(
                sorted(j.needs - have)) + ")"
    for p in (build, ckpt, warm):
        if p is not None and p.poll() is None:
            p.kill()
    flush()
    pack(out, work)
    log(json.dumps({n: v.get("rc") for n, v in state["jobs"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
