"""`sm70ctl build` and the `sm70ctl mirror` group: argument plumbing and rendering.

Imported when the CLI starts: only typer and our option aliases at module level; the
build machinery is imported inside the commands.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from sm70ctl.options import EnvFileOpt, JsonOpt
from sm70ctl.settings.typed import SettingsView

LockOpt = Annotated[
    Optional[Path],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
    typer.Option("--lock", help="Lock file to build from (default: the one shipped with "
                 "sm70ctl, sm70.lock.toml at the repository root).", metavar="FILE",
                 dir_okay=False),
]
MirrorOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--mirror", help="Mirror folder (default: SM70_MIRROR_DIR).", metavar="DIR",
                 file_okay=False),
]
OfflineOpt = Annotated[bool, typer.Option(
    "--offline", help="Use only the mirror; no network access at all. Fails up front "
    "listing every pinned item the mirror lacks.")]
DryRunOpt = Annotated[bool, typer.Option(
    "--dry-run", help="Print every pinned input and the plan (cached/stale/missing and why); "
    "build nothing.")]
StopOpt = Annotated[str, typer.Option(
    "--stop-after", help="Last stage to run: fetch, patch, env, compile or install.",
    metavar="STAGE")]
PatchesOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--patches", help="Patch series folder (default: vllm_patch/patches).",
                 metavar="DIR", file_okay=False),
]
RelockOpt = Annotated[bool, typer.Option(
    "--relock", help="Rewrite the content hashes of local sources (csrc/) in the lock, then "
    "exit.")]


def _settings(env_file: Path | None) -> Any:
    from sm70ctl.settings import load_settings

    return load_settings(env_file=env_file)


def _config(settings: SettingsView, *, mirror: Path | None, offline: bool, stop_after: str,
            patches: Path | None = None):
    from sm70ctl.build.local_sources import kernel_sources_dir
    from sm70ctl.build.lock import project_root
    from sm70ctl.build.patches import list_series, series_dir
    from sm70ctl.build.plan import STAGES, BuildConfig
    from sm70ctl.errors import UsageError

    if stop_after not in STAGES:
        raise UsageError(f"--stop-after {stop_after!r} is not a stage; use one of "
                         f"{', '.join(STAGES)}")
    mirror_dir = mirror or getattr(settings, "mirror_dir", None)

    def _path(v: Any, default: str) -> Path:
        return Path(os.path.expanduser(str(v or default)))

    return BuildConfig(
        build_dir=_path(getattr(settings, "build_dir", None), "~/.cache/sm70ctl/build"),
        serve_python=_path(getattr(settings, "serve_python", None),
                           "~/.cache/sm70ctl/serve-env/bin/python"),
        project_root=project_root(),
        series=tuple(list_series(patches or series_dir())),
        csrc_dir=kernel_sources_dir(),
        mirror_dir=Path(os.path.expanduser(str(mirror_dir))) if mirror_dir else None,
        offline=offline,
        cuda_home=str(getattr(settings, "cuda_home", "") or ""),
        cuda_arch_list=str(getattr(settings, "cuda_arch_list", "7.0") or "7.0"),
        max_jobs=int(getattr(settings, "max_jobs", 0) or 0),
        nvcc_threads=int(getattr(settings, "nvcc_threads", 2) or 2),
        host_cc=str(getattr(settings, "host_cc", "") or ""),
        stop_after=stop_after,
    )


def build(
    offline: OfflineOpt = False,
    mirror: MirrorOpt = None,
    dry_run: DryRunOpt = False,
    stop_after: StopOpt = "install",
    lock: LockOpt = None,
    patches: PatchesOpt = None,
    relock: RelockOpt = False,
    json_out: JsonOpt = False,
    env_file: EnvFileOpt = None,
) -> None:
    """Fetch the pinned sources, apply the vllm_patch series, build csrc/ and vLLM for
    sm_70, and install them into the serving environment (SM70_SERVE_PYTHON).

    Every step is content-addressed: a rebuild with unchanged inputs does nothing, a
    changed input rebuilds only what depends on it, and a killed build resumes. The log
    goes to SM70_BUILD_DIR/logs/.

    Examples:

        sm70ctl build --dry-run

        sm70ctl build --stop-after patch

        SM70_CUDA_HOME=/usr/local/cuda-12.8 sm70ctl build

        sm70ctl build --offline --mirror /srv/mirror

    The first lists every pinned input and what would run; the second fetches,
    verifies and patches the sources without compiling; the third is the whole build;
    the last uses only the mirror, with no network access.
    """
    from sm70ctl.build.lock import load_lock, packaged_lock_path, relock_local
    from sm70ctl.output import Output

    out = Output(json_out)
    if relock:
        from sm70ctl.build.local_sources import kernel_sources_dir
        from sm70ctl.build.lock import project_root

        path = lock or packaged_lock_path()
        changed = relock_local(path, project_root(), kernel_sources_dir())
        data = {"lock": str(path), "changed": {k: {"old": o, "new": n}
                                                for k, (o, n) in changed.items()}}
        out.emit(data, lambda c: c.print(
            f"{path}: " + (", ".join(f"{k} {o[:12]} -> {n[:12]}" for k, (o, n) in
                                     changed.items()) or "local hashes already current")))
        return
    settings = _settings(env_file)
    cfg = _config(settings, mirror=mirror, offline=offline, stop_after=stop_after,
                  patches=patches)
    the_lock = load_lock(lock)
    from sm70ctl.build.runner import dry_run_data, render_plan, run_build

    if dry_run:
        data = dry_run_data(the_lock, cfg)
        out.emit(data, lambda c: render_plan(c, data))
        return
    result = run_build(the_lock, cfg, out)
    out.emit(result, None if json_out else (lambda c: c.print(result["summary"])))


# --- mirror group -------------------------------------------------------------------------

mirror_app = typer.Typer(
    name="mirror",
    help="Create or verify the offline mirror of every pinned input (git, archives, wheels).",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


@mirror_app.command("create")
def mirror_create(
    directory: Annotated[Path, typer.Argument(help="Mirror folder (created if missing).",
                                              metavar="DIR", file_okay=False)],
    lock: LockOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Fill DIR with every input the lock pins (run on a connected machine).

    Idempotent: items already present and verified are kept; git mirrors are refreshed.

    Example:

        sm70ctl mirror create /srv/mirror && rsync -a /srv/mirror offline-host:/srv/
    """
    from sm70ctl.build.lock import load_lock
    from sm70ctl.build.mirror import create_mirror
    from sm70ctl.output import Output

    out = Output(json_out)
    the_lock = load_lock(lock)
    t0 = time.monotonic()
    items = create_mirror(the_lock, directory, log=out.info)
    _emit_items(out, directory, items, f"mirror filled in {time.monotonic() - t0:.1f}s")


@mirror_app.command("verify")
def mirror_verify(
    directory: Annotated[Path, typer.Argument(help="Mirror folder.", metavar="DIR",
                                              file_okay=False)],
    lock: LockOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check DIR against the lock: every git commit present, every file's sha256.

    Exit 1 when anything is missing or does not match; unverified pins are reported.

    Example:

        sm70ctl mirror verify /srv/mirror --json
    """
    from sm70ctl.build.lock import load_lock
    from sm70ctl.build.mirror import check_mirror
    from sm70ctl.errors import Sm70Error
    from sm70ctl.output import Output
    from sm70ctl.readers import check_path

    out = Output(json_out)
    the_lock = load_lock(lock)
    if not check_path(directory, "mirror folder").is_dir():
        raise Sm70Error(f"mirror folder {directory} does not exist")
    items = check_mirror(the_lock, directory, hashes=True)
    bad = [i for i in items if i.status in ("missing", "mismatch")]
    _emit_items(out, directory, items, "mirror complete" if not bad else
                f"{len(bad)} item(s) missing or wrong")
    if bad:
        raise typer.Exit(1)


def _emit_items(out: Any, directory: Path, items: list, summary: str) -> None:
    from dataclasses import asdict

    from sm70ctl.output import make_table

    status_map = {"ok": "ok", "missing": "fail", "mismatch": "fail", "unverified": "warn"}
    data = {"mirror": str(directory), "summary": summary, "items": [asdict(i) for i in items]}

    def render(c: Any) -> None:
        rows = [(status_map[i.status], i.kind, i.name, i.path, i.detail) for i in items]
        c.print(make_table(f"mirror {directory}", ["status", "kind", "name", "path", "detail"],
                           rows, status_column=0))
        c.print(summary)

    out.emit(data, render)


def register(app: typer.Typer) -> None:
    app.command("build")(build)
    app.add_typer(mirror_app, name="mirror")
