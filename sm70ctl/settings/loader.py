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
from typing import cast

from pydantic import ValidationError

from sm70ctl.errors import Sm70Error
from sm70ctl.readers import read_text
from sm70ctl.secrets import MASK, mask_value
from sm70ctl.settings.model import Settings, SettingsBase
from sm70ctl.settings.problems import Problem, SettingsError
from sm70ctl.settings.rules import check_rules
from sm70ctl.settings.schema import PREFIX, RESERVED_NAMES, Schema, load_schema
from sm70ctl.settings.typed import SettingsView

ENVIRONMENT = "environment"
DEFAULT = "default"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXPORT = re.compile(r"export\s+")

# Env files hold a few dozen short settings. The file limit is far above the value limit,
# so that an over-long value is refused by name (the setting and its limit) rather than as
# an over-long file; only a file that cannot be an env file at all is refused whole.
MAX_ENV_FILE_BYTES = 32 * 1024 * 1024
# No setting needs more: paths stop at PATH_MAX, lists at a few hundred items. The bound
# keeps a value far below what one argument or variable of exec may carry, so a pasted
# blob is refused here instead of killing the vLLM launch ("Argument list too long").
MAX_VALUE_BYTES = 16 * 1024
_SHOWN = 60
_DOUBLE_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"', re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_DOUBLE_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r", "$": "$",
                   "'": "'"}


@dataclass(frozen=True)
class RawValue:
    text: str
    source: str


class _LineError(ValueError):
    """A line that is not `KEY=VALUE` by the dotenv conventions; the message is the rule."""


def _parse_value(rest: str) -> str:
    """The value part of a line: quoted (then only a # comment may follow) or bare (a
    whitespace-led # starts a comment), as shells and python-dotenv read it."""
    rest = rest.lstrip(" \t")
    if rest[:1] == "'":
        close = rest.find("'", 1)
        if close < 0:
            raise _LineError("single quote not closed on this line")
        value, tail = rest[1:close], rest[close + 1:]
    elif rest[:1] == '"':
        quoted = _DOUBLE_QUOTED.match(rest)
        if quoted is None:
            raise _LineError("double quote not closed on this line")
        value = _ESCAPE.sub(lambda m: _DOUBLE_ESCAPES.get(m.group(1), m.group(0)),
                            quoted.group(1))
        tail = rest[quoted.end():]
    else:
        return re.split(r"[ \t]#", rest, maxsplit=1)[0].strip(" \t")
    tail = tail.strip(" \t")
    if tail and not tail.startswith("#"):
        raise _LineError("text after the closing quote (only a # comment may follow)")
    return value


def _parse_line(line: str) -> tuple[str, str] | None:
    """(key, value) for a setting line, None for a blank or comment line."""
    stripped = line.strip(" \t")
    if not stripped or stripped.startswith("#"):
        return None
    export = _EXPORT.match(stripped)
    if export:
        stripped = stripped[export.end():]
    name = _NAME.match(stripped)
    if name is None:
        raise _LineError("not a KEY=VALUE line")
    rest = stripped[name.end():].lstrip(" \t")
    if not rest.startswith("="):
        raise _LineError("not a KEY=VALUE line")
    return name.group(0), _parse_value(rest[1:])


def parse_env_text(text: str, where: str) -> tuple[dict[str, RawValue], list[Problem]]:
    """Env-file text -> values and problems. Lines end at \\n only (a CR before it is
    dropped): U+2028 and friends inside a comment must not start a new setting line."""
    values: dict[str, RawValue] = {}
    problems: list[Problem] = []
    if text.startswith("\ufeff"):
        text = text[1:]
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        source = f"file:{where}:{lineno}"
        try:
            parsed = _parse_line(line)
        except _LineError as exc:
            problems.append(Problem(variable=f"{where}:{lineno}",
                                    value=_masked_line(line.strip()), rule=str(exc),
                                    allowed="SM70_NAME=value, KEY='value' # comment, "
                                            "export KEY=value, # comments, blank lines",
                                    source=source))
            continue
        if parsed is None:
            continue
        key, value = parsed
        old = values.get(key)
        if old is not None and old.text != value:
            problems.append(Problem(variable=key, value=shown_value(key, value),
                                    rule=f"set twice with different values (first at "
                                         f"{old.source.removeprefix('file:')})",
                                    allowed="one line per variable", source=source))
        values[key] = RawValue(value, source)
    return values, problems


def parse_env_file(path: Path) -> tuple[dict[str, RawValue], list[Problem]]:
    """An env file by the dotenv conventions (BOM, CRLF, `export`, quotes with a trailing
    comment) -> values and syntax problems; an unreadable file is one Sm70Error."""
    try:
        text = read_text(path, what="env file", max_bytes=MAX_ENV_FILE_BYTES, allow_pipe=True)
    except Sm70Error as exc:
        raise Sm70Error(exc.message, hint="pass an existing UTF-8 .env file to --env-file") \
            from None
    return parse_env_text(text, str(path))


def shown_value(name: str, value: str) -> str:
    """A value as a problem shows it: masked when the name looks secret, cut when long."""
    value = mask_value(name, value)
    if len(value) > _SHOWN:
        return f"{value[:_SHOWN]}... ({len(value.encode('utf-8', 'replace')):,} bytes)"
    return value


def _masked_line(line: str) -> str:
    """A malformed line as shown in a problem: only a leading SM70_ name, since the rest
    (or a bare pasted word) may be a secret typed without `=` (`SM70_API_KEY: sk-...`)."""
    name = re.match(rf"(?i)(?:export\s+)?{PREFIX}[A-Za-z0-9_]*", line)
    if name is None:
        return MASK
    return name.group(0) + (f" {MASK}" if len(line) > name.end() else "")


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
    long_name = len(name) > _SHOWN
    guess = None if long_name else suggest(name, schema)
    if name.upper().startswith(PREFIX):
        rule = "unknown SM70_ variable"
    else:
        rule = "not an SM70_ setting (env files for sm70ctl hold only SM70_* variables)"
    allowed = f"did you mean {guess}?" if guess else "see `sm70ctl env list`"
    shown_name = f"{name[:_SHOWN]}... ({len(name):,} characters)" if long_name else name
    return Problem(variable=shown_name, value=shown_value(name, raw.text), rule=rule,
                   allowed=allowed, source=raw.source)


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
        if key not in schema.by_name:
            if key not in RESERVED_NAMES:
                problems.append(_unknown(key, raw, schema))
        elif len(raw.text.encode("utf-8", "surrogateescape")) > MAX_VALUE_BYTES:
            problems.append(_too_long(key, raw))
        else:
            known[key] = raw
    return known, problems


def _too_long(name: str, raw: RawValue) -> Problem:
    size = len(raw.text.encode("utf-8", "surrogateescape"))
    return Problem(variable=name, value=shown_value(name, raw.text),
                   rule=f"value is {size:,} bytes long",
                   allowed=f"at most {MAX_VALUE_BYTES:,} bytes", source=raw.source)


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
        text = given.text if given else str(err["input"])
        value = MASK if (spec and spec.secret and text) else shown_value(name, text)
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
) -> SettingsView:
    """The one way to get Settings. `environ` defaults to os.environ; tests pass a mapping.

    `overrides` maps a variable name to (text, source), e.g. a command-line option
    `{"SM70_MAX_MODEL_LEN": ("131072", "--max-model-len")}`: it wins over environment and
    file, and goes through the same checks, its problems naming that source."""
    raw, problems = collect(environ, Path(env_file) if env_file is not None else None)
    schema = load_schema()
    for name, (text, source) in (overrides or {}).items():
        if name not in schema.by_name:
            raise ValueError(f"override of unknown variable {name}")  # a bug, not input
        given = RawValue(text, source)
        if len(text.encode("utf-8", "surrogateescape")) > MAX_VALUE_BYTES:
            problems.append(_too_long(name, given))
            raw.pop(name, None)
            continue
        raw[name] = given
    # The model is built from the schema at import, so only typed.py (generated from the same
    # schema, checked by tests/test_settings_typed.py) can tell a type checker its attributes.
    return cast("SettingsView", validate(raw, problems))


def sources_of(settings: SettingsBase) -> dict[str, str]:
    """Where each variable's value came from: default, environment or file:PATH:LINE."""
    schema = load_schema()
    return {v.name: settings.source_of(v.name) for v in schema.variables}
