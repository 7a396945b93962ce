"""Readers reached through their callers: serve's model-folder probe, the doctor's env-file
fallback, the port-lock holder record."""

from __future__ import annotations

from pathlib import Path

import pytest

from sm70ctl.doctor.config import read_env_file
from sm70ctl.errors import UsageError
from sm70ctl.locking import _read_holder
from sm70ctl.runtime.probes import probe_model_dir


@pytest.mark.parametrize("content,error", [
    (b"[" * 100_000, "nested more than"),
    (b"\x00\x01", "binary content"),
    (b'{"a": 1, "a": 2}', "duplicate key"),
    (b"[]", "not an object"),
])
def test_model_dir_config_refused_cleanly(tmp_path: Path, content: bytes, error: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    state = probe_model_dir(tmp_path)
    assert state.exists and state.config is None and error in (state.error or "")


def test_model_dir_config_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    assert "is a folder" in (probe_model_dir(tmp_path).error or "")


def test_doctor_env_fallback_uses_dotenv_rules(tmp_path: Path) -> None:
    env = tmp_path / "d.env"
    env.write_text("\ufeffSM70_PORT='8001' # c\r\n# off\u2028SM70_HOST=0.0.0.0\nbroken line\n",
                   encoding="utf-8")
    assert read_env_file(env) == {"SM70_PORT": "8001"}
    with pytest.raises(UsageError, match="is a folder"):
        read_env_file(tmp_path)


def test_damaged_holder_record_names_nobody(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    for content in (b"[" * 100_000, b"\xff\xfe", b"", b"[1]", b'{"pid": 5}'):
        lock.write_bytes(content)
        assert _read_holder(lock) == ({"pid": 5} if content == b'{"pid": 5}' else {})


@pytest.mark.parametrize("line", [
    "[1, 2]", "[" * 100_000, '{"python_version": 3}', '{"torch_arch_list": "sm_70"}',
    '{"torch_installed": "yes"}', "not json",
])
def test_odd_python_probe_output_is_ignored(tmp_path: Path, line: str) -> None:
    import os
    import stat

    from sm70ctl.doctor.config import DoctorConfig
    from sm70ctl.doctor.probes import probe_python

    fake = tmp_path / "python"
    (tmp_path / "line").write_text(line)
    fake.write_text(f"#!/bin/sh\nprintf 'SM70CTL-PROBE '; cat {tmp_path / 'line'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    probe = probe_python(DoctorConfig(serve_python=str(fake)), dict(os.environ))
    assert probe.exists and probe.python_version is None and probe.torch_installed is None


@pytest.mark.parametrize("out", ["[" * 100_000, "[1]", '{"torch": [1]}', "garbage"])
def test_odd_serving_versions_output(tmp_path: Path, out: str) -> None:
    import stat

    from sm70ctl.runtime.fingerprint import serving_versions

    (tmp_path / "out").write_text(out)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'out'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    got = serving_versions(fake)
    assert list(got) == ["serving_python"] and got["serving_python"].startswith("unusable")
