"""Parsing and formatting of SM70_* values: text in, typed value out, or a clear reason.

Every parser takes the raw text of one variable and either returns the typed value or
raises `BadValue(rule, allowed)`; the caller adds the variable name, the value and where it
came from. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "BYTE_UNITS",
    "DURATION_UNITS",
    "BadValue",
    "format_bytes",
    "format_duration",
    "parse_bool",
    "parse_bytes",
    "parse_duration",
    "parse_float",
    "parse_int",
]


class BadValue(ValueError):
    """A value that breaks its variable's rule; `allowed` says what would be accepted."""

    def __init__(self, rule: str, allowed: str) -> None:
        super().__init__(rule)
        self.rule = rule
        self.allowed = allowed


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# Binary units are what GPU memory is counted in; decimal ones are accepted because
# people write "32GB" for disks. Bare numbers are bytes.
BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
DURATION_UNITS: dict[str, float] = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_INT = re.compile(r"^\s*[+-]?[0-9]+\s*$")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise BadValue("not a boolean", "true/false (also 1/0, yes/no, on/off)")


def parse_int(text: str) -> int:
    if not _INT.match(text):
        raise BadValue("not an integer", "a whole number such as 16")
    return int(text.strip())


def parse_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise BadValue("not a number", "a decimal number such as 0.9") from None
    if not math.isfinite(value):
        raise BadValue("not a finite number", "a decimal number such as 0.9")
    return value


def parse_bytes(text: str) -> int:
    """'9.9GiB' -> bytes (rounded down); a bare integer is bytes."""
    match = _NUMBER_UNIT.match(text)
    allowed = "a size such as 10630627328, 512MiB or 9.9GiB (units: B KiB MiB GiB TiB KB MB GB TB)"
    if not match:
        raise BadValue("not a byte size", allowed)
    number, unit = match.groups()
    factor = BYTE_UNITS.get(unit.lower())
    if factor is None:
        raise BadValue(f"unknown size unit {unit!r}", allowed)
    if unit == "" and "." in number:
        raise BadValue("a bare number of bytes must be whole", allowed)
    return int(float(number) * factor)


def parse_duration(text: str) -> float:
    """'30s', '5m', '1.5h', '250ms' -> seconds; a bare number is seconds."""
    match = _NUMBER_UNIT.match(text)
    allowed = "a duration such as 30s, 5m, 1h or 250ms (a bare number is seconds)"
    if not match:
        raise BadValue("not a duration", allowed)
    number, unit = match.groups()
    factor = DURATION_UNITS.get(unit.lower())
    if factor is None:
        raise BadValue(f"unknown duration unit {unit!r}", allowed)
    return float(number) * factor


def format_bytes(value: int) -> str:
    """Shortest exact binary-unit spelling, else the plain byte count."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def format_duration(seconds: float) -> str:
    if seconds and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{seconds:g}s"
