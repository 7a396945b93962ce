"""load_settings: environment + optional .env file -> one validated, immutable Settings.

The environment wins over the file. Unknown SM70_* names are errors with a did-you-mean.
All problems (bad values, unknown names, broken cross-field rules) are collected and
raised together as one `SettingsError`.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sm70ctl.errors import Sm70Error
from sm70ctl.settings.model import Settings, SettingsBase
from sm70ctl.settings.problems import MASK, Problem, SettingsError
from sm70ctl.settings.rules import check_rules
from sm70ctl.settings.schema import PREFIX, RESERVED_NAMES, Schema, load_schema

ENVIRONMENT = "environment"
DEFAULT = "default"

_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)$")


@dataclass(frozen=True)
class RawValue:
    text: str
    source: str


def parse_env_file(path: Path) -> tuple[dict[str, RawValue], list[Problem]]:
    """KEY=VALUE lines (optional `export`, quotes, # comments) -> values and syntax problems."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise Sm70Error(f"cannot read env file {path}: {reason}",
                        hint="pass an existing UTF-8 .env file to --env-file") from None
    values: dict[str, RawValue] = {}
    problems: list[Problem] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"file:{path}:{lineno}"
        match = _LINE.match(stripped)
        if not match:
            problems.append(Problem(variable=f"{path}:{lineno}", value=_masked_line(stripped),
                                    rule="not a KEY=VALUE line",
                                    allowed="SM70_NAME=value, # comments, blank lines",
                                    source=where))
            continue
        key, value = match.groups()
        values[key] = RawValue(_unquote(value), where)
    return values, problems


def _masked_line(line: str) -> str:
    """A malformed line as shown in a problem: only a leading SM70_ name, since the rest
    (or a bare pasted word) may be a secret typed without `=` (`SM70_API_KEY: sk-...`)."""
    name = re.match(rf"(?i){PREFIX}[A-Za-z0-9_]*", line)
    if name is None:
        return MASK
    return name.group(0) + (f" {MASK}" if len(line) > name.end() else "")


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        inner = value[1:-1]
        if value[0] == '"':
            inner = inner.replace('\\"', '"').replace("\\\\", "\\")
        return inner
    # Unquoted: a ' #' starts a comment.
    return re.split(r"\s+#", value, maxsplit=1)[0].strip()


def suggest(name: str, schema: Schema) -> str | None:
    """The closest known variable name, if any is close enough."""
    names = [v.name for v in schema.variables]
    upper = name.upper()
    if upper in schema.by_name:
        return upper
    match = difflib.get_close_matches(upper, names, n=1, cutoff=0.6)
    if not match and upper.startswith(PREFIX):
        bare = [n[len(PREFIX):] for n in names]
        close = difflib.get_close_matches(upper[len(PREFIX):], bare, n=1, cutoff=0.6)
        match = [PREFIX + close[0]] if close else []
    return match[0] if match else None


def _unknown(name: str, raw: RawValue, schema: Schema) -> Problem:
    guess = suggest(name, schema)
    if name.upper().startswith(PREFIX):
        rule = "unknown SM70_ variable"
    else:
        rule = "not an SM70_ setting (env files for sm70ctl hold only SM70_* variables)"
    allowed = f"did you mean {guess}?" if guess else "see `sm70ctl env list`"
    value = MASK if ("TOKEN" in name.upper() or "KEY" in name.upper()) else raw.text
    return Problem(variable=name, value=value, rule=rule, allowed=allowed, source=raw.source)


def collect(
    environ: Mapping[str, str] | None, env_file: Path | None
) -> tuple[dict[str, RawValue], list[Problem]]:
    """Merge file and environment (environment wins); report syntax errors and unknown names."""
    schema = load_schema()
    problems: list[Problem] = []
    merged: dict[str, RawValue] = {}
    if env_file is not None:
        file_values, problems = parse_env_file(Path(env_file))
        merged.update(file_values)
    env = os.environ if environ is None else environ
    for key, text in env.items():
        if key.upper().startswith(PREFIX):
            merged[key] = RawValue(str(text), ENVIRONMENT)
    known: dict[str, RawValue] = {}
    for key, raw in merged.items():
        if key in schema.by_name:
            known[key] = raw
        elif key not in RESERVED_NAMES:
            problems.append(_unknown(key, raw, schema))
    return known, problems


def _rule_source(problem: Problem, sources: dict[str, str]) -> str:
    """Where a cross-field conflict came from: the variable's own source, and when that is
    the default, also the related variables someone did set (the ones to look at first)."""
    own = sources.get(problem.variable, DEFAULT)
    if own != DEFAULT:
        return own
    set_by_user = [f"{name} from {sources[name]}" for name in problem.related if name in sources]
    return "; ".join([DEFAULT, *set_by_user])


def _value_problems(
    exc: ValidationError, raw: dict[str, RawValue], schema: Schema
) -> list[Problem]:
    problems = []
    for err in exc.errors():
        attr = str(err["loc"][0]) if err["loc"] else ""
        spec = schema.by_attr.get(attr)
        name = spec.name if spec else attr
        given = raw.get(name)
        ctx = err.get("ctx") or {}
        value = MASK if (spec and spec.secret) else (given.text if given else str(err["input"]))
        problems.append(Problem(
            variable=name,
            value=value,
            rule=str(ctx.get("rule", err["msg"])),
            allowed=str(ctx.get("allowed", "")),
            source=given.source if given else DEFAULT,
        ))
    return problems


def validate(raw: dict[str, RawValue], problems: list[Problem] | None = None) -> SettingsBase:
    """Typed settings from raw text, or SettingsError with every problem found."""
    schema = load_schema()
    problems = list(problems or [])
    kwargs = {schema.by_name[name].attr: r.text for name, r in raw.items()}
    failed: set[str] = set()
    try:
        settings = Settings(**kwargs)
    except ValidationError as exc:
        value_problems = _value_problems(exc, raw, schema)
        problems.extend(value_problems)
        failed = {p.variable for p in value_problems}
        # Re-validate with the broken variables at their defaults, so the cross-field
        # rules between the remaining ones still get checked in this same run.
        keep = {k: v for k, v in kwargs.items() if schema.by_attr[k].name not in failed}
        settings = Settings(**keep)
    sources = {name: r.source for name, r in raw.items()}
    for p in check_rules(settings, skip=frozenset(failed)):
        problems.append(Problem(variable=p.variable, value=p.value, rule=p.rule,
                                allowed=p.allowed, related=p.related,
                                source=_rule_source(p, sources)))
    if problems:
        raise SettingsError(problems)
    settings._sources = sources
    return settings


def load_settings(
    environ: Mapping[str, str] | None = None,
    env_file: Path | str | None = None,
    overrides: Mapping[str, tuple[str, str]] | None = None,
) -> Any:
    """The one way to get Settings. `environ` defaults to os.environ; tests pass a mapping.

    `overrides` maps a variable name to (text, source), e.g. a command-line option
    `{"SM70_MAX_MODEL_LEN": ("131072", "--max-model-len")}`: it wins over environment and
    file, and goes through the same checks, its problems naming that source."""
    raw, problems = collect(environ, Path(env_file) if env_file is not None else None)
    schema = load_schema()
    for name, (text, source) in (overrides or {}).items():
        if name not in schema.by_name:
            raise ValueError(f"override of unknown variable {name}")  # a bug, not input
        raw[name] = RawValue(text, source)
    return validate(raw, problems)


def sources_of(settings: SettingsBase) -> dict[str, str]:
    """Where each variable's value came from: default, environment or file:PATH:LINE."""
    schema = load_schema()
    return {v.name: settings.source_of(v.name) for v in schema.variables}
