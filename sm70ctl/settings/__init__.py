"""The SM70_* settings: schema, typed model, cross-field rules, and the `env` commands.

    from sm70ctl.settings import load_settings
    settings = load_settings()            # os.environ
    settings = load_settings({"SM70_PORT": "8100"}, env_file=Path(".env"))
    settings.port, settings.kv_cache_bytes, settings.source_of("SM70_PORT")

Attributes are the variable names lower-cased without SM70_. Byte sizes are ints (bytes),
durations floats (seconds), lists Python lists, paths `Path` (None when an optional path
is empty), secrets `pydantic.SecretStr` (None when empty; `.get_secret_value()` to use).
`SettingsView` (typed.py, generated from the schema) is their type for annotations.

The names below load lazily: importing this package (as the CLI does at start-up, for the
`env` command group) does not build the pydantic model until it is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sm70ctl.settings.loader import load_settings, sources_of
    from sm70ctl.settings.model import Settings
    from sm70ctl.settings.problems import Problem, SettingsError
    from sm70ctl.settings.schema import Schema, VarSpec, load_schema
    from sm70ctl.settings.typed import SettingsView

_LAZY = {
    "load_settings": "sm70ctl.settings.loader",
    "sources_of": "sm70ctl.settings.loader",
    "Settings": "sm70ctl.settings.model",
    "Problem": "sm70ctl.settings.problems",
    "SettingsError": "sm70ctl.settings.problems",
    "Schema": "sm70ctl.settings.schema",
    "VarSpec": "sm70ctl.settings.schema",
    "load_schema": "sm70ctl.settings.schema",
    "SettingsView": "sm70ctl.settings.typed",
}

__all__ = [
    "Problem",
    "Schema",
    "Settings",
    "SettingsError",
    "SettingsView",
    "VarSpec",
    "load_schema",
    "load_settings",
    "sources_of",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

