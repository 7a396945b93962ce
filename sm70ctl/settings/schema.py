"""Load env_schema.yaml into typed, immutable specs (parsed once per process).

The packaged copy at sm70ctl/data/env_schema.yaml is what runs (it works for editable and
wheel installs alike); the repository root keeps the canonical env_schema.yaml and a test
fails when the two differ.

Parsing the YAML (and importing PyYAML) is a large share of a short command's start-up, so
the parsed document also ships as JSON beside it (env_schema.json), stamped with the sha256
of the YAML text it came from. It is used only while that stamp matches; otherwise the YAML
is parsed as before. `python -m sm70ctl.settings.schema` rewrites it (a test fails when the
committed one is stale).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "data" / "env_schema.yaml"
PREFIX = "SM70_"

TYPES = ("bool", "int", "float", "bytes", "duration", "enum", "path", "string", "list")
CONSUMER_KINDS = (
    "vllm_flag",
    "vllm_secret",
    "vllm_env",
    "plugin",
    "kernel",
    "build",
    "plan",
    "supervisor",
    "doctor",
    "weights",
)
# SM70_* names that are not settings: set by sm70ctl itself for the processes it starts.
RESERVED_NAMES = frozenset({"SM70_PLUGIN_CONFIG", "SM70_KERNELS_BUILD_DIR"})

_REQUIRED = ("name", "category", "type", "default", "summary", "help", "consumers")
_OPTIONAL = (
    "unit",
    "min",
    "max",
    "multiple_of",
    "choices",
    "pattern",
    "item",
    "item_pattern",
    "min_items",
    "max_items",
    "unique",
    "nullable",
    "secret",
    "compile_key",
    "example",
    "example_with",
    "rule",
)


@dataclass(frozen=True)
class Consumer:
    """Where a variable goes. `pending` is the issue whose code will read it, while the
    target is produced (e.g. a plugin config field) but no code reads it yet."""

    kind: str
    target: str
    pending: int | None = None


@dataclass(frozen=True)
class Category:
    key: str
    title: str
    summary: str


@dataclass(frozen=True)
class VarSpec:
    """One SM70_* variable. Defaults and examples are kept in their environment spelling."""

    name: str
    category: str
    type: str
    default: str
    summary: str
    help: str
    consumers: tuple[Consumer, ...]
    unit: str | None = None
    min: str | None = None
    max: str | None = None
    multiple_of: int | None = None
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    item: str | None = None
    item_pattern: str | None = None
    min_items: int | None = None
    max_items: int | None = None
    unique: bool = False
    nullable: bool = False
    secret: bool = False
    compile_key: bool = False
    example: str | None = None
    example_with: dict[str, str] = field(default_factory=dict)
    rule: str | None = None

    @property
    def attr(self) -> str:
        """The Settings attribute: the name lower-cased without the prefix."""
        return self.name[len(PREFIX) :].lower()

    @property
    def consumer_kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.kind for c in self.consumers))

    @property
    def pending_issues(self) -> tuple[int, ...]:
        """The issues whose code will read this variable where nothing reads it yet."""
        return tuple(sorted({c.pending for c in self.consumers if c.pending is not None}))

    @property
    def consumed(self) -> bool:
        """Does some code act on it? The compile-cache key alone does not count: it only
        says a change would need fresh caches."""
        return any(c.pending is None and c.kind != "kernel" for c in self.consumers)

    def status(self) -> str:
        """'consumed', or 'not consumed yet (issue N)' for docs and `sm70ctl env`."""
        if self.consumed:
            return "consumed"
        issues = ", ".join(str(i) for i in self.pending_issues)
        return f"not consumed yet (issue {issues})" if issues else "not consumed yet"


@dataclass(frozen=True)
class Schema:
    version: int
    categories: dict[str, Category]
    variables: tuple[VarSpec, ...]

    @functools.cached_property
    def by_name(self) -> dict[str, VarSpec]:
        return {v.name: v for v in self.variables}

    @functools.cached_property
    def by_attr(self) -> dict[str, VarSpec]:
        return {v.attr: v for v in self.variables}

    def get(self, name: str) -> VarSpec | None:
        """Look a variable up by its name, with or without the prefix, any case."""
        key = name.strip().upper()
        if not key.startswith(PREFIX):
            key = PREFIX + key
        return self.by_name.get(key)


def env_text(value: Any) -> str:
    """How a YAML scalar is spelled in an environment variable."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(env_text(v) for v in value)
    return str(value)


def _bad(msg: str) -> Sm70Error:
    return Sm70Error(f"env schema {SCHEMA_PATH}: {msg}", hint="fix env_schema.yaml")


def _var(raw: dict[str, Any], categories: dict[str, Category]) -> VarSpec:
    name = raw.get("name", "?")
    missing = [k for k in _REQUIRED if k not in raw]
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    if missing or unknown:
        raise _bad(f"{name}: missing keys {missing}, unknown keys {unknown}")
    if not str(name).startswith(PREFIX):
        raise _bad(f"{name}: names start with {PREFIX}")
    if raw["type"] not in TYPES:
        raise _bad(f"{name}: type {raw['type']!r} is not one of {TYPES}")
    if raw["category"] not in categories:
        raise _bad(f"{name}: category {raw['category']!r} is not declared")
    consumers = []
    for c in raw["consumers"]:
        if c.get("kind") not in CONSUMER_KINDS or not c.get("target"):
            raise _bad(f"{name}: bad consumer {c!r}")
        pending = c.get("pending")
        if set(c) - {"kind", "target", "pending"} or not (
                pending is None or (type(pending) is int and pending > 0)):
            raise _bad(f"{name}: bad consumer {c!r} (keys kind, target and optional "
                       "pending: the number of the issue that will consume it)")
        consumers.append(Consumer(kind=c["kind"], target=str(c["target"]), pending=pending))
    if not consumers:
        raise _bad(f"{name}: a variable needs at least one consumer")
    if raw["type"] == "enum" and not raw.get("choices"):
        raise _bad(f"{name}: an enum needs choices")
    opt = {k: raw[k] for k in _OPTIONAL if k in raw}
    for key in ("min", "max", "example"):
        if key in opt:
            opt[key] = env_text(opt[key])
    if "choices" in opt:
        opt["choices"] = tuple(env_text(c) for c in opt["choices"])
    if "example_with" in opt:
        opt["example_with"] = {str(k): env_text(v) for k, v in opt["example_with"].items()}
    return VarSpec(
        name=str(name),
        category=str(raw["category"]),
        type=str(raw["type"]),
        default=env_text(raw["default"]),
        summary=" ".join(str(raw["summary"]).split()),
        help=" ".join(str(raw["help"]).split()),
        consumers=tuple(consumers),
        **opt,
    )


def parse_schema(doc: dict[str, Any]) -> Schema:
    categories = {
        key: Category(key=key, title=str(c["title"]), summary=str(c["summary"]))
        for key, c in doc["categories"].items()
    }
    variables = tuple(_var(raw, categories) for raw in doc["variables"])
    names = [v.name for v in variables]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise _bad(f"duplicate names {dupes}")
    return Schema(version=int(doc["version"]), categories=categories, variables=variables)


def cache_path(path: Path) -> Path:
    """Where the parsed copy of a schema file lives: beside it, as .json."""
    return path.with_suffix(".json")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parse_yaml(text: str) -> dict[str, Any]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(text, Loader=loader)


def _cached_document(path: Path, digest: str) -> dict[str, Any] | None:
    """The parsed document from the JSON copy, if it was made from exactly this YAML."""
    try:
        cached = json.loads(cache_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("yaml_sha256") != digest:
        return None
    doc = cached.get("document")
    return doc if isinstance(doc, dict) else None


def cache_text(path: Path = SCHEMA_PATH) -> str:
    """The JSON copy that belongs beside `path` (what `write_cache` writes)."""
    data = path.read_bytes()
    doc = _parse_yaml(data.decode("utf-8"))
    return json.dumps({"yaml_sha256": _digest(data), "document": doc}, indent=1) + "\n"


def write_cache(path: Path = SCHEMA_PATH) -> Path:
    target = cache_path(path)
    target.write_text(cache_text(path), encoding="utf-8")
    return target


@functools.lru_cache(maxsize=4)
def load_schema(path: Path = SCHEMA_PATH) -> Schema:
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise Sm70Error(
            f"cannot read the env schema {path}: {reason}",
            hint="reinstall sm70ctl (the schema ships inside the package)",
        ) from None
    doc = _cached_document(path, _digest(data))
    return parse_schema(doc if doc is not None else _parse_yaml(text))


if __name__ == "__main__":
    print(f"wrote {write_cache()}")
