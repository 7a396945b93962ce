"""`sm70ctl doctor`: argument plumbing and rendering; the work is in probes.py/checks.py.

Imported when the CLI starts: only typer and our option aliases at module level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from sm70ctl.options import EnvFileOpt, JsonOpt

CheckOpt = Annotated[
    Optional[list[str]],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
    typer.Option(
        "--check",
        "-c",
        help="Run only this check (an id such as gpu.memory, or a group such as gpu). Repeatable.",
        metavar="ID",
    ),
]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Treat warnings as failures (exit 1).")]
RecordOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option(
        "--record",
        help="Also write the raw probe data to FILE (JSON), to attach to a bug report.",
        metavar="FILE",
        dir_okay=False,
    ),
]
ProbeDataOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option(
        "--probe-data",
        help="Judge probe data recorded with --record instead of probing this machine.",
        metavar="FILE",
        dir_okay=False,
        hidden=True,
    ),
]


def doctor(
    json_out: JsonOpt = False,
    strict: StrictOpt = False,
    check: CheckOpt = None,
    env_file: EnvFileOpt = None,
    record: RecordOpt = None,
    probe_data: ProbeDataOpt = None,
) -> None:
    """Check that this machine can build and serve the stack: driver, CUDA 12.8, gcc,
    the serving Python and its torch, the V100 pair, disk and limits.

    Exit status: 0 when nothing fails, 1 when a check fails (or warns, with --strict),
    2 on a usage error.

    Examples:

        sm70ctl doctor                          # the table
        sm70ctl doctor --json > doctor.json     # for scripts (schema in docs/doctor.md)
        sm70ctl doctor --check gpu.memory --check cuda   # one check, one group
        sm70ctl doctor --strict                 # warnings fail too
        sm70ctl doctor --record probes.json     # attach probes.json to a bug report
    """
    import os

    from sm70ctl.doctor import checks as ck
    from sm70ctl.doctor import probes as pr
    from sm70ctl.errors import UsageError
    from sm70ctl.output import Output

    try:
        selected = ck.select(check)
    except ValueError as exc:
        raise UsageError(
            f"unknown --check {exc}",
            hint=f"valid ids: {', '.join(ck.CHECK_IDS)} (or a group: {', '.join(ck.GROUPS)})",
        ) from None

    if probe_data is not None:
        data = load_probe_data(probe_data)
        config = data.config
    else:
        config, settings_probe = load_config(env_file, os.environ)
        data = pr.collect(config, os.environ, only=ck.probes_needed(selected))
        data.settings = settings_probe
    from sm70ctl.secrets import scrub, secret_values

    # A record is made to be attached to a bug report: no secret value may be in it, also
    # not inside a probe's captured output.
    probes = scrub(pr.asdict_probe(data), secret_values(os.environ))
    if record is not None:
        write_json_atomic(record, probes)

    results = ck.run_checks(config, data, selected)
    summary = ck.summarize(results, strict=strict)
    report = {
        "schema_version": pr.SCHEMA_VERSION,
        "kind": "sm70ctl.doctor",
        "summary": summary,
        "checks": [r.to_dict() for r in results],
        "probes": probes,
    }
    out = Output(json_out)
    out.emit(report, lambda console: render(console, results, summary))
    if record is not None and not json_out:
        out.info(f"probe data written to {record}")
    raise typer.Exit(summary["exit_code"])


def render(console: Any, results: list, summary: dict) -> None:
    from sm70ctl.output import make_table

    rows = [(r.id, r.status, r.observed, r.expected, r.fix) for r in results]
    console.print(
        make_table(
            "sm70ctl doctor",
            ["Check", "Status", "Observed", "Expected", "Fix"],
            rows,
            status_column=1,
        )
    )
    counts = summary["counts"]
    line = ", ".join(f"{counts[s]} {s}" for s in ("pass", "warn", "fail", "skip") if counts[s])
    if summary["strict"] and counts["warn"]:
        line += " (warnings fail under --strict)"
    verdict = "FAIL" if summary["exit_code"] else "OK"
    console.print(f"{verdict}: {line}", markup=False)


def load_config(env_file: Path | None, environ: Any) -> tuple[Any, Any]:
    """The doctor's settings and how they were read.

    Through the Settings object when the settings module imports and accepts the values.
    Otherwise the seven variables are read directly, so the doctor still runs in a
    half-installed environment or with a broken setting (when it is needed most), and the
    `settings.valid` check reports why."""
    from sm70ctl.doctor.config import DoctorConfig, read_env_file
    from sm70ctl.doctor.probes import SettingsProbe

    def fallback(lenient: bool) -> Any:
        merged = dict(read_env_file(env_file)) if env_file is not None else {}
        merged.update(environ)
        return DoctorConfig.from_environ(merged, lenient=lenient)

    try:
        from sm70ctl.settings import SettingsError, load_settings
    except ImportError as exc:
        return fallback(False), SettingsProbe(source="fallback", error=str(exc))
    try:
        settings = load_settings(environ=dict(environ), env_file=env_file)
    except SettingsError as exc:
        return fallback(True), SettingsProbe(
            source="fallback", problems=[p.line() for p in exc.problems]
        )
    return DoctorConfig.from_settings(settings), SettingsProbe()


def load_probe_data(path: Path) -> Any:
    from sm70ctl.doctor.probes import load_probe_dict
    from sm70ctl.doctor.records import RecordError
    from sm70ctl.errors import Sm70Error, UsageError
    from sm70ctl.readers import read_json

    try:
        raw = read_json(path, what="--probe-data")
    except Sm70Error as exc:
        raise UsageError(exc.message) from None
    try:
        return load_probe_dict(raw)
    except RecordError as exc:
        raise UsageError(f"--probe-data {path}: not doctor probe data ({exc})") from None


def write_json_atomic(path: Path, data: Any) -> None:
    import json

    from sm70ctl.errors import Sm70Error
    from sm70ctl.fsutil import atomic_write_text

    try:
        atomic_write_text(Path(path), json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise Sm70Error(f"--record {path}: {exc.strerror or exc}") from None


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
