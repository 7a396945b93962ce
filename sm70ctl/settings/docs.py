"""docs/env.md, generated from the schema (`sm70ctl env docs`; a test fails when stale)."""

from __future__ import annotations

from pathlib import Path

from sm70ctl.settings.model import allowed_text
from sm70ctl.settings.rules import rules_table
from sm70ctl.settings.schema import Schema, VarSpec, load_schema

DOCS_PATH = Path("docs") / "env.md"

_INTRO = """\
# SM70_* settings reference

Generated from `env_schema.yaml` by `sm70ctl env docs`; do not edit by hand (a test fails
when this file is stale).

sm70ctl reads its configuration from `SM70_*` environment variables, optionally from a
`.env` file (`--env-file`; the environment wins over the file). Every value is checked
against its type and range and against the cross-field rules below; all problems are
reported at once (`sm70ctl env check`). Unknown `SM70_*` names are errors with a
did-you-mean suggestion.

- `sm70ctl env list [--category C]`: every variable, its default and summary.
- `sm70ctl env explain NAME`: one variable in full, with the place it takes effect.
- `sm70ctl env show`: effective values and where each came from (secrets as `***`).
- `sm70ctl env check [--env-file F]`: validate; exit 1 with a table of problems; warns about
  set variables that are not consumed yet.

Env-file syntax (the dotenv conventions): `KEY=value` lines, optionally `export KEY=value`;
`'single'` or `"double"` quotes (with `\\"` and `\\n` escapes in double quotes), after which
only a `# comment` may follow; in a bare value a `#` after a space starts a comment; blank
lines and `#` lines are skipped. A UTF-8 byte-order mark and CRLF line ends are accepted;
only `\\n` ends a line, so a U+2028 inside a comment does not start a setting. A variable
set twice with different values is an error naming both lines. Values are at most 16 KiB,
path values at most 255 bytes per component and 4096 in all.

Secrets: a variable whose name looks secret (the two secret settings below, a near-miss of
them such as `SM70_API_KYE`, and common names such as `*_API_KEY`, `*_TOKEN`, `*SECRET*`,
`*PASSWORD*`, `VLLM_API_KEY`, `HF_TOKEN`) is shown as `***` in every message, table, log and
record, and enters the compile-cache fingerprint only as "set"; a secret value found in
any other variable or log line is masked too (`sm70ctl/secrets.py`).

Value syntax: booleans `true/false` (also `1/0`, `yes/no`, `on/off`); byte sizes as a
byte count or with a unit (`512MiB`, `9.9GiB`, `32GB`); durations with `ms`, `s`, `m`,
`h` (a bare number is seconds); lists comma-separated. An empty value is an error unless
the variable says "empty for none". Variables marked *compile key* change compiled
kernels: they form the compile-cache fingerprint, so changing one starts a fresh cache.

Where a value takes effect (consumer kinds): `vllm_flag` a vLLM command-line flag,
`vllm_secret` a key of the private file vLLM reads through `--config`, `vllm_env` an
environment variable of the vLLM process, `plugin` a field of the plugin
configuration (`SM70_PLUGIN_CONFIG`), `kernel` the compile-cache key, `plan` the memory
plan, `supervisor` serve's supervisor, `doctor` the doctor checks, `build` the build,
`weights` weights fetch/verify. A consumer marked *not read yet, issue N* is produced (a
plugin configuration field, say) but no code reads it until issue N lands; a variable with
nothing else but the compile-cache key is *not consumed yet*: setting it changes nothing
the server does today.

The schema lives in `env_schema.yaml` at the repository root; the package ships an
identical copy as `sm70ctl/data/env_schema.yaml` (what an installed sm70ctl reads; a test
fails when the two differ). After editing the schema: copy it there, then run
`python -m sm70ctl.settings.schema` (its parsed copy, env_schema.json) and
`sm70ctl env docs`. Count the variables with:
`sm70ctl env list --json | python -c "import json,sys; print(len(json.load(sys.stdin)))"`.

In code: `from sm70ctl.settings import load_settings`; attributes are the names
lower-cased without `SM70_`; byte sizes are ints, durations float seconds, lists Python
lists, empty optional paths `None`, secrets `pydantic.SecretStr` (or `None`).
Code that takes settings annotates them `SettingsView` (`sm70ctl/settings/typed.py`, generated
from the schema). `sm70ctl.runtime` turns settings into the vLLM argv, environment and plugin
configuration; plan, build, serve, doctor and weights read the attributes they need.
"""

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def consumers_text(spec: VarSpec, code: bool = True) -> str:
    """Where a variable takes effect; a variable nothing reads yet says so first."""
    tick = "`" if code else ""
    parts = [f"{c.kind}: {tick}{c.target}{tick}"
             + (f" (not read yet, issue {c.pending})" if c.pending is not None else "")
             for c in spec.consumers]
    text = "; ".join(parts)
    return text if spec.consumed else f"{spec.status()}: {text}"


def _default(spec: VarSpec) -> str:
    if spec.secret:
        return "(secret, empty)"
    return f"`{spec.default}`" if spec.default else "(empty)"


def render(schema: Schema | None = None) -> str:
    schema = schema or load_schema()
    out = [_INTRO]
    idle = sum(1 for v in schema.variables if not v.consumed)
    out.append(f"{len(schema.variables)} variables in {len(schema.categories)} categories; "
               f"{idle} not consumed yet.\n")
    out.append("## Contents\n")
    for key, cat in schema.categories.items():
        count = sum(1 for v in schema.variables if v.category == key)
        out.append(f"- [{cat.title}](#{_anchor(cat.title)}) ({count}): {cat.summary}")
    out.append("")
    for key, cat in schema.categories.items():
        out.append(f"## {cat.title}\n\n{cat.summary}\n")
        out.append("| variable | type | default | allowed | takes effect in | summary |")
        out.append("|---|---|---|---|---|---|")
        for v in (v for v in schema.variables if v.category == key):
            flags = [f for f, on in (("secret", v.secret), ("compile key", v.compile_key),
                                     (v.status(), not v.consumed)) if on]
            kind = v.type + (f" ({v.unit})" if v.unit else "")
            summary = v.summary + (f" *{', '.join(flags)}*" if flags else "")
            out.append(
                f"| `{v.name}` | {kind} | {_cell(_default(v))} | {_cell(allowed_text(v))} | "
                f"{_cell(consumers_text(v))} | {_cell(summary)} |"
            )
        out.append("")
        for v in (v for v in schema.variables if v.category == key):
            out.append(f"- **`{v.name}`**: {v.help}")
        out.append("")
    out.append("## Cross-field rules\n")
    out.append("| rule | refused when |")
    out.append("|---|---|")
    out.extend(f"| {rid} | {_cell(when)} |" for rid, when in rules_table())
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -")
    return keep.replace(" ", "-")
