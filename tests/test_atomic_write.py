"""atomic_write_text leaves what a plain write leaves (mode, symlinks), only atomically.

`sm70ctl build --relock` once left the tracked lock at 0600 and would have turned the repo
root's sm70.lock.toml link into a file: the temporary file's mode and the rename's target
were mkstemp's and the link's, not the written file's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sm70ctl import fsutil
from sm70ctl.fsutil import atomic_write_text


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize(("mask", "want"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_what_open_gives_it(tmp_path: Path, umask: None, mask: int,
                                            want: int) -> None:
    os.umask(mask)
    atomic_write_text(tmp_path / "sub" / "new.txt", "x")
    assert _mode(tmp_path / "sub" / "new.txt") == want
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert _mode(plain) == want


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o755, 0o600])
def test_an_existing_file_keeps_its_mode(tmp_path: Path, umask: None, mode: int) -> None:
    path = tmp_path / "f.txt"
    path.write_text("old")
    path.chmod(mode)
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and _mode(path) == mode


def test_a_symlink_is_written_through(tmp_path: Path, umask: None) -> None:
    real = tmp_path / "data" / "lock.toml"
    real.parent.mkdir()
    real.write_text("old")
    real.chmod(0o644)
    link = tmp_path / "lock.toml"
    link.symlink_to(Path("data") / "lock.toml")
    atomic_write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new" and _mode(real) == 0o644
    assert sorted(p.name for p in real.parent.iterdir()) == ["lock.toml"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.txt"
    path.write_text("old")

    def broken(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsutil.os, "fsync", broken)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_the_content_appears_only_with_the_rename(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.txt"
    path.write_text("old")
    seen: list[str] = []
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        seen.append(path.read_text())  # what a reader sees just before the rename
        real_replace(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", replace)
    atomic_write_text(path, "new")
    assert seen == ["old"] and path.read_text() == "new"


def test_relock_keeps_the_lock_mode_and_the_root_link(tmp_path: Path, umask: None) -> None:
    from sm70ctl.build.lock import load_lock, relock_local, tree_hash

    csrc = tmp_path / "csrc"
    (csrc / "torch_bindings").mkdir(parents=True)
    (csrc / "torch_bindings" / "k.cu").write_text("kernel")
    real = tmp_path / "data" / "sm70.lock.toml"
    real.parent.mkdir()
    real.write_text('schema = 1\n[toolchain]\ncuda = "12.8"\ngcc_min = "11.4"\n'
                    'gcc_max_major = 14\npython = "3.12"\ncuda_arch_list = "7.0"\n'
                    '[[local]]\nname = "csrc"\npath = "csrc"\nhash = "' + "0" * 64 + '"\n')
    real.chmod(0o644)
    link = tmp_path / "sm70.lock.toml"
    link.symlink_to(Path("data") / "sm70.lock.toml")
    assert relock_local(link, tmp_path, csrc)
    assert link.is_symlink() and _mode(real) == 0o644
    assert load_lock(real).local[0].hash == tree_hash(csrc)
