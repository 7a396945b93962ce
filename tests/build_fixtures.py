"""Local stand-ins for upstream, for the build tests: real git repositories (commits, a
tag), a source archive, a wheel file, a patch series, and a lock pointing at them."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

CMAKE_ORIG = """cmake_minimum_required(VERSION 3.26)
project(vllm_like)
if(CUDA_VERSION VERSION_GREATER_EQUAL 13.0)
  set(CUDA_SUPPORTED_ARCHS "7.5;8.0;9.0")
elseif(CUDA_VERSION VERSION_GREATER_EQUAL 12.8)
  set(CUDA_SUPPORTED_ARCHS "7.5;8.0;9.0;10.0")
else()
  set(CUDA_SUPPORTED_ARCHS "7.0;7.5;8.0;9.0")
endif()
"""

GOOD_PATCH = """From: test
Subject: keep 7.0 for CUDA 12.8

---
diff --git a/CMakeLists.txt b/CMakeLists.txt
--- a/CMakeLists.txt
+++ b/CMakeLists.txt
@@ -3,7 +3,7 @@ project(vllm_like)
 if(CUDA_VERSION VERSION_GREATER_EQUAL 13.0)
   set(CUDA_SUPPORTED_ARCHS "7.5;8.0;9.0")
 elseif(CUDA_VERSION VERSION_GREATER_EQUAL 12.8)
-  set(CUDA_SUPPORTED_ARCHS "7.5;8.0;9.0;10.0")
+  set(CUDA_SUPPORTED_ARCHS "7.0;7.5;8.0;9.0;10.0")
 else()
   set(CUDA_SUPPORTED_ARCHS "7.0;7.5;8.0;9.0")
 endif()
"""

SECOND_PATCH = """diff --git a/pkg/__init__.py b/pkg/__init__.py
--- a/pkg/__init__.py
+++ b/pkg/__init__.py
@@ -1,2 +1,3 @@
 VERSION = "1.0"
 KV_DTYPES = ("auto", "fp8")
+VOLTA = True
"""

# Its context names a line the source does not have: the second hunk cannot apply.
CONFLICT_PATCH = """diff --git a/pkg/__init__.py b/pkg/__init__.py
--- a/pkg/__init__.py
+++ b/pkg/__init__.py
@@ -1,2 +1,2 @@
 VERSION = "1.0"
-KV_DTYPES = ("auto", "fp8")
+KV_DTYPES = ("auto", "fp8", "int8")
diff --git a/CMakeLists.txt b/CMakeLists.txt
--- a/CMakeLists.txt
+++ b/CMakeLists.txt
@@ -1,3 +1,3 @@
 cmake_minimum_required(VERSION 3.26)
-project(not_what_upstream_has)
+project(sm70)
 if(CUDA_VERSION VERSION_GREATER_EQUAL 13.0)
"""


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def make_repo(path: Path, name: str) -> tuple[str, str]:
    """A repository with three commits and a tag on the second; returns (tagged, head)."""
    path.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=path)
    (path / "README").write_text(f"{name} v1\n")
    git("add", ".", cwd=path)
    git("commit", "-q", "-m", "one", cwd=path)
    (path / "README").write_text(f"{name} v2\n")
    git("commit", "-q", "-am", "two", cwd=path)
    tagged = git("rev-parse", "HEAD", cwd=path)
    git("tag", "v2.0", cwd=path)
    (path / "README").write_text(f"{name} v3 (after the pin)\n")
    git("commit", "-q", "-am", "three", cwd=path)
    return tagged, git("rev-parse", "HEAD", cwd=path)


def make_archive(path: Path, top: str) -> str:
    """A vllm-like sdist: TOP/CMakeLists.txt and TOP/pkg/__init__.py; returns its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files = {
        f"{top}/CMakeLists.txt": CMAKE_ORIG.encode(),
        f"{top}/pkg/__init__.py": b'VERSION = "1.0"\nKV_DTYPES = ("auto", "fp8")\n',
    }
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_wheel(path: Path) -> None:
    """A real, installable pure-Python wheel: `import tiny; tiny.VALUE == 70`."""
    import base64
    import zipfile

    files = {
        "tiny/__init__.py": b"VALUE = 70\n",
        "tiny-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
        "tiny-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
                                    b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tiny-1.0.dist-info/RECORD,,")
    files["tiny-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zf.writestr(info, data)


@dataclass
class Upstream:
    root: Path
    lock: Path
    series: Path
    repo: Path
    commit: str
    head: str
    archive: Path
    archive_sha: str
    wheel: Path
    wheel_sha: str

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
        env.update({"SM70_BUILD_DIR": str(self.root / "build"), "COLUMNS": "200",
                    "SM70_SERVE_PYTHON": str(self.root / "serve" / "bin" / "python")})
        env.update(extra)
        return env


def write_lock(path: Path, *, repo_url: str, commit: str, archive_url: str, archive_sha: str,
               wheel_url: str, wheel_sha: str, tag: str = "v2.0") -> None:
    path.write_text(f"""schema = 1
[toolchain]
cuda = "12.8"
gcc_min = "11.4"
gcc_max_major = 14
python = "{sys.version_info.major}.{sys.version_info.minor}"
cuda_arch_list = "7.0"

[[git]]
name = "kernels-lib"
url = "{repo_url}"
tag = "{tag}"
commit = "{commit}"

[[archive]]
name = "vllm"
url = "{archive_url}"
filename = "vllm-like-1.0.tar.gz"
sha256 = "{archive_sha}"
strip = "vllm-like-1.0"
patch = true

[[wheel]]
name = "tiny"
version = "1.0"
filename = "tiny-1.0-py3-none-any.whl"
url = "{wheel_url}"
sha256 = "{wheel_sha}"
""")


def make_upstream(root: Path, patches: tuple[str, ...] = (GOOD_PATCH, SECOND_PATCH)) -> Upstream:
    repo = root / "upstream" / "kernels-lib"
    commit, head = make_repo(repo, "kernels-lib")
    archive = root / "upstream" / "files" / "vllm-like-1.0.tar.gz"
    archive_sha = make_archive(archive, "vllm-like-1.0")
    wheel = root / "upstream" / "files" / "tiny-1.0-py3-none-any.whl"
    make_wheel(wheel)
    wheel_sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    series = root / "series"
    series.mkdir()
    for i, text in enumerate(patches, 1):
        (series / f"{i:04d}-test-{i}.patch").write_text(text)
    lock = root / "test.lock.toml"
    write_lock(lock, repo_url=repo.as_uri(), commit=commit, archive_url=archive.as_uri(),
               archive_sha=archive_sha, wheel_url=wheel.as_uri(), wheel_sha=wheel_sha)
    return Upstream(root, lock, series, repo, commit, head, archive, archive_sha, wheel,
                    wheel_sha)


def sm70ctl(args: list[str], env: dict[str, str], *, netns: bool = False,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sm70ctl", *args]
    if netns:
        cmd = ["unshare", "-rn", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)


def netns_available() -> bool:
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
