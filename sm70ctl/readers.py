"""One bounded, typed way to read every file the tool reads (JSON, TOML, text).

A file on disk is input like any other: it may be binary, a folder, a link to /dev/zero,
nested a million levels deep, or hold `null` where a string belongs. Every reader here turns
such content into one `Sm70Error` line naming the file, the place inside it and the rule,
so no caller needs its own try/except around `json.loads` and no RecursionError or
KeyError ever reaches the user. `View` then gives type-checked access to the parsed data.

Pure apart from the one `read_bytes` that touches the disk.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

from sm70ctl.errors import Sm70Error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "NAME_MAX",
    "PATH_MAX",
    "View",
    "check_path",
    "nesting_depth",
    "parse_json",
    "parse_toml",
    "path_problem",
    "read_bytes",
    "read_json",
    "read_text",
    "read_toml",
]

# Linux limits: a component longer than NAME_MAX or a path longer than PATH_MAX makes
# every system call on it fail with ENAMETOOLONG, so such a path is refused where it is
# given rather than when something first touches it.
NAME_MAX = 255
PATH_MAX = 4096

# Far above any config, manifest or lock the tool writes (the largest, a checkpoint's
# safetensors index, is well under a MiB), far below what would hurt memory.
MAX_FILE_BYTES = 16 * 1024 * 1024
# Real configs nest a handful of levels; the limit stays well below Python's recursion
# limit so that neither the parser nor code walking the result can overflow the stack.
MAX_DEPTH = 64


def path_problem(text: str | os.PathLike[str]) -> str | None:
    """Why a path cannot work on Linux (NUL byte, too-long component or whole), else None."""
    raw = os.fsencode(text)
    if b"\x00" in raw:
        return "a path cannot contain a NUL byte"
    if len(raw) > PATH_MAX:
        return f"path is {len(raw)} bytes long (limit {PATH_MAX} bytes)"
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            return (f"a path component is {len(part)} bytes long "
                    f"(limit {NAME_MAX} bytes per component)")
    return None


def check_path(path: str | os.PathLike[str], what: str) -> Path:
    """`path` as a Path, or Sm70Error naming `what` when the path cannot work."""
    problem = path_problem(path)
    if problem is not None:
        raise Sm70Error(f"{what} {_short(path)}: {problem}")
    return Path(path)


def _short(path: str | os.PathLike[str], limit: int = 120) -> str:
    """A path as shown in a message: long ones cut in the middle, so one line stays one line."""
    text = os.fsdecode(path) if not isinstance(path, str) else path
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}...{text[-limit // 2:]}"


def read_bytes(path: str | os.PathLike[str], *, what: str,
               max_bytes: int = MAX_FILE_BYTES, allow_pipe: bool = False) -> bytes:
    """The content of a regular file of at most `max_bytes`, else one Sm70Error line.

    Links are followed (a checkpoint may link its files); what they lead to must be a
    regular file, so a folder or device is refused before it is opened. `allow_pipe`
    also takes a pipe (`--env-file <(...)`): it is read up to the same limit."""
    p = check_path(path, what)
    try:
        info = p.stat()
    except OSError as exc:
        raise Sm70Error(f"{what} {_short(p)}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise Sm70Error(f"{what} {_short(p)}: is a folder, not a file")
    pipe = allow_pipe and stat.S_ISFIFO(info.st_mode)
    if not stat.S_ISREG(info.st_mode) and not pipe:
        raise Sm70Error(f"{what} {_short(p)}: not a regular file")
    if info.st_size > max_bytes:
        raise Sm70Error(f"{what} {_short(p)}: {info.st_size:,} bytes, over the limit of "
                        f"{max_bytes:,} bytes")
    try:
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)  # the file may have grown since stat
    except OSError as exc:
        raise Sm70Error(f"{what} {_short(p)}: cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise Sm70Error(f"{what} {_short(p)}: over the limit of {max_bytes:,} bytes")
    return data


def decode_text(data: bytes, *, what: str, name: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped), refusing binary content."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if b"\x00" in data:
        raise Sm70Error(f"{what} {_short(name)}: binary content (NUL byte), not a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Sm70Error(f"{what} {_short(name)}: not UTF-8 text (bad byte at offset "
                        f"{exc.start})") from None


def read_text(path: str | os.PathLike[str], *, what: str,
              max_bytes: int = MAX_FILE_BYTES, allow_pipe: bool = False) -> str:
    """A bounded UTF-8 text file (BOM dropped), else one Sm70Error line."""
    data = read_bytes(path, what=what, max_bytes=max_bytes, allow_pipe=allow_pipe)
    return decode_text(data, what=what, name=os.fspath(path))


# Every alternative ends at its closing quote or, unterminated, at the end of the line or
# text, so each match always succeeds and the scan stays linear: a pattern that must find
# its closing quote rescans the rest of the text from every stray quote, which a file of
# escaped quotes turns quadratic. A string left open is a parse error anyway.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_TOML_STRING = re.compile(r'"""(?:[^\\]|\\.)*?(?:"""|\Z)|\'\'\'.*?(?:\'\'\'|\Z)'
                          r'|"(?:[^"\\\n]|\\.)*"?|\'[^\'\n]*\'?|#[^\n]*', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPEN = frozenset("[{")
_CLOSE = frozenset("]}")


def nesting_depth(text: str, strings: re.Pattern[str] = _JSON_STRING,
                  limit: int | None = None) -> int:
    """The deepest bracket nesting outside strings (and TOML comments), counting stops once
    past `limit`: checked before parsing, since the parsers recurse once per level and
    overflow Python's stack."""
    depth = deepest = 0
    for ch in _NOT_BRACKET.sub("", strings.sub("", text)):
        if ch in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
                if limit is not None and deepest > limit:
                    break
        elif ch in _CLOSE:
            depth -= 1
    return deepest


def _max_depth(value: Any, limit: int) -> int:
    """Depth of parsed data, stopping once past `limit` (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, level + 1) for c in children)
    return deepest


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(text: str, *, what: str, name: str, max_depth: int = MAX_DEPTH) -> Any:
    """Strict JSON (no NaN, no duplicate keys) nested at most `max_depth` levels."""
    if nesting_depth(text, limit=max_depth) > max_depth:
        raise Sm70Error(f"{what} {_short(name)}: nested more than {max_depth} levels deep")
    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise Sm70Error(f"{what} {_short(name)}: not valid JSON: {exc.msg} at line "
                        f"{exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # duplicate key, NaN, a 5000-digit number
        raise Sm70Error(f"{what} {_short(name)}: not valid JSON: {_one_line(exc)}") from None
    return value


def parse_toml(text: str, *, what: str, name: str, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """TOML nested at most `max_depth` levels (dotted keys and tables counted too)."""
    if nesting_depth(text, _TOML_STRING, max_depth) > max_depth:
        raise Sm70Error(f"{what} {_short(name)}: nested more than {max_depth} levels deep")
    try:
        value = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Sm70Error(f"{what} {_short(name)}: not valid TOML: {_one_line(exc)}") from None
    except (ValueError, RecursionError) as exc:
        raise Sm70Error(f"{what} {_short(name)}: not valid TOML: {_one_line(exc)}") from None
    if _max_depth(value, max_depth) > max_depth:  # a.b.c.d... = 1 nests without brackets
        raise Sm70Error(f"{what} {_short(name)}: nested more than {max_depth} levels deep")
    return value


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] or type(exc).__name__


def read_json(path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH) -> Any:
    """A bounded, strict JSON file, or one Sm70Error line naming `what`, the file and why."""
    text = read_text(path, what=what, max_bytes=max_bytes)
    return parse_json(text, what=what, name=os.fspath(path), max_depth=max_depth)


def read_toml(path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """A bounded TOML file (always a table at the top), or one Sm70Error line."""
    text = read_text(path, what=what, max_bytes=max_bytes)
    return parse_toml(text, what=what, name=os.fspath(path), max_depth=max_depth)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

_TYPE_NAMES = {
    type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
    str: "a string", list: "an array", dict: "a table",
}


def type_name(value: Any) -> str:
    """How a value's type reads in a message: 'null', 'a table', 'an array'..."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


class View:
    """Parsed data plus where it sits (file and place), with type-checked access.

    Each accessor either returns a value of the promised type or raises one Sm70Error line
    `"<what> <file>: <place>: <rule>"`, e.g. `lock file sm70.lock.toml: sources[2].sha256:
    expected a string, got null`."""

    def __init__(self, value: Any, *, what: str, name: str, place: str = "") -> None:
        self.value = value
        self.what = what
        self.name = name
        self.place = place

    # --- places and failures -------------------------------------------------------------
    def _at(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.place}[{key}]"
        key = _short(key, 60)  # a key is data too: a megabyte-long one stays one short line
        return f"{self.place}.{key}" if self.place else key

    def fail(self, rule: str, key: str | int | None = None) -> NoReturn:
        """Raise the one-line error for this place (or its `key`)."""
        place = self._at(key) if key is not None else (self.place or "top level")
        raise Sm70Error(f"{self.what} {_short(self.name)}: {_short(place, 200)}: "
                        f"{_short(rule, 300)}")

    def child(self, key: str | int, value: Any) -> View:
        return View(value, what=self.what, name=self.name, place=self._at(key))

    # --- the value itself -----------------------------------------------------------------
    def table(self) -> View:
        """This value, checked to be a table (JSON object)."""
        if not isinstance(self.value, dict):
            self.fail(f"expected a table, got {type_name(self.value)}")
        return self

    def array(self) -> list[View]:
        """This value, checked to be an array; its items as Views."""
        if not isinstance(self.value, list):
            self.fail(f"expected an array, got {type_name(self.value)}")
        return [self.child(i, v) for i, v in enumerate(self.value)]

    def keys(self) -> list[str]:
        return list(self.table().value)

    def only(self, allowed: Iterable[str]) -> View:
        """Refuse keys outside `allowed` (a stray key is usually a typo that would be lost)."""
        allowed = set(allowed)
        for key in self.table().value:
            if key not in allowed:
                self.fail(f"unknown key (allowed: {', '.join(sorted(allowed))})", key)
        return self

    def has(self, key: str) -> bool:
        return key in self.table().value

    def _get(self, key: str, default: Any) -> tuple[bool, Any]:
        """(present, value): an absent key gives its default, or fails when it has none."""
        data = self.table().value
        if key not in data:
            if default is MISSING:
                self.fail("missing", key)
            return False, default
        return True, data[key]

    # --- typed members --------------------------------------------------------------------
    def get(self, key: str, default: Any = MISSING) -> View:
        """The member as a View (its type checked by the caller)."""
        return self.child(key, self._get(key, default)[1])

    def sub(self, key: str, default: Any = MISSING) -> View:
        """A member that must be a table."""
        return self.get(key, default).table()

    def tables(self, key: str, default: Any = MISSING) -> list[View]:
        """A member that must be an array of tables (`[[key]]` in TOML)."""
        items = self.get(key, default).array()
        for item in items:
            item.table()
        return items

    def get_str(self, key: str, default: Any = MISSING, *, max_len: int = 4096,
                pattern: str | None = None, nonempty: bool = False) -> str:
        present, value = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, str):
            self.fail(f"expected a string, got {type_name(value)}", key)
        if len(value) > max_len:
            self.fail(f"string of {len(value)} characters (limit {max_len})", key)
        if nonempty and not value.strip():
            self.fail("empty string", key)
        if pattern is not None and not re.fullmatch(pattern, value):
            self.fail(f"does not match {pattern}", key)
        return value

    def get_int(self, key: str, default: Any = MISSING, *, min: int | None = None,
                max: int | None = None) -> int:
        present, value = self._get(key, default)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"expected an integer, got {type_name(value)}", key)
        if min is not None and value < min:
            self.fail(f"{value} is below the minimum {min}", key)
        if max is not None and value > max:
            self.fail(f"{value} is above the maximum {max}", key)
        return value

    def get_float(self, key: str, default: Any = MISSING, *, min: float | None = None,
                  max: float | None = None) -> float:
        present, value = self._get(key, default)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"expected a number, got {type_name(value)}", key)
        if not math.isfinite(value):
            self.fail("not a finite number", key)
        if min is not None and value < min:
            self.fail(f"{value} is below the minimum {min}", key)
        if max is not None and value > max:
            self.fail(f"{value} is above the maximum {max}", key)
        return float(value)

    def get_bool(self, key: str, default: Any = MISSING) -> bool:
        present, value = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, bool):
            self.fail(f"expected true or false, got {type_name(value)}", key)
        return value

    def get_str_list(self, key: str, default: Any = MISSING, *, max_len: int = 4096,
                     max_items: int = 100_000) -> list[str]:
        present, value = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, list):
            self.fail(f"expected an array of strings, got {type_name(value)}", key)
        if len(value) > max_items:
            self.fail(f"{len(value)} items (limit {max_items})", key)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.child(key, value).fail(f"expected a string, got {type_name(item)}", i)
            if len(item) > max_len:
                self.child(key, value).fail(f"string of {len(item)} characters "
                                            f"(limit {max_len})", i)
        return list(value)

    def get_int_list(self, key: str, default: Any = MISSING, *, min: int | None = None,
                     max: int | None = None, max_items: int = 100_000) -> list[int]:
        present, value = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, list):
            self.fail(f"expected an array of integers, got {type_name(value)}", key)
        if len(value) > max_items:
            self.fail(f"{len(value)} items (limit {max_items})", key)
        arr = self.child(key, value)
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                arr.fail(f"expected an integer, got {type_name(item)}", i)
            if (min is not None and item < min) or (max is not None and item > max):
                arr.fail(f"{item} is outside {min}..{max}", i)
        return list(value)

    def get_str_map(self, key: str, default: Any = MISSING, *,
                    max_len: int = 4096) -> dict[str, str]:
        """A member that must be a table of string values (e.g. file name -> sha256)."""
        present, value = self._get(key, default)
        if not present:
            return value
        sub = self.child(key, value).table()
        for k, v in sub.value.items():
            if not isinstance(v, str):
                sub.fail(f"expected a string, got {type_name(v)}", k)
            if len(v) > max_len:
                sub.fail(f"string of {len(v)} characters (limit {max_len})", k)
        return dict(sub.value)

    def items(self) -> Iterator[tuple[str, View]]:
        for key, value in self.table().value.items():
            yield key, self.child(key, value)


def view_json(path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH) -> View:
    """`read_json` wrapped in a View whose errors name `what` and the file."""
    data = read_json(path, what=what, max_bytes=max_bytes, max_depth=max_depth)
    return View(data, what=what, name=os.fspath(path))


def view_toml(path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH) -> View:
    """`read_toml` wrapped in a View."""
    data = read_toml(path, what=what, max_bytes=max_bytes, max_depth=max_depth)
    return View(data, what=what, name=os.fspath(path))


def as_view(data: Mapping[str, Any] | Any, *, what: str, name: str) -> View:
    """A View over data parsed elsewhere (e.g. a JSON line from a probe's stdout)."""
    return View(data, what=what, name=name)
