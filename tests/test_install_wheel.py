"""A non-editable install works: the wheel built from this tree, installed into a fresh venv,
finds the kernel sources it ships (vllm_patch/_csrc/) and `sm70ctl build --dry-run` reports
the checkout's csrc/ hash; with the sources gone, `--relock` refuses instead of locking the
hash of nothing.

Offline: the wheel is built without build isolation (the test extra brings setuptools and
wheel), installed with --no-deps, and the fresh venv reaches the running environment's
packages for its dependencies through a .pth line (a plain path: that environment's own .pth
files, among them an editable install of this checkout, are not run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from sm70ctl.build.lock import packaged_lock_path
from vllm_patch.ops.sources import source_hash

ROOT = Path(__file__).resolve().parent.parent
# what `pip install .` reads from the checkout
PROJECT_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")
PROJECT_DIRS = ("sm70ctl", "vllm_patch", "csrc")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [m for m in ("setuptools", "wheel") if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"needs {', '.join(missing)} to build the wheel offline (pip install -e .[test])"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: the build writes build/ and *.egg-info beside its sources
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "_lib")
    src.mkdir()
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, src / name)
    for name in PROJECT_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=ignore, symlinks=True)
    dist = tmp / "dist"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-q", "-w", str(dist), str(src)])
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("sm70ctl-*.whl")

    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    inst = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                 "--no-index", "-q", str(wheel)])
    assert inst.returncode == 0, inst.stderr[-3000:]
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                         "['purelib'])"]).stdout.strip())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "zz_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    return {"tmp": tmp, "py": py, "bin": venv / "bin", "purelib": purelib, "wheel": wheel}


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM70_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(HOME=str(tmp / "home"), SM70_BUILD_DIR=str(tmp / "build"), COLUMNS="200")
    return env


def test_the_wheel_ships_csrc_as_vllm_patch_csrc(installed: dict[str, Path]) -> None:
    import zipfile

    names = zipfile.ZipFile(installed["wheel"]).namelist()
    shipped = sorted(n[len("vllm_patch/_csrc/"):] for n in names
                     if n.startswith("vllm_patch/_csrc/"))
    tree = sorted(p.relative_to(ROOT / "csrc").as_posix() for p in (ROOT / "csrc").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)
    assert shipped == tree and tree
    assert not any(n.startswith("csrc/") for n in names)  # not a stray top-level folder


def test_the_wheel_has_every_module_and_data_file(installed: dict[str, Path]) -> None:
    # a package folder without __init__.py is skipped by setuptools' find: its modules
    # would be missing from a wheel install only
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    tree = {p.relative_to(ROOT).as_posix() for pkg in ("sm70ctl", "vllm_patch")
            for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    assert tree and not tree - names, sorted(tree - names)
    data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "sm70ctl" / "data").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    data |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "vllm_patch" / "patches").iterdir()
             if p.suffix in (".patch", ".md")}
    assert not data - names, sorted(data - names)


def test_installed_package_is_the_wheel_not_the_checkout(installed: dict[str, Path]) -> None:
    out = _run([str(installed["py"]), "-c",
                "import sm70ctl, vllm_patch.ops.sources as s; "
                "print(sm70ctl.__file__); print(s.csrc_dir())"],
               cwd=installed["tmp"], env=_env(installed["tmp"]))
    assert out.returncode == 0, out.stderr
    pkg, csrc = out.stdout.split()
    assert Path(pkg).is_relative_to(installed["purelib"])
    assert Path(csrc) == installed["purelib"] / "vllm_patch" / "_csrc"


def test_the_readmes_first_commands_run_from_the_wheel(installed: dict[str, Path]) -> None:
    # `pip install . && sm70ctl doctor; sm70ctl plan`: the plan needs the packaged model
    # description and the env schema, both package data
    tmp = installed["tmp"]
    res = _run([str(installed["bin"] / "sm70ctl"), "plan", "--json", "--gpus", "2xv100"],
               cwd=tmp, env=_env(tmp))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["fits"] is True and data["model"]["source"].startswith("built-in")
    assert Path(data["model"]["path"]).is_relative_to(installed["purelib"])


def test_dry_run_reports_the_checkouts_csrc_hash(installed: dict[str, Path]) -> None:
    tmp = installed["tmp"]
    checkout = source_hash(ROOT / "csrc")
    # the committed lock with its csrc hash set to the tree's (whether the committed hash
    # is current is test_build_lock's test_committed_lock_matches_the_tree)
    text = packaged_lock_path().read_text(encoding="utf-8")
    locked = next(line.split('"')[1] for line in text.splitlines()
                  if line.startswith("hash = "))
    lock = tmp / "sm70.lock.toml"
    lock.write_text(text.replace(f'hash = "{locked}"', f'hash = "{checkout}"'))
    res = _run([str(installed["bin"] / "sm70ctl"), "build", "--dry-run", "--json", "--lock",
                str(lock)], cwd=tmp, env=_env(tmp))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    (csrc,) = [d for d in data["local"] if d["name"] == "csrc"]
    assert Path(csrc["path"]) == installed["purelib"] / "vllm_patch" / "_csrc"
    assert csrc["now"] == checkout and not csrc["drift"]
    assert data["local_drift"] == []
    human = _run([str(installed["bin"] / "sm70ctl"), "build", "--dry-run", "--lock", str(lock)],
                 cwd=tmp, env=_env(tmp))
    assert f"content {checkout[:12]} (as locked)" in human.stdout
    assert "--relock" not in human.stdout


def test_relock_refuses_when_the_sources_are_gone(installed: dict[str, Path]) -> None:
    tmp = installed["tmp"]
    lock = tmp / "relock.toml"
    lock.write_text(packaged_lock_path().read_text(encoding="utf-8"))
    before = lock.read_text()
    shipped = installed["purelib"] / "vllm_patch" / "_csrc"
    aside = tmp / "csrc-aside"
    shipped.rename(aside)  # the install: a package without its kernel sources
    try:
        res = _run([str(installed["bin"] / "sm70ctl"), "build", "--relock", "--lock",
                    str(lock)], cwd=tmp, env=_env(tmp))
        assert res.returncode == 1
        err = " ".join(res.stderr.split())
        assert "no kernel sources" in err and "Traceback" not in res.stderr
        assert lock.read_text() == before
        dry = _run([str(installed["bin"] / "sm70ctl"), "build", "--dry-run", "--lock",
                    str(lock)], cwd=tmp, env=_env(tmp))
        assert dry.returncode == 1 and "no kernel sources" in dry.stderr
        assert "--relock" not in dry.stdout + dry.stderr
    finally:
        aside.rename(shipped)
