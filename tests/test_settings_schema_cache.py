"""The parsed copy of env_schema.yaml (env_schema.json): current, used only while it matches
the YAML it was made from, and what keeps PyYAML off the start-up path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from sm70ctl.settings import schema as S


def _copy_schema(tmp_path: Path) -> Path:
    path = tmp_path / "env_schema.yaml"
    shutil.copyfile(S.SCHEMA_PATH, path)
    return path


def test_committed_cache_is_current() -> None:
    committed = S.cache_path(S.SCHEMA_PATH)
    assert committed.is_file(), f"missing {committed}: run `python -m sm70ctl.settings.schema`"
    assert committed.read_text(encoding="utf-8") == S.cache_text(S.SCHEMA_PATH), (
        f"{committed} is stale: run `python -m sm70ctl.settings.schema` and commit it")


def test_matching_cache_is_what_loads(tmp_path: Path) -> None:
    path = _copy_schema(tmp_path)
    S.write_cache(path)
    # Plant a difference only the JSON has: if it loads, the YAML was not parsed.
    cache = S.cache_path(path)
    data = json.loads(cache.read_text())
    data["document"]["variables"][0]["summary"] = "from the cache"
    cache.write_text(json.dumps(data))
    assert S.load_schema(path).variables[0].summary == "from the cache"


def test_stale_or_broken_cache_falls_back_to_the_yaml(tmp_path: Path) -> None:
    path = _copy_schema(tmp_path)
    S.write_cache(path)
    first = S.load_schema(path).variables[0]
    edited = path.read_text().replace(first.summary, "edited in the yaml", 1)
    assert edited != path.read_text()
    for cache_text in (S.cache_path(path).read_text(), "{not json", "[]",
                       json.dumps({"yaml_sha256": "0" * 64, "document": {}})):
        path.write_text(edited)
        S.cache_path(path).write_text(cache_text)
        S.load_schema.cache_clear()
        assert S.load_schema(path).variables[0].summary == "edited in the yaml", cache_text
    S.cache_path(path).unlink()
    S.load_schema.cache_clear()
    assert S.load_schema(path).variables[0].summary == "edited in the yaml"


def test_loading_settings_does_not_import_yaml() -> None:
    code = ("import sys; from sm70ctl.settings import load_settings; load_settings({}); "
            "print('yaml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
