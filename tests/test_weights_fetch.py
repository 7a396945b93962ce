"""`weights fetch` against a local hub server with the real huggingface_hub client:
a normal download, resume after a dropped connection and after a killed process, a wrong
revision, a placeholder pin, a full disk, and the token never printed."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hubserver import BIG, SMALL, HubServer, Repo, lock_text, tiny_files

from sm70ctl.errors import Sm70Error
from sm70ctl.weights.fetch import FetchConfig, fetch_pin
from sm70ctl.weights.manifest import partial_path, read_manifest
from sm70ctl.weights.pins import parse_model_pins

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = "test-org/tiny-gptq-int8"
COMMIT = hashlib.sha1(b"tiny commit").hexdigest()
TOKEN = "hf_sEcReT0123456789abcdefTOKENvalue"
WANTED = ["config.json", BIG, SMALL, "tokenizer_config.json"]


@pytest.fixture
def files() -> dict[str, bytes]:
    return tiny_files()


@pytest.fixture
def hub(files):
    server = HubServer()
    server.add_repo(Repo(REPO, {COMMIT: files}, refs={"main": COMMIT}))
    with server:
        yield server


def _pin(revision: str = COMMIT, **kw):
    return parse_model_pins(tomllib.loads(lock_text("tiny", REPO, revision, **kw)), "test.lock")[0]


def _cfg(tmp_path: Path, hub: HubServer, token: str | None = None) -> FetchConfig:
    return FetchConfig(weights_dir=tmp_path / "models", token=token, endpoint=hub.url,
                       progress=False)


def _cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM70_", "HF_", "HUGGING_FACE"))}
    env.update(
        SM70_WEIGHTS_DIR=str(tmp_path / "models"),
        HF_HOME=str(tmp_path / "hf-home"),  # no stored token, no shared cache
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        COLUMNS="200",
    )
    env.update(extra)
    return env


def _cli(args: list[str], env: dict[str, str], timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "sm70ctl", *args], env=env, text=True,
                          capture_output=True, timeout=timeout)


def _write_lock(tmp_path: Path, revision: str = COMMIT, **kw) -> Path:
    lock = tmp_path / "models.lock.toml"
    lock.write_text(lock_text("tiny", REPO, revision, **kw))
    return lock


def test_fetch_downloads_selected_files_and_writes_manifest(tmp_path, hub, files):
    result = fetch_pin(_pin(), _cfg(tmp_path, hub))
    folder = tmp_path / "models" / "tiny"
    assert sorted(result.downloaded) == sorted(WANTED)
    for name in WANTED:
        assert (folder / name).read_bytes() == files[name]
    # include/exclude: README.md and original/ are not fetched
    assert not (folder / "README.md").exists()
    assert not (folder / "original").exists()
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.complete and manifest.revision == COMMIT
    assert set(manifest.files) == set(WANTED)
    for name in WANTED:
        entry = manifest.files[name]
        assert entry.sha256 == hashlib.sha256(files[name]).hexdigest()
        assert entry.size == len(files[name])
    assert manifest.files[BIG].lfs_sha256 == manifest.files[BIG].sha256  # compared with hub
    assert result.quant_problems == []
    # no partial files left behind
    assert not list((folder / ".sm70" / "partial").rglob("*.safetensors"))


def test_second_fetch_downloads_nothing(tmp_path, hub):
    fetch_pin(_pin(), _cfg(tmp_path, hub))
    gets_before = sum(1 for s in hub.requests if s.method == "GET" and "/resolve/" in s.path)
    result = fetch_pin(_pin(), _cfg(tmp_path, hub))
    gets_after = sum(1 for s in hub.requests if s.method == "GET" and "/resolve/" in s.path)
    assert result.downloaded == [] and sorted(result.kept) == sorted(WANTED)
    assert gets_after == gets_before


def test_dropped_connection_resumes_with_range(tmp_path, hub, files):
    # The first response for BIG stops after 11 MiB; the client has written its first
    # 10 MiB read chunk and asks for the rest with a Range request.
    hub.truncate_once[BIG] = 11 * 1024 * 1024
    fetch_pin(_pin(), _cfg(tmp_path, hub))
    ranges = hub.range_requests(BIG)
    assert ranges, "the client did not resume with a Range request"
    assert ranges[0] == f"bytes={10 * 1024 * 1024}-"
    assert (tmp_path / "models" / "tiny" / BIG).read_bytes() == files[BIG]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill", "ctrl-c"])
def test_interrupted_fetch_resumes_from_partial_file(tmp_path, hub, files, sig):
    lock = _write_lock(tmp_path)
    hub.stall_once[BIG] = 11 * 1024 * 1024
    env = _cli_env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sm70ctl", "weights", "fetch", "--lock", str(lock),
         "--endpoint", hub.url],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    part = partial_path(tmp_path / "models" / "tiny", BIG)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if part.exists() and part.stat().st_size >= 10 * 1024 * 1024:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        else:
            pytest.fail("the partial file never reached 10 MiB")
    finally:
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    if sig == signal.SIGINT:  # Ctrl-C: the conventional 130, no traceback
        assert proc.returncode == 130, err
        assert "Traceback" not in err
    have = part.stat().st_size
    assert 0 < have < len(files[BIG])

    # Offline, the interruption is visible: BIG is incomplete, the manifest unfinished.
    offline = _cli(["weights", "fetch", "--offline", "--lock", str(lock), "--json"], env)
    assert offline.returncode == 1
    issues = {i["path"]: i["kind"] for i in json.loads(offline.stdout)[0]["issues"]}
    assert issues[BIG] == "incomplete"

    hub.release.set()
    result = fetch_pin(_pin(), _cfg(tmp_path, hub))
    assert BIG in result.resumed
    assert f"bytes={have}-" in hub.range_requests(BIG)
    assert (tmp_path / "models" / "tiny" / BIG).read_bytes() == files[BIG]
    assert not part.exists()


def test_corrupt_partial_is_caught_and_discarded(tmp_path, hub, files):
    # A partial file whose bytes differ from the hub's: the resumed file's sha256 does
    # not match the LFS sha256, which is an error naming the file.
    part = partial_path(tmp_path / "models" / "tiny", SMALL)
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 4096)
    with pytest.raises(Sm70Error) as err:
        fetch_pin(_pin(), _cfg(tmp_path, hub))
    assert SMALL in err.value.message and "sha256" in err.value.message
    assert not part.exists()
    assert not (tmp_path / "models" / "tiny" / SMALL).exists()
    # the next run starts that file afresh and succeeds
    fetch_pin(_pin(), _cfg(tmp_path, hub))
    assert (tmp_path / "models" / "tiny" / SMALL).read_bytes() == files[SMALL]


def test_wrong_revision_is_a_clear_error(tmp_path, hub):
    wrong = "0123456789abcdef0123456789abcdef01234567"
    lock = _write_lock(tmp_path, revision=wrong)
    res = _cli(["weights", "fetch", "--lock", str(lock), "--endpoint", hub.url],
               _cli_env(tmp_path))
    assert res.returncode == 1
    assert f"revision {wrong} of {REPO} was not found" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "models" / "tiny").exists()


def test_unknown_repository_is_a_clear_error(tmp_path, hub):
    pin = parse_model_pins(tomllib.loads(lock_text("x", "nobody/nothing", COMMIT)), "t")[0]
    with pytest.raises(Sm70Error, match="repository nobody/nothing is not available"):
        fetch_pin(pin, _cfg(tmp_path, hub))


def test_placeholder_pin_is_refused_before_any_request(tmp_path, hub):
    lock = _write_lock(tmp_path, revision="", unverified="hub unreachable when pinned")
    res = _cli(["weights", "fetch", "--lock", str(lock), "--endpoint", hub.url],
               _cli_env(tmp_path))
    assert res.returncode == 1
    assert "no verified revision" in res.stderr
    assert "hub unreachable when pinned" in res.stderr
    assert hub.requests == []


def test_unreachable_hub_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.utils._http as hf_http

    server = HubServer().start()
    url = server.url
    server.stop()  # nothing listens there any more
    # The client retries a refused connection with back-off (about 23 s); skip the waits.
    monkeypatch.setattr(hf_http.time, "sleep", lambda _s: None)
    cfg = FetchConfig(weights_dir=tmp_path / "models", endpoint=url, progress=False)
    with pytest.raises(Sm70Error) as err:
        fetch_pin(_pin(), cfg)
    assert err.value.message.startswith(f"cannot reach the hub at {url}")
    assert "--offline" in (err.value.hint or "")


def test_disk_space_check_names_both_numbers(tmp_path, hub, files):
    need = sum(len(files[n]) for n in WANTED)
    with pytest.raises(Sm70Error) as err:
        fetch_pin(_pin(), _cfg(tmp_path, hub), free_bytes=lambda _p: 1000)
    assert f"need {need} bytes" in err.value.message
    assert "1000 bytes" in err.value.message
    assert not any("/resolve/" in s.path for s in hub.requests)  # nothing downloaded


def test_disk_space_check_counts_only_missing_bytes(tmp_path, hub, files):
    fetch_pin(_pin(), _cfg(tmp_path, hub))
    (tmp_path / "models" / "tiny" / SMALL).unlink()
    # Only SMALL is missing now: free space just above its size is enough.
    result = fetch_pin(_pin(), _cfg(tmp_path, hub), free_bytes=lambda _p: len(files[SMALL]) + 1)
    assert result.downloaded == [SMALL]


def test_full_disk_on_a_small_tmpfs(tmp_path, small_tmpfs, hub, files):
    env = _cli_env(tmp_path, SM70_WEIGHTS_DIR=str(small_tmpfs / "models"))
    res = _cli(["weights", "fetch", "--lock", str(_write_lock(tmp_path)), "--endpoint", hub.url],
               env)
    assert res.returncode == 1, res.stderr
    said = " ".join(res.stderr.split())
    need = sum(len(files[n]) for n in WANTED)
    assert "not enough disk space" in said and f"need {need} bytes" in said
    st = os.statvfs(small_tmpfs)
    assert f"{st.f_bavail * st.f_frsize} bytes" in said


def test_token_is_sent_but_never_printed(tmp_path, files):
    server = HubServer()
    server.add_repo(Repo(REPO, {COMMIT: files}, token=TOKEN))
    lock = _write_lock(tmp_path)
    with server:
        env = _cli_env(tmp_path, SM70_HF_TOKEN=TOKEN, HF_DEBUG="1", HF_HUB_VERBOSITY="debug")
        ok = _cli(["weights", "fetch", "--lock", str(lock), "--endpoint", server.url], env)
        as_json = _cli(["weights", "fetch", "--lock", str(lock), "--endpoint", server.url,
                        "--json"], env)
        wrong = _cli(["weights", "fetch", "--lock", str(lock), "--endpoint", server.url],
                     {**env, "SM70_HF_TOKEN": TOKEN[::-1], "SM70_WEIGHTS_DIR":
                      str(tmp_path / "other")})
    assert ok.returncode == 0, ok.stderr
    assert as_json.returncode == 0, as_json.stderr
    assert wrong.returncode == 1
    assert "not available" in wrong.stderr
    # the token was really used...
    assert any(s.headers.get("authorization") == f"Bearer {TOKEN}" for s in server.requests)
    # ...and appears in no output, no log line, and no file written
    for res in (ok, as_json, wrong):
        for stream in (res.stdout, res.stderr):
            assert TOKEN not in stream and TOKEN[::-1] not in stream
    assert ok.stderr.strip(), "expected progress output on stderr"
    for root in (tmp_path / "models", tmp_path / "other", tmp_path / "hf-home"):
        for path in root.rglob("*") if root.exists() else []:
            if path.is_file():
                data = path.read_bytes()
                assert TOKEN.encode() not in data and TOKEN[::-1].encode() not in data, path


def test_cli_fetch_then_verify_json(tmp_path, hub):
    lock = _write_lock(tmp_path)
    env = _cli_env(tmp_path)
    res = _cli(["weights", "fetch", "--lock", str(lock), "--endpoint", hub.url, "--json"], env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data[0]["revision"] == COMMIT and data[0]["ok"] is True
    assert sorted(data[0]["downloaded"]) == sorted(WANTED)
    ver = _cli(["weights", "verify", "--lock", str(lock), "--json"], env)
    assert ver.returncode == 0, ver.stderr
    assert json.loads(ver.stdout)[0]["ok"] is True


def test_server_ignoring_range_restarts_the_file_cleanly(tmp_path, hub, files):
    part = partial_path(tmp_path / "models" / "tiny", SMALL)
    part.parent.mkdir(parents=True)
    part.write_bytes(files[SMALL][:5000])  # a good partial...
    hub.ignore_range = True  # ...but the server answers 200 with the whole file
    result = fetch_pin(_pin(), _cfg(tmp_path, hub))
    assert SMALL in result.resumed and hub.range_requests(SMALL) == ["bytes=5000-"]
    assert (tmp_path / "models" / "tiny" / SMALL).read_bytes() == files[SMALL]


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the pre-flight check is "
                    "covered by test_disk_space_check_names_both_numbers")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_filling_up_mid_download_keeps_the_partial(small_tmpfs, hub, files):
    # Another writer took the space after the pre-flight check (simulated by a probe that
    # over-reports): the write fails with ENOSPC, which becomes a clear error, and the
    # bytes written so far stay in the partial file for the next run.
    cfg = FetchConfig(weights_dir=small_tmpfs / "models", endpoint=hub.url, progress=False)
    with pytest.raises(Sm70Error) as err:
        fetch_pin(_pin(), cfg, free_bytes=lambda _p: 10**12)
    assert err.value.message.startswith("disk full while writing")
    assert "resumes" in (err.value.hint or "")


def test_a_second_fetch_into_the_same_folder_is_refused(tmp_path, hub):
    import fcntl

    state = tmp_path / "models" / "tiny" / ".sm70"
    state.mkdir(parents=True)
    fd = os.open(state / "fetch.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running fetch holds it
        with pytest.raises(Sm70Error, match="another `sm70ctl weights fetch` is writing"):
            fetch_pin(_pin(), _cfg(tmp_path, hub))
    finally:
        os.close(fd)
    fetch_pin(_pin(), _cfg(tmp_path, hub))  # released: it goes through


def test_hub_server_speaks_the_clients_high_level_api(tmp_path, hub, files):
    # The server is a faithful enough hub for huggingface_hub's own entry points too:
    # a branch resolved through /revision/, snapshot_download, get_paths_info.
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi(endpoint=hub.url, token=False)
    assert api.model_info(REPO, revision="main").sha == COMMIT
    (info,) = api.get_paths_info(REPO, [BIG], revision=COMMIT)
    assert info.lfs.sha256 == hashlib.sha256(files[BIG]).hexdigest()
    out = snapshot_download(REPO, revision="main", local_dir=tmp_path / "snap",
                            endpoint=hub.url, token=False, allow_patterns=["*.json"])
    assert (Path(out) / "config.json").read_bytes() == files["config.json"]


@pytest.mark.parametrize("bad", ["../escape.json", ".sm70/manifest.json"])
def test_unsafe_paths_from_the_hub_are_refused(tmp_path, files, bad):
    server = HubServer()
    server.add_repo(Repo(REPO, {COMMIT: {**files, bad: b"{}"}}))
    with server, pytest.raises(Sm70Error, match="unsafe path"):
        fetch_pin(_pin(), _cfg(tmp_path, server))
    assert not (tmp_path / "models" / "escape.json").exists()


def test_fetch_rebuilds_a_damaged_manifest(tmp_path, hub, files):
    # verify's hint for an unreadable manifest is "run fetch again": fetch must then work,
    # re-hashing what is on disk against the hub instead of trusting it.
    fetch_pin(_pin(), _cfg(tmp_path, hub))
    folder = tmp_path / "models" / "tiny"
    (folder / ".sm70" / "manifest.json").write_text('{"files": []}')
    with open(folder / SMALL, "r+b") as f:  # damaged, same size: must be fetched again
        f.seek(3)
        f.write(b"\xff")
    notes: list[str] = []
    result = fetch_pin(_pin(), _cfg(tmp_path, hub), report=notes.append)
    assert any("weights manifest" in n and "files: expected a table" in n and "rebuilding" in n
               for n in notes)
    assert result.downloaded == [SMALL]
    assert (folder / SMALL).read_bytes() == files[SMALL]
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.complete


def test_hub_mismatch_refuses_what_it_cannot_check():
    from sm70ctl.weights.fetch import RemoteFile, hub_mismatch

    data = b"tokenizer bytes"
    sha = hashlib.sha256(data).hexdigest()
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert hub_mismatch(RemoteFile("a", len(data), lfs_sha256=sha.upper()), sha, None) is None
    assert "LFS sha256" in hub_mismatch(RemoteFile("a", 1, lfs_sha256="0" * 64), sha, None)
    assert hub_mismatch(RemoteFile("a", len(data), git_oid=oid), sha, oid) is None
    assert "git blob id" in hub_mismatch(RemoteFile("a", 1, git_oid="1" * 40), sha, oid)
    assert "not measured" in hub_mismatch(RemoteFile("a", 1, git_oid=oid), sha, None)
    # a listing without any hash (a broken mirror) cannot vouch for the bytes
    assert "neither" in hub_mismatch(RemoteFile("a", len(data)), sha, None)


def test_unusable_weights_dir_fails_before_any_request(tmp_path, hub):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = FetchConfig(weights_dir=blocker / "models", endpoint=hub.url, progress=False)
    with pytest.raises(Sm70Error, match=r"SM70_WEIGHTS_DIR=.*a-file/models.*not a folder"):
        fetch_pin(_pin(), cfg)
    assert hub.requests == []
