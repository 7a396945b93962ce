"""Property-based fuzzing of every reader: arbitrary bytes in, a valid result or one clean
refusal out, never a traceback.

Each reader gets raw bytes and, for the structured formats, documents built from random
JSON/TOML values (so the fuzzing reaches past the parser into the type checks). Example
counts stay modest so the suite stays fast; there is no deadline, since the first example
pays for imports.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sm70ctl.errors import Sm70Error

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=False), st.text(max_size=20))
_json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)
_keys = st.sampled_from(["name", "repo_id", "revision", "files", "size", "sha256", "stat",
                         "format", "complete", "include", "schema_version", "nvml", "gpus",
                         "version", "steps", "entries", "fingerprint", "text_config",
                         "num_hidden_layers", "num_key_value_heads", "head_dim", "models"])


def _docs(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """A known-good document with random members replaced, added or removed."""
    def mutate(changes: dict[str, Any], drop: list[str]) -> bytes:
        doc = {k: v for k, v in base.items() if k not in drop}
        doc.update(changes)
        return json.dumps(doc).encode()

    return st.builds(mutate, st.dictionaries(_keys, _json_values, max_size=3),
                     st.lists(st.sampled_from(sorted(base) or ["x"]), max_size=2))


_raw = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
)


def _check(fn: Callable[[Path], Any], path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        fn(path)
    except Sm70Error as exc:
        assert exc.message and "Traceback" not in exc.message
        # bounded, however much the input holds: one line per problem found, each short
        # (a settings error lists every problem, each naming the file's full path)
        lines = exc.message.splitlines()
        assert len(lines) <= 100, exc.message[:300]
        assert all(len(line) < 1000 for line in lines), exc.message[:300]


@pytest.fixture
def spot(tmp_path: Path) -> Path:
    return tmp_path / "input"


@FUZZ
@given(data=_raw)
def test_fuzz_read_json(spot: Path, data: bytes) -> None:
    from sm70ctl.readers import read_json

    _check(lambda p: read_json(p, what="fuzz"), spot, data)


@FUZZ
@given(data=st.one_of(_raw, st.text(alphabet=string.printable + "[]{}=\"'.#\u2028",
                                    max_size=200).map(str.encode)))
def test_fuzz_read_toml(spot: Path, data: bytes) -> None:
    from sm70ctl.readers import read_toml

    _check(lambda p: read_toml(p, what="fuzz"), spot, data)


_env_lines = st.lists(st.one_of(
    st.text(max_size=40),
    st.builds(lambda k, v, q, c: f"{k}={q}{v}{q}{c}",
              st.sampled_from(["SM70_PORT", "SM70_HOST", "SM70_API_KEY", "SM70_API_KYE",
                               "SM70_GPUS", "SM70_MODEL_DIR", "export SM70_PORT", "X"]),
              st.text(max_size=20), st.sampled_from(["", "'", '"']),
              st.sampled_from(["", " # c", "#c", " junk"])),
), max_size=8)


@FUZZ
@given(data=st.one_of(_raw, _env_lines.map(lambda ls: "\n".join(ls).encode(
    "utf-8", "surrogatepass"))))
def test_fuzz_env_file(spot: Path, data: bytes) -> None:
    from sm70ctl.settings.loader import load_settings

    def load(p: Path) -> None:
        try:
            load_settings({}, env_file=p)
        except Sm70Error as exc:
            assert "sk-" not in exc.message
            raise

    _check(load, spot, data)


_MANIFEST = {"name": "tiny", "repo_id": "o/r", "revision": "a" * 40, "complete": True,
             "files": {"config.json": {"size": 2, "sha256": "b" * 64}}, "format": 1}


@FUZZ
@given(data=st.one_of(_raw, _docs(_MANIFEST)))
def test_fuzz_weights_manifest(tmp_path: Path, data: bytes) -> None:
    from sm70ctl.weights.manifest import manifest_path, read_manifest
    from sm70ctl.weights.verify import verify_folder

    folder = tmp_path / "model"
    path = manifest_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")

    def load(_: Path) -> None:
        read_manifest(folder)
        verify_folder(folder, check_quant=False)

    _check(load, path, data)


@FUZZ
@given(data=st.one_of(_raw, st.builds(
    lambda name, body: f"[models.{name}]\n{body}".encode("utf-8", "surrogatepass"),
    st.text(alphabet=string.ascii_lowercase + "-.", min_size=1, max_size=8),
    st.text(alphabet=string.printable, max_size=120))))
def test_fuzz_model_pins(spot: Path, data: bytes) -> None:
    from sm70ctl.weights.pins import load_model_pins

    _check(load_model_pins, spot, data)


_PROBES = {"schema_version": 1, "nvml": {"available": False, "error": "x", "gpus": []}}


@FUZZ
@given(data=st.one_of(_raw, _docs(_PROBES)))
def test_fuzz_doctor_probe_data(spot: Path, data: bytes) -> None:
    from sm70ctl.doctor.command import load_probe_data

    _check(load_probe_data, spot, data)


_CONFIG = {"model_type": "qwen3_5", "text_config": {
    "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
    "intermediate_size": 512}}


@FUZZ
@given(data=st.one_of(_raw, _docs(_CONFIG)))
def test_fuzz_plan_model_config(spot: Path, data: bytes) -> None:
    from sm70ctl.plan.model_config import load_config

    _check(load_config, spot, data)


@FUZZ
@given(text=st.one_of(st.text(max_size=300), _json_values.map(json.dumps),
                      st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
                      _docs({"version": 1, "memory": {}}).map(bytes.decode)))
def test_fuzz_plugin_config(text: str) -> None:
    from vllm_patch.config import PluginConfig

    try:
        PluginConfig.from_json(text)
    except ValueError as exc:  # the plugin's own clean refusal (it may not import sm70ctl)
        assert str(exc).startswith("SM70_PLUGIN_CONFIG")


_WARM = {"fingerprint": "0123456789abcdef", "components": {"a": "b"}, "device": "cuda",
         "warm": True, "steps": [{"name": "vllm", "status": "done"}], "version": 1}


@FUZZ
@given(data=st.one_of(_raw, _docs(_WARM)))
def test_fuzz_warmup_manifest(tmp_path: Path, data: bytes) -> None:
    from sm70ctl.runtime.manifest import MANIFEST, assess, load_manifest

    entry = tmp_path / "0123456789abcdef"
    entry.mkdir(exist_ok=True)

    def load(_: Path) -> None:
        m = load_manifest(entry)
        assess("0123456789abcdef", {"a": "b"}, m, [])

    _check(load, entry / MANIFEST, data)


_LOCK_HEAD = ('schema = 1\n[toolchain]\ncuda = "12.8"\ngcc_min = "11.4"\ngcc_max_major = 14\n'
              'python = "3.11"\ncuda_arch_list = "7.0"\n')
_lock_tail = st.lists(st.one_of(
    st.sampled_from(["[git]", "[[git]]", "[[archive]]", "[[wheel]]", "[[local]]", "[models.m]",
                     'name = "x"', 'url = "file:///x"', "commit = 1", 'sha256 = "ab"',
                     "stray = true", "git = 3", "schema = 2", "wheel = []", "[toolchain]"]),
    st.text(alphabet=string.printable, max_size=30)), max_size=8)


@FUZZ
@given(data=st.one_of(_raw, _lock_tail.map(lambda ls: (_LOCK_HEAD + "\n".join(ls)).encode())))
def test_fuzz_build_lock(spot: Path, data: bytes) -> None:
    from sm70ctl.build.lock import load_lock

    _check(load_lock, spot, data)


@pytest.mark.parametrize("text,rule", [
    ("[" * 10_000, "levels deep"),
    ('{"version": 1, "sparse_prefill": {"percent": 1e999}}', "finite number"),
    ('{"version": NaN}', "not valid JSON"),
    ("x" * 100_000, "characters long"),
])
def test_plugin_config_refusals(text: str, rule: str) -> None:
    from vllm_patch.config import PluginConfig

    with pytest.raises(ValueError, match=rule):
        PluginConfig.from_json(text)
