"""Model pins: the `[models.<name>]` tables of the lock file (sm70.lock.toml).

Each pin names a hub repository, a 40-character commit and the files to take from it:

    [models.base]
    repo_id = "Qwen/Qwen3.8-27B-GPTQ-Int8"
    revision = ""                      # 40 lower-case hex digits once checked on the hub
    unverified = "why there is no checked commit yet"
    local_dir = "qwen3.8-27b-gptq-int8" # sub-folder of SM70_WEIGHTS_DIR
    include = ["*.json", "*.safetensors"]
    exclude = []
    check_quant = true                 # validate config.json's quantization_config
    optional = false                   # fetched by default, or only when named / --all

A pin without a checked commit must say why in `unverified` (never a made-up commit);
`weights fetch` refuses it with that reason. Parsing is pure and raises `LockError`
naming the table, the field, the value and the rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.readers import read_toml

COMMIT = re.compile(r"^[0-9a-f]{40}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
REPO_TYPES = ("model", "dataset")
PIN_KEYS = ("repo_id", "revision", "unverified", "repo_type", "local_dir", "include",
            "exclude", "check_quant", "optional", "note")
# The lock holds a few dozen pins and build inputs.
MAX_LOCK_BYTES = 4 * 1024 * 1024


class PinError(Sm70Error):
    """A `[models]` table of the lock file is malformed."""


@dataclass(frozen=True)
class ModelPin:
    name: str
    repo_id: str
    revision: str  # 40-hex commit, or "" when unverified
    local_dir: str
    repo_type: str = "model"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    check_quant: bool = False
    optional: bool = False
    unverified: str = ""  # why there is no checked commit
    note: str = ""
    source: str = field(default="", compare=False)  # the lock file it came from

    @property
    def is_placeholder(self) -> bool:
        return not COMMIT.match(self.revision)

    def describe_revision(self) -> str:
        return self.revision if not self.is_placeholder else "UNVERIFIED PLACEHOLDER"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "repo_id": self.repo_id,
            "repo_type": self.repo_type,
            "revision": self.revision,
            "placeholder": self.is_placeholder,
            "unverified": self.unverified,
            "local_dir": self.local_dir,
            "include": list(self.include),
            "exclude": list(self.exclude),
            "check_quant": self.check_quant,
            "optional": self.optional,
            "note": self.note,
        }


def _str(entry: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> str:
    value = entry.get(key, "")
    if not isinstance(value, str) or (required and not value):
        raise PinError(f"{where}: field {key!r} = {value!r} must be a non-empty string"
                       if required else f"{where}: field {key!r} = {value!r} must be a string")
    return value


def _bool(entry: Mapping[str, Any], key: str, where: str) -> bool:
    value = entry.get(key, False)
    if not isinstance(value, bool):
        raise PinError(f"{where}: field {key!r} = {value!r} must be true or false")
    return value


def _patterns(entry: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PinError(f"{where}: field {key!r} = {value!r} must be a list of glob patterns")
    return tuple(value)


def parse_model_pins(doc: Mapping[str, Any], source: str = "lock") -> list[ModelPin]:
    """The `[models.*]` tables of a parsed lock document, validated."""
    models = doc.get("models", {})
    if not isinstance(models, Mapping):
        raise PinError(f"{source}: `models` must be a table of [models.<name>] tables")
    pins: list[ModelPin] = []
    seen_dirs: dict[str, str] = {}
    for name, entry in models.items():
        where = f"{source}: [models.{name}]"
        if not _NAME.match(name):
            raise PinError(f"{where}: name {name!r} must match {_NAME.pattern}")
        if not isinstance(entry, Mapping):
            raise PinError(f"{where}: must be a table")
        stray = sorted(set(entry) - set(PIN_KEYS))
        if stray:
            raise PinError(f"{where}: unknown key {stray[0]!r} (allowed: {', '.join(PIN_KEYS)})")
        repo_id = _str(entry, "repo_id", where, required=True)
        if not _REPO_ID.match(repo_id):
            raise PinError(f"{where}: repo_id {repo_id!r} must look like 'owner/name'")
        revision = _str(entry, "revision", where)
        unverified = _str(entry, "unverified", where)
        if revision and not COMMIT.match(revision):
            raise PinError(
                f"{where}: revision {revision!r} must be a 40-character lower-case hex commit "
                "(branch and tag names move; leave it empty and say why in `unverified`)"
            )
        if not revision and not unverified:
            raise PinError(f"{where}: no revision; an unverified pin must say why in "
                           "`unverified = \"...\"`")
        if revision and unverified:
            raise PinError(f"{where}: has both a revision and `unverified`; keep one")
        repo_type = _str(entry, "repo_type", where) or "model"
        if repo_type not in REPO_TYPES:
            raise PinError(f"{where}: repo_type {repo_type!r} must be one of {REPO_TYPES}")
        local_dir = _str(entry, "local_dir", where) or name
        parts = PurePosixPath(local_dir).parts
        if local_dir.startswith("/") or ".." in parts or len(parts) != 1:
            raise PinError(f"{where}: local_dir {local_dir!r} must be one plain folder name")
        if local_dir in seen_dirs:
            raise PinError(f"{where}: local_dir {local_dir!r} is also used by "
                           f"[models.{seen_dirs[local_dir]}]")
        seen_dirs[local_dir] = name
        pins.append(
            ModelPin(
                name=name,
                repo_id=repo_id,
                revision=revision,
                local_dir=local_dir,
                repo_type=repo_type,
                include=_patterns(entry, "include", where),
                exclude=_patterns(entry, "exclude", where),
                check_quant=_bool(entry, "check_quant", where),
                optional=_bool(entry, "optional", where),
                unverified=unverified,
                note=_str(entry, "note", where),
                source=source,
            )
        )
    return pins


def default_lock_path() -> Path:
    """The lock shipped with the package (shared with `sm70ctl build`)."""
    from sm70ctl.build.lock import packaged_lock_path

    return packaged_lock_path()


def load_model_pins(path: Path | None = None) -> list[ModelPin]:
    """Read and validate the model pins of a lock file (default: the packaged one)."""
    p = Path(path) if path else default_lock_path()
    try:
        doc = read_toml(p, what="lock file", max_bytes=MAX_LOCK_BYTES)
    except Sm70Error as exc:
        raise PinError(exc.message, hint="pass --lock PATH to a lock file with "
                       "[models.<name>] tables") from None
    pins = parse_model_pins(doc, str(p))
    if not pins:
        raise PinError(f"{p} has no [models.<name>] tables: nothing is pinned to fetch")
    return pins


def select_pins(pins: list[ModelPin], names: list[str], include_optional: bool) -> list[ModelPin]:
    """The pins a command acts on: the named ones, else the required ones (+ optional)."""
    if names:
        by_name = {p.name: p for p in pins}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            from sm70ctl.errors import UsageError

            raise UsageError(
                f"no model pin named {', '.join(map(repr, unknown))}; pinned: "
                f"{', '.join(by_name)}"
            )
        return [by_name[n] for n in dict.fromkeys(names)]
    return [p for p in pins if include_optional or not p.optional]


def pins_summary(path: Path | None = None) -> str:
    """A few lines for --help: every pin and its revision (never raises)."""
    try:
        pins = load_model_pins(path)
    except Sm70Error as exc:
        return f"(model pins unavailable: {exc.message})"
    lines = []
    for p in pins:
        flag = " (optional)" if p.optional else ""
        lines.append(f"* `{p.name}`{flag}: {p.repo_id} @ {p.describe_revision()}")
    return "\n".join(lines)


__all__ = [
    "COMMIT",
    "ModelPin",
    "PinError",
    "default_lock_path",
    "load_model_pins",
    "parse_model_pins",
    "pins_summary",
    "select_pins",
]
