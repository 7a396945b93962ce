"""`sm70ctl weights fetch|verify|check-quant`: argument plumbing and rendering.

Imported when the CLI starts: typer, the option aliases and the (small, pure) pin reader
only; huggingface_hub is imported by fetch.py inside the functions that talk to the hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer
from typer.core import TyperCommand, TyperGroup

from sm70ctl.options import EnvFileOpt, JsonOpt

NamesArg = Annotated[
    Optional[list[str]],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
    typer.Argument(help="Model pins to act on (names of [models.<name>] tables); default: "
                   "every non-optional pin.", show_default=False),
]
AllOpt = Annotated[bool, typer.Option("--all", help="Include the optional pins (Clef).")]
LockOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--lock", help="Lock file with the [models.<name>] pins (default: the "
                 "packaged sm70.lock.toml).", dir_okay=False, metavar="FILE"),
]
EndpointOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--endpoint", help="Hub endpoint URL (default: HF_ENDPOINT, else "
                 "https://huggingface.co), e.g. a mirror.", metavar="URL"),
]
OfflineOpt = Annotated[
    bool,
    typer.Option("--offline", help="Use local files only: no network; report exactly what "
                 "is missing or damaged (exit 1 if anything is)."),
]
FullOpt = Annotated[bool, typer.Option("--full", help="Re-hash every file, not only those "
                                       "whose size/mtime/inode changed.")]
DirOpt = Annotated[
    Optional[list[Path]],  # noqa: UP045
    typer.Option("--dir", help="Verify this folder (it holds .sm70/manifest.json) instead "
                 "of the pinned ones. Repeatable.", file_okay=False, metavar="DIR"),
]

# Stands for the lock's pins in help texts; filled in only when a help page is shown, so
# that other commands do not read and parse the lock file at start-up.
_PINS = "@PINS@"


class _PinsHelp:
    help: str | None

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.help and _PINS in self.help:
            from sm70ctl.weights.pins import pins_summary

            self.help = self.help.replace(_PINS, pins_summary())
        super().format_help(ctx, formatter)  # type: ignore[misc]


class _PinsGroup(_PinsHelp, TyperGroup):
    pass


class _PinsCommand(_PinsHelp, TyperCommand):
    pass


weights_app = typer.Typer(
    name="weights",
    cls=_PinsGroup,
    help=(
        "Fetch the pinned checkpoints, verify them offline, check their quantisation.\n\n"
        "Pinned in the lock file (name: repository @ revision):\n\n" + _PINS
    ),
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


def _config(env_file: Path | None, **overrides: Any):  # -> FetchConfig
    """The settings fetch needs, from the one Settings object."""
    from sm70ctl.settings import load_settings
    from sm70ctl.weights.fetch import FetchConfig

    return FetchConfig.from_settings(load_settings(env_file=env_file), **overrides)


def _pins(lock: Path | None, names: list[str] | None, include_optional: bool):
    from sm70ctl.weights.pins import load_model_pins, select_pins

    return select_pins(load_model_pins(lock), list(names or []), include_optional)


@weights_app.command("fetch", cls=_PinsCommand, help=(
    "Download the pinned model repositories into SM70_WEIGHTS_DIR/<local_dir>, at the "
    "40-character commits of the lock file.\n\n"
    "Checks free space first (the bytes still to download against the free space of "
    "SM70_WEIGHTS_DIR), resumes an interrupted download with a Range request, checks every "
    "file's sha256 against the hub's LFS sha256, writes `.sm70/manifest.json`, then validates "
    "the quantization config. The token comes from SM70_HF_TOKEN and is never printed. A pin "
    "whose revision is still a placeholder is refused.\n\n"
    "Pinned:\n\n" + _PINS + "\n\n"
    "Examples:\n\n"
    "    sm70ctl weights fetch                 # the base checkpoint\n\n"
    "    sm70ctl weights fetch --all           # plus Clef's correction and head\n\n"
    "    sm70ctl weights fetch base --endpoint https://hf-mirror.example\n\n"
    "    sm70ctl weights fetch --offline       # no network: what is missing locally?"
))
def fetch(
    names: NamesArg = None,
    all_: AllOpt = False,
    lock: LockOpt = None,
    endpoint: EndpointOpt = None,
    offline: OfflineOpt = False,
    json_out: JsonOpt = False,
    env_file: EnvFileOpt = None,
) -> None:
    from sm70ctl.output import Output

    out = Output(json_out)
    pins = _pins(lock, names, all_)
    cfg = _config(env_file, endpoint=endpoint, progress=not json_out)
    if offline:
        _verify_and_exit(out, [(p, cfg.folder(p)) for p in pins], full=False,
                         title="local copies (offline)")
        return

    from sm70ctl.weights.fetch import fetch_pin

    results = [fetch_pin(p, cfg, report=out.info) for p in pins]
    data = [r.to_dict() for r in results]

    def render(console) -> None:
        from sm70ctl.output import make_table
        from sm70ctl.weights.disk import human_bytes

        console.print(make_table(
            "weights fetch",
            ["model", "revision", "folder", "files", "size", "downloaded", "kept", "quant"],
            [
                (r.name, r.revision[:12], r.folder, r.files, human_bytes(r.total_bytes),
                 human_bytes(r.bytes_downloaded), len(r.kept),
                 "fail" if r.quant_problems else "ok")
                for r in results
            ],
            status_column=7,
        ))

    out.emit(data, render)
    bad = [r for r in results if r.quant_problems]
    for r in bad:
        for p in r.quant_problems:
            out.error(f"{r.name}: {p['message']}")
    if bad:
        raise typer.Exit(1)


@weights_app.command("verify", help=(
    "Check downloaded checkpoints offline against their manifests: missing, extra and "
    "corrupted files, and the quantization config.\n\n"
    "Fast by default: only files whose size, mtime or inode changed since they were last "
    "hashed are re-hashed; `--full` re-hashes everything. Never uses the network (`--offline` "
    "is accepted and changes nothing). Exit 1 naming the file(s) on any problem.\n\n"
    "Examples:\n\n"
    "    sm70ctl weights verify                # the pinned checkpoints\n\n"
    "    sm70ctl weights verify --full --json  # re-hash all, machine-readable\n\n"
    "    sm70ctl weights verify --dir /srv/models/qwen3.8-27b-gptq-int8"
))
def verify(
    names: NamesArg = None,
    all_: AllOpt = False,
    dirs: DirOpt = None,
    full: FullOpt = False,
    offline: OfflineOpt = False,
    lock: LockOpt = None,
    json_out: JsonOpt = False,
    env_file: EnvFileOpt = None,
) -> None:
    from sm70ctl.output import Output

    out = Output(json_out)
    if dirs:
        targets: list[tuple[Any, Path]] = [(None, d) for d in dirs]
    else:
        cfg = _config(env_file)
        targets = [(p, cfg.folder(p)) for p in _pins(lock, names, all_)]
    _verify_and_exit(out, targets, full=full, title="weights verify")


def _verify_and_exit(out, targets: list[tuple[Any, Path]], *, full: bool, title: str) -> None:
    from sm70ctl.output import make_table
    from sm70ctl.weights.verify import verify_folder

    reports = []
    for pin, folder in targets:
        check = pin.check_quant if pin is not None else None
        report = verify_folder(folder, full=full, check_quant=check)
        if pin is not None and report.revision and report.revision != pin.revision:
            from sm70ctl.weights.verify import Issue

            report.issues.append(Issue("revision", ".sm70/manifest.json",
                                       f"fetched at {report.revision}, pinned {pin.revision}"))
        reports.append((pin, report))

    def render(console) -> None:
        rows = []
        for pin, r in reports:
            label = pin.name if pin is not None else (r.name or "-")
            status = "ok" if r.ok else "fail"
            rows.append((label, r.folder, r.revision[:12] or "-", r.files, r.hashed, status))
        console.print(make_table(title, ["model", "folder", "revision", "files", "hashed",
                                         "status"], rows, status_column=5))
        issues = [(r.folder, i) for _, r in reports for i in r.issues]
        if issues:
            console.print(make_table("problems", ["folder", "kind", "file", "detail"],
                                     [(f, i.kind, i.path, i.detail) for f, i in issues]))
        quant = [(r.folder, q) for _, r in reports for q in r.quant_problems]
        if quant:
            console.print(make_table("quantization config", ["folder", "field", "problem"],
                                     [(f, q["field"], q["message"]) for f, q in quant]))

    out.emit([r.to_dict() for _, r in reports], render)
    failed = False
    for _, r in reports:
        if r.cache_note:
            out.warn(f"{r.folder}: {r.cache_note}")
        if not r.ok:
            failed = True
            names = [i.path for i in r.issues] + [q["field"] for q in r.quant_problems]
            out.error(f"{r.folder}: {len(names)} problem(s): {', '.join(names)}")
    if failed:
        raise typer.Exit(1)


@weights_app.command("check-quant", help=(
    "Validate a checkpoint's quantization_config (config.json) for this stack: GPTQ, bits 8, "
    "group size 128, modules_to_not_convert present, and `dynamic` rules that keep the fused "
    "qkv_proj and in_proj_ba 16-bit under vLLM's runtime names. A config that fails loads "
    "but produces garbage. Exit 1 with one line per problem.\n\n"
    "Examples:\n\n"
    "    sm70ctl weights check-quant ~/.cache/sm70ctl/models/qwen3.8-27b-gptq-int8\n\n"
    "    sm70ctl weights check-quant path/to/config.json --json"
))
def check_quant(
    path: Annotated[Path, typer.Argument(help="config.json, or the folder holding it.")],
    json_out: JsonOpt = False,
) -> None:
    from sm70ctl.output import Output, make_table
    from sm70ctl.readers import check_path
    from sm70ctl.weights.fetch import check_quant_folder

    out = Output(json_out)
    check_path(path, "check-quant PATH")
    folder = path if path.is_dir() else path.parent
    if not path.is_dir() and path.name != "config.json":
        from sm70ctl.readers import read_json
        from sm70ctl.weights.quant import validate_quant_config

        config = read_json(path, what="model config")
        problems = [p.to_dict() for p in validate_quant_config(config)]
    else:
        problems = check_quant_folder(folder)
    data = {"path": str(path), "ok": not problems, "problems": problems}

    def render(console) -> None:
        if problems:
            console.print(make_table("quantization config", ["field", "value", "rule", "problem"],
                                     [(p["field"], p["value"], p["rule"], p["message"])
                                      for p in problems]))
        else:
            console.print(f"{path}: quantization config ok (gptq, 8 bit, group 128, "
                          "fused qkv_proj and in_proj_ba kept 16-bit)")

    out.emit(data, render)
    if problems:
        out.error(f"{path}: {len(problems)} quantization problem(s)")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(weights_app, name="weights")


__all__ = ["register", "weights_app"]
