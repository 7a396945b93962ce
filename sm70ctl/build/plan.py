"""The build graph: which steps exist, what each one's key is made of, what each does.

`build_steps` is where the inputs of every step are declared. Only what changes a step's
output goes into its inputs: lock entries (by immutable id, never by URL, so a mirror
and upstream give the same keys), patch contents, the settings that change compiled
code (the arch list), and the toolchain versions. MAX_JOBS and NVCC_THREADS only change
how fast a step runs, so they are not part of any key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.build import kernels as kernel_list
from sm70ctl.build.local_sources import kernel_sources_dir, kernel_sources_hash
from sm70ctl.build.lock import Lock, tree_hash
from sm70ctl.build.mirror import Locator, fetch_file
from sm70ctl.build.patches import Patch, apply_series
from sm70ctl.build.sources import git_checkout, unpack_archive
from sm70ctl.build.steps import Step, StepContext, StepError
from sm70ctl.build.toolchain import ToolchainProbe, max_jobs, toolchain_problems

# Stages in order; `--stop-after STAGE` builds every step up to and including it.
STAGES = ("fetch", "patch", "env", "compile", "install")

# vLLM's CMake fetches these at configure time unless pointed at a local copy; the build
# gives it our pinned checkouts so nothing is downloaded behind the lock's back.
EXTERNAL_SRC_ENV = {
    "cutlass": "VLLM_CUTLASS_SRC_DIR",
    "vllm-flash-attn": "VLLM_FLASH_ATTN_SRC_DIR",
    "flashmla": "FLASH_MLA_SRC_DIR",
    "qutlass": "QUTLASS_SRC_DIR",
    "deepgemm": "DEEPGEMM_SRC_DIR",
    "triton-kernels": "TRITON_KERNELS_SRC_DIR",
}


@dataclass(frozen=True)
class BuildConfig:
    build_dir: Path
    serve_python: Path
    project_root: Path  # holds vllm_patch/ (and, in a checkout, pyproject.toml)
    series: tuple[Patch, ...]
    mirror_dir: Path | None = None
    offline: bool = False
    cuda_home: str = ""
    cuda_arch_list: str = "7.0"
    max_jobs: int = 0
    nvcc_threads: int = 2
    host_cc: str = ""
    stop_after: str = "install"
    extra: dict[str, Any] = field(default_factory=dict)
    csrc_dir: Path | None = None  # the kernel sources; None: where the ops loader finds them

    @property
    def csrc(self) -> Path:
        return self.csrc_dir if self.csrc_dir is not None else kernel_sources_dir()

    @property
    def steps_dir(self) -> Path:
        return self.build_dir / "steps"

    @property
    def log_dir(self) -> Path:
        return self.build_dir / "logs"


def _sm(cfg: BuildConfig) -> str:
    return ", ".join(f"sm_{a.strip().replace('.', '')}" for a in cfg.cuda_arch_list.split(";"))


def _stage_ok(cfg: BuildConfig, stage: str) -> bool:
    return STAGES.index(stage) <= STAGES.index(cfg.stop_after)


def toolchain_inputs(probe: ToolchainProbe) -> dict[str, str]:
    return {"nvcc": probe.nvcc_release, "host_cc": probe.host_cc_version}


def _run_logged(cmd: list[str], env: dict[str, str], ctx: StepContext, what: str,
                cwd: Path | None = None) -> None:
    """Run a build command, its output going to the build log; fail naming `what`."""
    ctx.log(f"$ {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        ctx.log(line.rstrip())
        tail = [*tail, line.rstrip()][-5:]
    if proc.wait() != 0:
        raise StepError(f"{what} failed (exit {proc.returncode}): {' | '.join(tail)}",
                        hint="the build log has the full output")


def build_steps(lock: Lock, cfg: BuildConfig, probe: ToolchainProbe) -> list[Step]:
    locator = Locator(cfg.offline, cfg.mirror_dir)
    steps: list[Step] = []

    # --- fetch: git sources at their pinned commit --------------------------------------
    for g in lock.git:
        def run_git(ctx: StepContext, g=g) -> None:
            head = git_checkout(locator.git(g), g.commit, g.tag, ctx.out / "src",
                                offline=cfg.offline, log=ctx.log)
            (ctx.out / "HEAD").write_text(head + "\n")

        steps.append(Step(f"git-{g.name}", "fetch", f"{g.name} at {g.ref[:12]}",
                          g.ident(), run_git))

    # --- fetch: archives, verified by sha256 --------------------------------------------
    for a in lock.archives:
        def run_archive(ctx: StepContext, a=a) -> None:
            fetch_file(locator.archive(a), ctx.out / a.filename, a.sha256,
                       f"archive {a.name}", ctx.progress)

        steps.append(Step(f"archive-{a.name}", "fetch", a.filename, a.ident(), run_archive))

    # --- fetch: the serving environment's wheelhouse -------------------------------------
    if lock.wheels:
        def run_wheels(ctx: StepContext) -> None:
            for i, w in enumerate(lock.wheels):
                ctx.log(f"wheel {i + 1}/{len(lock.wheels)} {w.filename}")
                if not w.sha256:
                    ctx.log(f"warning: {w.filename} is UNVERIFIED: {w.unverified}")
                fetch_file(locator.wheel(w), ctx.out / w.filename, w.sha256,
                           f"wheel {w.name}", ctx.progress)

        steps.append(Step("wheelhouse", "fetch", f"{len(lock.wheels)} wheels",
                          {"wheels": [w.ident() for w in lock.wheels]}, run_wheels))

    # --- patch: unpack each patched archive and apply the series ------------------------
    series = list(cfg.series)
    for a in lock.archives:
        if not a.patch or not _stage_ok(cfg, "patch"):
            continue

        def run_patch(ctx: StepContext, a=a) -> None:
            src = ctx.out / "src"
            src.mkdir()
            unpack_archive(ctx.deps[f"archive-{a.name}"] / a.filename, src, a.strip)
            applied = apply_series(src, series, log=ctx.log)
            (ctx.out / "APPLIED").write_text("".join(f"{n}\n" for n in applied))

        steps.append(Step(
            f"patch-{a.name}", "patch", f"{a.name} + {len(series)} patch(es)",
            {"patches": [[p.name, p.sha256] for p in series]}, run_patch,
            deps=(f"archive-{a.name}",),
        ))

    if not _stage_ok(cfg, "env"):
        return [s for s in steps if _stage_ok(cfg, s.kind)]

    # --- env: install the pinned wheels into the serving interpreter --------------------
    serve_py = str(cfg.serve_python)

    def run_env(ctx: StepContext) -> None:
        if not cfg.serve_python.exists():
            raise StepError(
                f"serving interpreter {serve_py} does not exist",
                hint=f"create it: python{lock.toolchain.python} -m venv <dir>, then set "
                     "SM70_SERVE_PYTHON=<dir>/bin/python",
            )
        have = subprocess.run(
            [serve_py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, check=False).stdout.strip()
        if have != lock.toolchain.python:
            raise StepError(
                f"serving interpreter {serve_py} is Python {have or '?'}; the lock's wheels "
                f"are for Python {lock.toolchain.python}",
                hint=f"point SM70_SERVE_PYTHON at a python{lock.toolchain.python} venv")
        house = ctx.deps.get("wheelhouse")
        wheels = sorted(str(p) for p in house.glob("*.whl")) if house else []
        if wheels:
            # Dependencies resolve from the wheelhouse only: one the lock does not pin
            # fails here by name instead of being fetched from an index.
            _run_logged([serve_py, "-m", "pip", "install", "--no-index", "--find-links",
                         str(house), *wheels], _env(cfg), ctx, "installing the pinned wheels")
        (ctx.out / "python").write_text(serve_py + "\n")

    steps.append(Step("serve-env", "env", f"pinned wheels -> {serve_py}",
                      {"python": serve_py, "want": lock.toolchain.python},
                      run_env, deps=("wheelhouse",) if lock.wheels else (),
                      still_valid=lambda out: cfg.serve_python.exists()))

    if not _stage_ok(cfg, "compile"):
        return steps

    # --- compile: our csrc kernels and the patched vLLM ---------------------------------
    csrc = cfg.csrc
    tc_inputs = toolchain_inputs(probe)

    def ensure_toolchain() -> None:
        problems = toolchain_problems(probe, lock.toolchain, cfg.cuda_arch_list)
        if problems:
            raise StepError("cannot compile here: " + "; ".join(problems),
                            hint="set SM70_CUDA_HOME to a CUDA 12.8 toolkit and SM70_HOST_CC "
                                 "to gcc 11.4-14 (docs/build.md)")

    def run_kernels(ctx: StepContext) -> None:
        ensure_toolchain()
        script = Path(__file__).with_name("compile_kernels.py")
        cmd = [serve_py, str(script), "--csrc", str(csrc), "--out", str(ctx.out)]
        _run_logged(cmd, _compile_env(cfg, probe), ctx, "compiling csrc/ kernels")

    kernel_files = [p.relative_to(csrc).as_posix() for p in
                    kernel_list.kernel_sources(csrc) + kernel_list.binding_sources(csrc)]
    steps.append(Step(
        "compile-kernels", "compile", f"csrc/ ({len(kernel_files)} files) for {_sm(cfg)}",
        {"csrc": kernel_sources_hash(csrc), "files": kernel_files, "arch": cfg.cuda_arch_list,
         "toolchain": tc_inputs},
        run_kernels, deps=("serve-env",),
    ))

    patched = [a for a in lock.archives if a.patch]
    gits = {g.name for g in lock.git}
    if patched:
        a = patched[0]

        def run_vllm(ctx: StepContext, a=a) -> None:
            ensure_toolchain()
            env = _compile_env(cfg, probe)
            for name, var in EXTERNAL_SRC_ENV.items():
                if f"git-{name}" in ctx.deps:
                    env[var] = str(ctx.deps[f"git-{name}"] / "src")
            _run_logged([serve_py, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                         "-w", str(ctx.out), str(ctx.deps[f"patch-{a.name}"] / "src")],
                        env, ctx, f"building {a.name} for {_sm(cfg)}")

        deps = (f"patch-{a.name}", "serve-env",
                *(f"git-{n}" for n in EXTERNAL_SRC_ENV if n in gits))
        steps.append(Step(f"compile-{a.name}", "compile", f"{a.name} wheel for {_sm(cfg)}",
                          {"arch": cfg.cuda_arch_list, "toolchain": tc_inputs}, run_vllm,
                          deps=deps))

    if not _stage_ok(cfg, "install"):
        return steps

    # --- install: the built wheels, our plugin and kernels into the serving env ----------
    def run_install(ctx: StepContext) -> None:
        if not (cfg.project_root / "pyproject.toml").is_file():
            # a wheel install has the packages but not the project pip installs them from
            raise StepError(
                f"no sm70ctl source tree at {cfg.project_root} to install into {serve_py}",
                hint="run `sm70ctl build` from a checkout (pip install -e .), or install the "
                     "sm70ctl wheel into the serving interpreter yourself")
        built = [str(p) for d in ctx.deps.values() for p in d.glob("*.whl")]
        env = _env(cfg)
        if built:
            _run_logged([serve_py, "-m", "pip", "install", "--no-index", "--no-deps",
                         "--force-reinstall", *built], env, ctx, "installing built wheels")
        _run_logged([serve_py, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                     str(cfg.project_root)], env, ctx, "installing sm70ctl + vllm_patch")
        lib_dir = Path(subprocess.run(
            [serve_py, "-c", "import vllm_patch, os; print(os.path.dirname(vllm_patch.__file__))"],
            capture_output=True, text=True, check=True, env=env).stdout.strip()) / "_lib"
        lib_dir.mkdir(exist_ok=True)
        for so in ctx.deps["compile-kernels"].glob("*.so"):
            (lib_dir / so.name).write_bytes(so.read_bytes())
        (ctx.out / "installed").write_text("\n".join(built) + "\n")

    install_deps = (*(s.name for s in steps if s.kind == "compile"), "serve-env")
    steps.append(Step("install", "install", f"into {serve_py}",
                      {"project": tree_hash(cfg.project_root / "vllm_patch")}, run_install,
                      deps=install_deps, still_valid=lambda out: cfg.serve_python.exists()))
    return steps


def _env(cfg: BuildConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    if cfg.offline:
        env["PIP_NO_INDEX"] = "1"
    return env


def _compile_env(cfg: BuildConfig, probe: ToolchainProbe) -> dict[str, str]:
    env = _env(cfg)
    cuda_home = probe.cuda_home
    env.update({
        "TORCH_CUDA_ARCH_LIST": cfg.cuda_arch_list,
        "MAX_JOBS": str(max_jobs(cfg.max_jobs, probe.mem_available, os.cpu_count() or 1)),
        "NVCC_THREADS": str(cfg.nvcc_threads),
        "VLLM_TARGET_DEVICE": "cuda",
        "CUDA_HOME": cuda_home,
        "PATH": f"{cuda_home}/bin:{env.get('PATH', '/usr/bin:/bin')}",
    })
    if cfg.host_cc:
        cxx = cfg.host_cc.replace("gcc", "g++") if "gcc" in cfg.host_cc else cfg.host_cc
        env.update({"CC": cfg.host_cc, "CXX": cxx, "CUDAHOSTCXX": cxx, "NVCC_CCBIN": cxx})
    return env


def python_identity() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"
