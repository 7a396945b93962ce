"""`mirror verify` checks git objects, not only that the pinned commit is present."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from build_fixtures import make_upstream, sm70ctl


def _objects(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / "objects").glob("??/*") if p.is_file())


def _unpack(repo: Path) -> None:
    """Turn the mirror's packs into loose objects, so one object's bytes can be damaged."""
    packs = list((repo / "objects" / "pack").glob("*.pack"))
    for pack in packs:
        data = pack.read_bytes()
        pack.unlink()
        pack.with_suffix(".idx").unlink()
        subprocess.run(["git", "--git-dir", str(repo), "unpack-objects", "-q"], input=data,
                       check=True)


def test_corrupted_git_object_fails_mirror_verify(tmp_path: Path) -> None:
    up = make_upstream(tmp_path)
    mirror = tmp_path / "mirror"
    res = sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock)], up.env())
    assert res.returncode == 0, res.stderr
    repo = mirror / "git" / "kernels-lib.git"
    _unpack(repo)
    ok = sm70ctl(["mirror", "verify", str(mirror), "--lock", str(up.lock)], up.env())
    assert ok.returncode == 0, ok.stderr
    # Damage one object that is not the pinned commit itself: presence checks still pass.
    victim = next(p for p in _objects(repo) if p.parent.name + p.name != up.commit)
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = sm70ctl(["mirror", "verify", str(mirror), "--lock", str(up.lock), "--json"],
                  up.env())
    assert bad.returncode == 1, bad.stdout
    items = {i["name"]: i for i in json.loads(bad.stdout)["items"]}
    assert items["kernels-lib"]["status"] == "mismatch"
    assert "git fsck" in items["kernels-lib"]["detail"]
    assert "Traceback" not in bad.stderr


def test_missing_git_object_fails_mirror_verify(tmp_path: Path) -> None:
    up = make_upstream(tmp_path)
    mirror = tmp_path / "mirror"
    assert sm70ctl(["mirror", "create", str(mirror), "--lock", str(up.lock)],
                   up.env()).returncode == 0
    repo = mirror / "git" / "kernels-lib.git"
    _unpack(repo)
    victim = next(p for p in _objects(repo) if p.parent.name + p.name != up.commit)
    victim.unlink()
    bad = sm70ctl(["mirror", "verify", str(mirror), "--lock", str(up.lock), "--json"],
                  up.env())
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["items"][0]["status"] == "mismatch"


def test_too_long_mirror_path_is_one_line(tmp_path: Path) -> None:
    up = make_upstream(tmp_path)
    res = sm70ctl(["mirror", "verify", str(tmp_path / ("m" * 300)), "--lock", str(up.lock)],
                  up.env())
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and "limit 255 bytes" in res.stderr


def test_patch_that_is_binary_or_a_folder_is_one_line(tmp_path: Path) -> None:
    from sm70ctl.build.patches import PatchError, list_series

    (tmp_path / "0001-a.patch").mkdir()
    with pytest.raises(PatchError, match=r"0001-a\.patch: is a folder"):
        list_series(tmp_path)
    (tmp_path / "0001-a.patch").rmdir()
    (tmp_path / "0001-a.patch").write_bytes(b"\xff\x00")
    with pytest.raises(PatchError, match="binary content"):
        list_series(tmp_path)
