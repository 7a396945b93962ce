"""`sm70ctl env`: check, list, explain and show the SM70_* settings; generate their docs.

Imports stay light at CLI start-up: the schema and the pydantic model load inside the
commands that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from sm70ctl.errors import UsageError
from sm70ctl.options import EnvFileOpt, JsonOpt
from sm70ctl.output import Output, make_table
from sm70ctl.secrets import MASK

env_app = typer.Typer(
    name="env",
    help="Check, list, explain and show the SM70_* settings.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


def register(app: typer.Typer) -> None:
    app.add_typer(env_app, name="env")


def _problem_rows(problems: list[Any]) -> list[list[str]]:
    return [[p.variable, p.value, p.source, p.rule, p.allowed] for p in problems]


@env_app.command("check")
def check(env_file: EnvFileOpt = None, json: JsonOpt = False) -> None:
    """Validate every SM70_* variable (environment, then --env-file) and every rule.

    Every problem is reported at once, as a table: variable, value, where it came from,
    the rule broken and what is allowed. Exit 1 when anything is wrong.

    Example:

        SM70_SPEC_TOKENS=2 sm70ctl env check --env-file prod.env
    """
    from sm70ctl.settings.loader import load_settings
    from sm70ctl.settings.problems import SettingsError

    out = Output(json)
    try:
        settings = load_settings(env_file=env_file)
    except SettingsError as exc:
        problems = exc.problems
        out.emit(
            {"ok": False, "problems": [p.to_dict() for p in problems]},
            lambda c: c.print(make_table(
                f"{len(problems)} problem(s) in SM70_* settings",
                ["variable", "value", "source", "rule broken", "allowed"],
                _problem_rows(problems),
            )),
        )
        raise typer.Exit(1) from None
    from sm70ctl.settings.loader import sources_of
    from sm70ctl.settings.schema import load_schema

    changed = {k: v for k, v in sources_of(settings).items() if v != "default"}
    # Valid but inert today: say so, or a user tunes a knob that nothing reads yet.
    by_name = load_schema().by_name
    idle = {k: by_name[k].status() for k in changed if not by_name[k].consumed}
    if json:
        out.emit({"ok": True, "set": {k: {"value": settings.env_text(k), "source": v}
                                      for k, v in changed.items()},
                  "not_consumed_yet": idle})
    else:
        out.success(f"SM70_* settings OK ({len(changed)} set, the rest default)")
        for name, status in idle.items():
            out.warn(f"{name} is set but {status}: it changes nothing the server does today")


@env_app.command("list")
def list_(
    category: Annotated[
        Optional[str],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
        typer.Option("--category", "-c", help="Only this category (key or title)."),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """List the SM70_* variables with type, default and summary.

    Example:

        sm70ctl env list --category spec
        sm70ctl env list --json | python -c "import json,sys; print(len(json.load(sys.stdin)))"
    """
    from sm70ctl.settings.docs import consumers_text
    from sm70ctl.settings.schema import load_schema

    schema = load_schema()
    variables = list(schema.variables)
    if category is not None:
        key = _category_key(category, schema)
        variables = [v for v in variables if v.category == key]
    data = [
        {
            "name": v.name,
            "category": v.category,
            "type": v.type,
            "default": "" if v.secret else v.default,
            "secret": v.secret,
            "compile_key": v.compile_key,
            "summary": v.summary,
            "status": v.status(),
            "consumers": [_consumer(c) for c in v.consumers],
        }
        for v in variables
    ]
    rows = [
        [v.name, v.type, MASK if v.secret else v.default, consumers_text(v, code=False),
         v.summary]
        for v in variables
    ]
    Output(json).emit(data, lambda c: c.print(make_table(
        f"{len(rows)} SM70_* variables", ["name", "type", "default", "takes effect in", "summary"],
        rows,
    )))


def _consumer(c: Any) -> dict[str, Any]:
    return {"kind": c.kind, "target": c.target,
            **({"pending_issue": c.pending} if c.pending is not None else {})}


def _category_key(category: str, schema: Any) -> str:
    wanted = category.strip().lower()
    for key, cat in schema.categories.items():
        if wanted in (key, cat.title.lower()):
            return key
    raise UsageError(
        f"unknown category {category!r}",
        hint="one of: " + ", ".join(schema.categories),
    )


@env_app.command("explain")
def explain(
    name: Annotated[str, typer.Argument(help="Variable name, with or without SM70_.")],
    json: JsonOpt = False,
) -> None:
    """Describe one variable: type, default, allowed values, where it takes effect, help.

    Example:

        sm70ctl env explain SM70_SPEC_TOKENS
    """
    from sm70ctl.settings.loader import suggest
    from sm70ctl.settings.model import allowed_text
    from sm70ctl.settings.schema import load_schema

    schema = load_schema()
    if not name.strip():
        raise UsageError("give a variable name, e.g. SM70_PORT (`sm70ctl env list` lists them)")
    spec = schema.get(name)
    if spec is None:
        guess = suggest(name if name.upper().startswith("SM70_") else "SM70_" + name, schema)
        raise UsageError(
            f"unknown variable {name!r}",
            hint=f"did you mean {guess}?" if guess else "see `sm70ctl env list`",
        )
    data = {
        "name": spec.name,
        "attribute": spec.attr,
        "category": schema.categories[spec.category].title,
        "type": spec.type,
        "unit": spec.unit,
        "default": MASK if spec.secret else spec.default,
        "allowed": allowed_text(spec),
        "rule": spec.rule,
        "secret": spec.secret,
        "compile_key": spec.compile_key,
        "summary": spec.summary,
        "help": spec.help,
        "status": spec.status(),
        "consumers": [_consumer(c) for c in spec.consumers],
    }

    def render(c: Any) -> None:
        from sm70ctl.settings.docs import consumers_text

        rows = [[k, v] for k, v in data.items() if k not in ("consumers",) and v not in (None, "")]
        rows.append(["takes effect in", consumers_text(spec, code=False)])
        c.print(make_table(spec.name, ["field", "value"], rows))

    Output(json).emit(data, render)


@env_app.command("show")
def show(env_file: EnvFileOpt = None, json: JsonOpt = False) -> None:
    """Show every effective value and where it came from (default, environment, file).

    Secrets are masked as ***. Fails like `env check` when the settings are invalid.

    Example:

        sm70ctl env show --env-file prod.env --json
    """
    from sm70ctl.settings.loader import load_settings, sources_of
    from sm70ctl.settings.schema import load_schema

    settings = load_settings(env_file=env_file)
    sources = sources_of(settings)
    data = [
        {"name": v.name, "value": settings.env_text(v.name), "source": sources[v.name]}
        for v in load_schema().variables
    ]
    rows = [[d["name"], d["value"], d["source"]] for d in data]
    Output(json).emit(data, lambda c: c.print(make_table(
        "effective SM70_* settings", ["name", "value", "source"], rows)))


def _repo_root() -> Path:
    here = Path(__file__).resolve().parents[2]
    return here if (here / "env_schema.yaml").exists() else Path.cwd()


@env_app.command("docs")
def docs(
    check_only: Annotated[
        bool, typer.Option("--check", help="Exit 1 when the file is stale; write nothing.")
    ] = False,
    output: Annotated[
        Optional[Path],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
        typer.Option("--output", "-o", help="Where to write (default: docs/env.md).",
                     dir_okay=False),
    ] = None,
) -> None:
    """Generate docs/env.md from env_schema.yaml (or check it is current).

    Example:

        sm70ctl env docs --check
    """
    from sm70ctl.errors import Sm70Error
    from sm70ctl.fsutil import atomic_write_text
    from sm70ctl.settings.docs import DOCS_PATH, render

    path = output or (_repo_root() / DOCS_PATH)
    text = render()
    out = Output()
    try:  # bytes: a file that is not UTF-8 is simply not current
        current = path.read_bytes() if path.exists() else None
    except OSError as exc:
        raise Sm70Error(f"--output {path}: cannot read: {exc.strerror or exc}",
                        hint="give a readable, writable file path") from None
    if check_only:
        if current != text.encode("utf-8"):
            out.error(f"{path} is stale", "run `sm70ctl env docs` and commit the result")
            raise typer.Exit(1)
        out.success(f"{path} is current")
        return
    if current == text.encode("utf-8"):
        out.info(f"{path} already current")
        return
    try:
        atomic_write_text(path, text)
    except OSError as exc:
        raise Sm70Error(f"--output {path}: cannot write: {exc.strerror or exc}",
                        hint="give a writable file path") from None
    out.success(f"wrote {path}")
