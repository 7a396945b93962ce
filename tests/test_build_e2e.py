"""`sm70ctl build` and `sm70ctl mirror` end to end, against local git repositories and
files standing in for upstream. Each build runs the real CLI in a subprocess."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from build_fixtures import (
    CONFLICT_PATCH,
    GOOD_PATCH,
    REPO_ROOT,
    Upstream,
    git,
    make_upstream,
    netns_available,
    sm70ctl,
    write_lock,
)
from lock_holder import held_lock

from sm70ctl.build.sources import FetchError, git_checkout

# The real network namespace when `unshare -rn` works here; SM70_TEST_NO_NETNS=1 forces
# the fallback guard (to test that path too).
NETNS = netns_available() and os.environ.get("SM70_TEST_NO_NETNS") != "1"


def _loopback_ok() -> bool:
    import socket

    try:
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            socket.create_connection(srv.getsockname(), timeout=2).close()
        return True
    except OSError:
        return False


needs_loopback = pytest.mark.skipif(not _loopback_ok(), reason="127.0.0.1 is not usable here")


def _build(up: Upstream, *extra: str, env: dict[str, str] | None = None, netns: bool = False):
    return sm70ctl(["build", "--lock", str(up.lock), "--patches", str(up.series),
                    "--stop-after", "patch", *extra], env or up.env(), netns=netns)


def _offline_env(up: Upstream) -> dict[str, str]:
    """Belt and braces for the offline runs: no proxy, git may only use local paths, and
    when no network namespace is available a sitecustomize makes connect() raise."""
    env = up.env(GIT_ALLOW_PROTOCOL="file", http_proxy="", https_proxy="")
    if not NETNS:
        site = up.root / "nonet"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            "import socket\n"
            "def _deny(*a, **k):\n"
            "    raise OSError('network access attempted in an offline build')\n"
            "socket.socket.connect = _deny\n"
            "socket.create_connection = _deny\n"
        )
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO_ROOT)])
    return env


@pytest.fixture
def up(tmp_path: Path) -> Upstream:
    return make_upstream(tmp_path)


def test_git_checkout_at_pinned_commit_not_branch_head(up: Upstream, tmp_path: Path) -> None:
    dest = tmp_path / "co"
    head = git_checkout(up.repo.as_uri(), up.commit, "v2.0", dest, offline=False)
    assert head == up.commit != up.head
    assert (dest / "README").read_text() == "kernels-lib v2\n"


def test_git_checkout_refuses_moved_tag_and_absent_commit(up: Upstream, tmp_path: Path) -> None:
    git("tag", "-f", "v2.0", up.head, cwd=up.repo)  # someone moved the tag upstream
    with pytest.raises(FetchError, match=r"tag v2.0 .* points at .* the lock pins"):
        git_checkout(up.repo.as_uri(), up.commit, "v2.0", tmp_path / "a", offline=False)
    with pytest.raises(FetchError, match="has no commit"):
        git_checkout(up.repo.as_uri(), "0" * 40, "", tmp_path / "b", offline=False)


def test_build_fetches_verifies_patches_then_noop(up: Upstream) -> None:
    first = _build(up)
    assert first.returncode == 0, first.stderr
    steps = up.root / "build" / "steps"
    (src,) = [p for p in (steps / "patch-vllm").iterdir() if p.is_dir()]
    cmake = (src / "src" / "CMakeLists.txt").read_text()
    assert 'set(CUDA_SUPPORTED_ARCHS "7.0;7.5;8.0;9.0;10.0")' in cmake
    assert "VOLTA = True" in (src / "src" / "pkg" / "__init__.py").read_text()
    (co,) = [p for p in (steps / "git-kernels-lib").iterdir() if p.is_dir()]
    assert (co / "HEAD").read_text().strip() == up.commit
    assert "built 4 step(s)" in first.stdout
    logs = list((up.root / "build" / "logs").glob("build-*.log"))
    assert logs and "applied 0001-test-1.patch" in logs[0].read_text()

    # A second build does nothing: every step cached, no step re-stamped, no new log (a
    # build that runs a step writes one).
    stamps = {p: p.read_bytes() for p in steps.glob("*/*.json")}
    assert len(stamps) == 4
    second = _build(up, "--json")
    assert second.returncode == 0, second.stderr
    data = json.loads(second.stdout)
    assert data["changed"] is False and data["log"] is None
    assert {s["status"] for s in data["steps"]} == {"cached"}
    assert {p: p.read_bytes() for p in steps.glob("*/*.json")} == stamps
    assert list((up.root / "build" / "logs").glob("build-*.log")) == logs
    third = _build(up)
    assert "nothing changed" in third.stdout


def test_changed_patch_rebuilds_only_dependents(up: Upstream) -> None:
    assert _build(up).returncode == 0
    p = up.series / "0002-test-2.patch"
    p.write_text(p.read_text().replace("VOLTA = True", "VOLTA = 70"))
    plan = json.loads(_build(up, "--dry-run", "--json").stdout)
    status = {s["step"]: (s["status"], s["why"]) for s in plan["steps"]}
    assert status["patch-vllm"][0] == "stale" and "patches" in status["patch-vllm"][1]
    assert status["git-kernels-lib"][0] == "cached"
    assert status["archive-vllm"][0] == "cached"
    res = json.loads(_build(up, "--json").stdout)
    built = {s["step"] for s in res["steps"] if s["status"] == "built"}
    assert built == {"patch-vllm"}


def test_dry_run_lists_every_pinned_input_and_builds_nothing(up: Upstream) -> None:
    res = _build(up, "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    ids = {(i["kind"], i["name"]): i["id"] for i in data["inputs"]}
    assert up.commit in ids[("git", "kernels-lib")]
    assert up.archive_sha in ids[("archive", "vllm")]
    assert up.wheel_sha in ids[("wheel", "tiny==1.0")]
    assert {s["status"] for s in data["steps"]} == {"missing"}
    assert not (up.root / "build" / "steps").exists()
    human = _build(up, "--dry-run")
    assert "kernels-lib" in human.stdout and "never built" in human.stdout


def test_conflicting_patch_names_patch_and_hunk(tmp_path: Path) -> None:
    up = make_upstream(tmp_path, patches=(GOOD_PATCH, CONFLICT_PATCH))
    res = _build(up)
    assert res.returncode == 1
    err = " ".join(res.stderr.split())
    assert "patch 0002-test-2.patch does not apply" in err
    assert "hunk #1 of CMakeLists.txt (@@ -1,3 +1,3 @@)" in err
    assert "applied before it: 0001-test-1.patch" in err
    assert "Traceback" not in res.stderr
    # Nothing half-patched was committed.
    assert not list((up.root / "build" / "steps" / "patch-vllm").glob("*.json"))


def test_mirror_create_verify_and_offline_build(up: Upstream, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    res = sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock), "--json"], up.env())
    assert res.returncode == 0, res.stderr
    assert {i["status"] for i in json.loads(res.stdout)["items"]} == {"ok"}
    assert (mirror / "git" / "kernels-lib.git").is_dir()
    ok = sm70ctl(["mirror", "verify", str(mirror), "--lock", str(up.lock)], up.env())
    assert ok.returncode == 0, ok.stderr

    # Upstream disappears; the offline build must not need it, nor the network. It runs
    # through the env stage: the wheelhouse is installed into a serving venv with pip.
    os.rename(up.root / "upstream", up.root / "gone")
    import venv

    venv.EnvBuilder(with_pip=True).create(up.root / "serve")
    env = _offline_env(up)
    res = _build(up, "--offline", "--mirror", str(mirror), "--stop-after", "env", env=env,
                 netns=NETNS)
    assert res.returncode == 0, res.stderr
    (co,) = [p for p in (up.root / "build/steps/git-kernels-lib").iterdir() if p.is_dir()]
    assert (co / "HEAD").read_text().strip() == up.commit
    probe = subprocess.run([str(up.root / "serve/bin/python"), "-c", "import tiny"])
    assert probe.returncode == 0
    # SM70_MIRROR_DIR works the same as --mirror; a second offline run changes nothing.
    env["SM70_MIRROR_DIR"] = str(mirror)
    again = _build(up, "--offline", "--stop-after", "env", env=env, netns=NETNS)
    assert again.returncode == 0, again.stderr
    assert "nothing changed" in again.stdout


@needs_loopback
def test_offline_guard_really_cuts_the_network(up: Upstream) -> None:
    """The isolation the offline tests rely on is real: a download from a server that
    works without the guard fails under it (network namespace, or the fallback)."""
    handler = type("H", (_SlowHandler,), {"payload": up.archive.read_bytes(),
                                          "stall": threading.Event(),
                                          "started": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/vllm-like-1.0.tar.gz"
        up.lock.write_text(up.lock.read_text().replace(up.archive.as_uri(), url))
        inside = _build(up, env=_offline_env(up), netns=NETNS)
        assert inside.returncode == 1
        assert "cannot download" in inside.stderr
        outside = _build(up)
        assert outside.returncode == 0, outside.stderr
    finally:
        server.shutdown()


def test_offline_lists_every_missing_mirror_item(up: Upstream, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    assert sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock)],
                   up.env()).returncode == 0
    (mirror / "archives" / "vllm-like-1.0.tar.gz").unlink()
    (mirror / "wheels" / "tiny-1.0-py3-none-any.whl").unlink()
    res = _build(up, "--offline", "--mirror", str(mirror), env=_offline_env(up), netns=NETNS)
    assert res.returncode == 1
    err = " ".join(res.stderr.split())
    assert "lacks 2 pinned item(s)" in err
    assert "archive vllm" in err and "wheel tiny-1.0-py3-none-any.whl" in err
    assert not (up.root / "build" / "steps").exists()  # failed up front, before any step
    bad = sm70ctl(["mirror", "verify", str(mirror), "--lock", str(up.lock), "--json"], up.env())
    assert bad.returncode == 1
    statuses = {i["name"]: i["status"] for i in json.loads(bad.stdout)["items"]}
    assert statuses == {"kernels-lib": "ok", "vllm": "missing",
                        "tiny-1.0-py3-none-any.whl": "missing"}


def test_offline_missing_git_commit_is_listed(up: Upstream, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    assert sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock)],
                   up.env()).returncode == 0
    text = up.lock.read_text().replace(up.commit, "1" * 40)
    up.lock.write_text(text)
    res = _build(up, "--offline", "--mirror", str(mirror), env=_offline_env(up), netns=NETNS)
    assert res.returncode == 1
    err = " ".join(res.stderr.split())
    assert "lacks 1 pinned item(s)" in err
    assert f"git kernels-lib (git/kernels-lib.git: {'1' * 40} absent)" in err
    assert not (up.root / "build" / "steps").exists()  # refused up front


def test_corrupted_archive_is_refused(up: Upstream, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    assert sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock)],
                   up.env()).returncode == 0
    arch = mirror / "archives" / "vllm-like-1.0.tar.gz"
    arch.write_bytes(arch.read_bytes()[:-7] + b"garbage")
    verify = sm70ctl(["mirror", "verify", str(mirror), "--lock", str(up.lock), "--json"],
                     up.env())
    assert verify.returncode == 1
    items = {i["name"]: i for i in json.loads(verify.stdout)["items"]}
    assert items["vllm"]["status"] == "mismatch"
    res = _build(up, "--offline", "--mirror", str(mirror), env=_offline_env(up), netns=NETNS)
    assert res.returncode == 1
    err = " ".join(res.stderr.split())
    assert f"sha256 mismatch for vllm-like-1.0.tar.gz: expected {up.archive_sha}" in err
    assert not list((up.root / "build/steps/archive-vllm").glob("*.json"))


class _SlowHandler(http.server.BaseHTTPRequestHandler):
    """Serves the archive; while `stall` is set it sends half and then hangs."""

    payload = b""
    stall = threading.Event()
    started = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        half = len(self.payload) // 2
        self.wfile.write(self.payload[:half])
        self.wfile.flush()
        type(self).started.set()
        while type(self).stall.is_set():
            time.sleep(0.05)
        self.wfile.write(self.payload[half:])

    def log_message(self, *args) -> None:
        pass


@needs_loopback
def test_interrupted_build_resumes_without_redoing_finished_steps(up: Upstream) -> None:
    _SlowHandler.payload = up.archive.read_bytes()
    _SlowHandler.stall.set()
    _SlowHandler.started.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/vllm-like-1.0.tar.gz"
        write_lock(up.lock, repo_url=up.repo.as_uri(), commit=up.commit, archive_url=url,
                   archive_sha=up.archive_sha, wheel_url=up.wheel.as_uri(),
                   wheel_sha=up.wheel_sha)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sm70ctl", "build", "--lock", str(up.lock), "--patches",
             str(up.series), "--stop-after", "patch"],
            env=up.env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while not _SlowHandler.started.wait(0.1):
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the build never reached the archive download"
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)  # no clean-up handlers run: a real crash
        proc.wait(30)
        steps = up.root / "build" / "steps"
        assert list((steps / "git-kernels-lib").glob("*.json"))  # finished before the kill
        assert not list((steps / "archive-vllm").glob("*.json"))  # killed mid-step
        git_stamp = next((steps / "git-kernels-lib").glob("*.json")).read_text()

        plan = json.loads(_build(up, "--dry-run", "--json").stdout)
        status = {s["step"]: s["status"] for s in plan["steps"]}
        assert status["git-kernels-lib"] == "cached"
        assert status["archive-vllm"] in ("interrupted", "missing")

        _SlowHandler.stall.clear()
        res = _build(up, "--json")
        assert res.returncode == 0, res.stderr
        ran = {s["step"]: s["status"] for s in json.loads(res.stdout)["steps"]}
        assert ran == {"git-kernels-lib": "cached", "archive-vllm": "built",
                       "wheelhouse": ran["wheelhouse"], "patch-vllm": "built"}
        assert next((steps / "git-kernels-lib").glob("*.json")).read_text() == git_stamp
        assert not list((steps / "archive-vllm").glob(".tmp-*"))
    finally:
        _SlowHandler.stall.clear()
        server.shutdown()


def test_env_stage_installs_the_wheelhouse_into_the_serving_python(up: Upstream) -> None:
    import venv

    venv.EnvBuilder(with_pip=True).create(up.root / "serve")
    py = up.root / "serve" / "bin" / "python"
    args = ["build", "--lock", str(up.lock), "--patches", str(up.series), "--stop-after", "env"]
    res = sm70ctl([*args, "--json"], up.env())
    assert res.returncode == 0, res.stderr
    steps = {s["step"]: s["status"] for s in json.loads(res.stdout)["steps"]}
    assert steps["serve-env"] == "built"
    out = subprocess.run([str(py), "-c", "import tiny; print(tiny.VALUE)"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "70"
    assert "nothing changed" in sm70ctl(args, up.env()).stdout
    # A serving interpreter of another Python version is refused by name.
    text = up.lock.read_text()
    up.lock.write_text(text.replace(f'python = "{sys.version_info.major}.'
                                    f'{sys.version_info.minor}"', 'python = "3.99"'))
    wrong = sm70ctl(args, up.env())
    assert wrong.returncode == 1
    assert "the lock's wheels are for Python 3.99" in " ".join(wrong.stderr.split())
    up.lock.write_text(text)
    # The serving environment was deleted: the cached install no longer holds.
    import shutil

    shutil.rmtree(up.root / "serve")
    plan = json.loads(sm70ctl([*args, "--dry-run", "--json"], up.env()).stdout)
    assert {s["step"]: s["status"] for s in plan["steps"]}["serve-env"] == "invalid"
    gone = sm70ctl(args, up.env())
    assert gone.returncode == 1
    assert "serving interpreter" in gone.stderr and "does not exist" in gone.stderr


def test_compile_refuses_unsuitable_toolchain_plainly(up: Upstream, tmp_path: Path) -> None:
    fake_home = tmp_path / "cuda-none"
    fake_home.mkdir()
    res = sm70ctl(["build", "--lock", str(up.lock), "--patches", str(up.series)],
                  up.env(SM70_CUDA_HOME=str(fake_home)))
    assert res.returncode == 1
    err = " ".join(res.stderr.split())
    assert f"no nvcc found in SM70_CUDA_HOME={fake_home}" in err
    assert "--stop-after patch" in err
    assert not (up.root / "build" / "steps").exists()  # refused before fetching anything


def test_compile_refuses_cuda13_nvcc(up: Upstream) -> None:
    import shutil

    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("no nvcc on this machine")
    rel = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    if "release 13" not in rel:
        pytest.skip("this machine's nvcc is not CUDA 13")
    home = str(Path(nvcc).resolve().parent.parent)
    res = sm70ctl(["build", "--lock", str(up.lock), "--patches", str(up.series)],
                  up.env(SM70_CUDA_HOME=home))
    assert res.returncode == 1
    assert "cannot emit sm_70" in " ".join(res.stderr.split())


def test_mirror_copy_is_verified_after_copying(tmp_path: Path, monkeypatch) -> None:
    # What is used is what was hashed: a mirror file that changes between a check and the
    # copy (a mirror being refreshed, a flaky network mount) must not land in place.
    import hashlib
    import shutil

    from sm70ctl.build import sources

    src = tmp_path / "mirror" / "a.tar.gz"
    src.parent.mkdir()
    src.write_bytes(b"pinned bytes")
    sha = hashlib.sha256(b"pinned bytes").hexdigest()
    real_copy = shutil.copyfile

    def changed_during_copy(a, b):
        real_copy(a, b)
        Path(b).write_bytes(b"other bytes!")
        return b

    monkeypatch.setattr(sources.shutil, "copyfile", changed_during_copy)
    dest = tmp_path / "work" / "a.tar.gz"
    with pytest.raises(FetchError, match="sha256 mismatch"):
        sources.copy_verified(src, dest, sha, "archive a")
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    monkeypatch.setattr(sources.shutil, "copyfile", real_copy)
    assert sources.copy_verified(src, dest, sha, "archive a").read_bytes() == b"pinned bytes"
    assert [p.name for p in dest.parent.iterdir()] == ["a.tar.gz"]  # no temporary left
    with pytest.raises(FetchError, match="cannot read"):  # a folder where a file should be
        sources.copy_verified(tmp_path / "mirror", dest, "", "archive a")


def test_second_concurrent_build_is_refused_and_leaves_work_in_progress(up: Upstream) -> None:
    # A running build's `.tmp-*` folder looks like an interrupted run's leftover to a
    # second build, which would delete it under the first one's feet.
    build_dir = up.root / "build"
    wip = build_dir / "steps" / "archive-vllm" / ".tmp-0123456789abcdef-99999"
    wip.mkdir(parents=True)
    with held_lock(build_dir / ".build.lock", "sm70ctl build") as holder:
        res = _build(up)
        assert res.returncode == 1
        assert f"pid {holder.pid}" in res.stderr and "sm70ctl build" in res.stderr
        assert "Traceback" not in res.stderr
        assert wip.is_dir()
        assert not list((build_dir / "steps").glob("*/*.json"))  # nothing was built
    res = _build(up)  # the lock died with its holder
    assert res.returncode == 0, res.stderr
    assert not wip.exists()  # now truly a leftover, and cleaned up


def test_second_concurrent_mirror_create_is_refused(up: Upstream, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    with held_lock(mirror / ".mirror.lock", "sm70ctl mirror create") as holder:
        res = sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock)], up.env())
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert f"pid {holder.pid}" in res.stderr
        assert not (mirror / "git").exists()
    res = sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock)], up.env())
    assert res.returncode == 0, res.stderr
