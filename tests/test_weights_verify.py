"""`weights verify`: offline re-checks of a fetched folder (missing, extra, corrupted),
the stat cache that makes it fast, `--full`, `--json`, and exit codes naming files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hubserver import BIG, SMALL
from tiny_fetch import fetch_tiny

from sm70ctl.weights.verify import verify_folder

REPO = "test-org/tiny-gptq-int8"
COMMIT = hashlib.sha1(b"verify commit").hexdigest()


@pytest.fixture
def fetched(tmp_path: Path) -> Path:
    """A folder fetched from a hub server that is stopped again before the test runs."""
    return fetch_tiny(tmp_path, REPO, COMMIT)


def _cli(tmp_path: Path, *args: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM70_", "HF_"))}
    # No hub anywhere: verify must not need one.
    env.update(SM70_WEIGHTS_DIR=str(tmp_path / "models"), HF_HUB_OFFLINE="1",
               HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf-home"),
               COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "sm70ctl", "weights", "verify", "--lock",
         str(tmp_path / "models.lock.toml"), *args],
        env=env, text=True, capture_output=True, timeout=120,
    )


def _flip_byte(path: Path, offset: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_clean_folder_verifies_offline(fetched, tmp_path):
    res = _cli(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "tiny" in res.stdout and "ok" in res.stdout
    data = json.loads(_cli(tmp_path, "--json").stdout)
    assert data[0]["ok"] is True and data[0]["issues"] == [] and data[0]["revision"] == COMMIT


def test_unchanged_files_are_not_rehashed(fetched):
    first = verify_folder(fetched)
    assert first.ok and first.hashed == 0  # the fetch recorded every file's stat
    os.utime(fetched / SMALL)  # touched: new mtime, same content
    second = verify_folder(fetched)
    assert second.ok and second.hashed == 1
    third = verify_folder(fetched)  # the new stat was recorded
    assert third.ok and third.hashed == 0
    assert verify_folder(fetched, full=True).hashed == first.files


def test_tampered_file_exits_1_naming_it(fetched, tmp_path):
    _flip_byte(fetched / BIG)
    res = _cli(tmp_path)
    assert res.returncode == 1
    assert BIG in res.stderr  # the error line names the file
    data = json.loads(_cli(tmp_path, "--json").stdout)
    assert [(i["kind"], i["path"]) for i in data[0]["issues"]] == [("corrupted", BIG)]


def test_tamper_behind_a_restored_mtime_needs_full(fetched, tmp_path):
    st = (fetched / SMALL).stat()
    _flip_byte(fetched / SMALL, 10)
    os.utime(fetched / SMALL, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify_folder(fetched).ok  # same size, mtime, inode: the fast path trusts it
    full = _cli(tmp_path, "--full")
    assert full.returncode == 1 and SMALL in full.stderr


def test_missing_extra_and_truncated_files(fetched, tmp_path):
    (fetched / "tokenizer_config.json").unlink()
    (fetched / "notes.txt").write_text("not from the hub")
    with open(fetched / SMALL, "r+b") as f:
        f.truncate(100)
    data = json.loads(_cli(tmp_path, "--json").stdout)[0]
    kinds = {(i["kind"], i["path"]) for i in data["issues"]}
    assert kinds == {("missing", "tokenizer_config.json"), ("extra", "notes.txt"),
                     ("corrupted", SMALL)}
    res = _cli(tmp_path)
    assert res.returncode == 1
    for name in ("tokenizer_config.json", "notes.txt", SMALL):
        assert name in res.stderr


def test_offline_fetch_lists_exactly_what_is_missing(fetched, tmp_path):
    (fetched / BIG).unlink()
    env_args = ["--lock", str(tmp_path / "models.lock.toml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM70_", "HF_"))}
    env.update(SM70_WEIGHTS_DIR=str(tmp_path / "models"), HF_HUB_OFFLINE="1", COLUMNS="200")
    res = subprocess.run([sys.executable, "-m", "sm70ctl", "weights", "fetch", "--offline",
                          *env_args], env=env, text=True, capture_output=True, timeout=120)
    assert res.returncode == 1
    assert BIG in res.stderr and "missing" in res.stdout


def test_bad_quant_config_fails_verify(fetched, tmp_path):
    cfg_path = fetched / "config.json"
    config = json.loads(cfg_path.read_text())
    config["quantization_config"]["group_size"] = 64
    cfg_path.write_text(json.dumps(config))
    res = _cli(tmp_path, "--json")
    assert res.returncode == 1
    data = json.loads(res.stdout)[0]
    # both the changed file and the quantization problem are reported
    assert ("corrupted", "config.json") in {(i["kind"], i["path"]) for i in data["issues"]}
    assert [q["field"] for q in data["quant_problems"]] == ["quantization_config.group_size"]


def test_folder_without_manifest(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.safetensors").write_bytes(b"x")
    report = verify_folder(tmp_path / "plain")
    assert not report.ok
    assert report.issues[0].kind == "no-manifest"
    res = subprocess.run([sys.executable, "-m", "sm70ctl", "weights", "verify", "--dir",
                          str(tmp_path / "plain")], text=True, capture_output=True, timeout=60)
    assert res.returncode == 1 and "manifest" in res.stderr


def test_missing_folder(tmp_path):
    report = verify_folder(tmp_path / "nope")
    assert not report.ok and "does not exist" in report.issues[0].detail


def test_unreadable_manifest_is_a_clear_error(fetched):
    from sm70ctl.errors import Sm70Error

    (fetched / ".sm70" / "manifest.json").write_text("{not json")
    with pytest.raises(Sm70Error, match=r"weights manifest .*manifest.json: "):
        verify_folder(fetched)


def test_manifest_writes_leave_no_temporary_files(fetched):
    os.utime(fetched / SMALL)
    verify_folder(fetched)  # rewrites the manifest (new stat)
    assert sorted(p.name for p in (fetched / ".sm70").iterdir()) == [
        "fetch.lock", "manifest.json", "partial"]


@pytest.mark.parametrize("text", [
    "[]",
    '{"name": "a", "repo_id": "r", "revision": "x", "files": []}',
    '{"name": "a", "repo_id": "r", "revision": "x", "files": {"a": "junk"}}',
    '{"name": "a", "repo_id": "r", "revision": "x", "files": {"a": {"size": 1, "stat": 5}}}',
    '{"name": "a", "repo_id": "r", "revision": "x", "files": {"a": {"size": 1, "sha256": 7}}}',
    '{"name": "a", "repo_id": "r", "revision": "x", "files": {}, "include": "*.json"}',
    '{"name": null, "repo_id": "r", "revision": "x", "files": {}}',
    '{"name": "a", "repo_id": "r", "revision": "x", "files": {}, "stray": 1}',
    '{"name": "a", "repo_id": "r", "revision": "x", "files": {"../x": {"size": 1}}}',
    '{"name": "a", "repo_id": "r", "revision": "x", "files": {"a": {"size": 1e400}}}',
    "[" * 100_000 + "]" * 100_000,
    "\x00\x01\x02binary",
    "<dir>",
], ids=["list", "files-list", "entry-str", "stat-int", "sha-int", "include-str", "null-name",
        "stray-key", "escape", "huge-number", "deep", "binary", "directory"])
def test_tampered_manifest_is_one_line_not_a_traceback(fetched, tmp_path, text):
    manifest = fetched / ".sm70" / "manifest.json"
    if text == "<dir>":
        manifest.unlink()
        manifest.mkdir()
    else:
        manifest.write_text(text)
    res = _cli(tmp_path, "--json")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert f"weights manifest {manifest}: " in " ".join(res.stderr.split()), res.stderr


@pytest.mark.parametrize("bad", ["../outside.bin", "/etc/hostname", ".sm70/manifest.json", "."])
def test_manifest_paths_outside_the_folder_are_refused(fetched, tmp_path, bad):
    (tmp_path / "models" / "outside.bin").write_bytes(b"x")
    path = fetched / ".sm70" / "manifest.json"
    data = json.loads(path.read_text())
    data["files"][bad] = {"size": 1}
    path.write_text(json.dumps(data))
    res = _cli(tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "unsafe file path" in res.stderr and repr(bad) in res.stderr


def test_a_record_that_disagrees_with_the_hub_does_not_vouch(fetched):
    # A file changed and its recorded sha256 (and stat) edited to match: the hub's LFS
    # sha256 still in the manifest must win.
    _flip_byte(fetched / BIG)
    path = fetched / ".sm70" / "manifest.json"
    data = json.loads(path.read_text())
    entry = data["files"][BIG]
    assert entry["lfs_sha256"]
    st = (fetched / BIG).stat()
    entry["sha256"] = hashlib.sha256((fetched / BIG).read_bytes()).hexdigest()
    entry["stat"] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    path.write_text(json.dumps(data))
    for full in (False, True):
        report = verify_folder(fetched, full=full)
        assert [(i.kind, i.path) for i in report.issues] == [("corrupted", BIG)]


def test_verify_dir_with_an_odd_config_is_not_a_traceback(fetched, tmp_path):
    (fetched / "config.json").write_text('{"text_config": 5}')
    res = subprocess.run([sys.executable, "-m", "sm70ctl", "weights", "verify", "--dir",
                          str(fetched), "--json"], text=True, capture_output=True, timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    data = json.loads(res.stdout)[0]
    assert ("corrupted", "config.json") in {(i["kind"], i["path"]) for i in data["issues"]}
