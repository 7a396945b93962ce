"""`weights verify` refuses links that lead out of the model folder, and odd folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hubserver import SMALL
from tiny_fetch import fetch_tiny

from sm70ctl.errors import Sm70Error
from sm70ctl.weights.verify import OUTSIDE, verify_folder

REPO = "test-org/tiny-gptq-int8"
COMMIT = hashlib.sha1(b"links commit").hexdigest()


@pytest.fixture
def fetched(tmp_path: Path) -> Path:
    return fetch_tiny(tmp_path, REPO, COMMIT)


def _kinds(folder: Path) -> dict[str, str]:
    return {i.path: i.kind for i in verify_folder(folder, full=True).issues}


def test_file_linked_outside_is_refused(fetched: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # the very same bytes: only the link itself is wrong
    shutil.move(fetched / SMALL, outside / "copy")
    (fetched / SMALL).symlink_to(outside / "copy")
    report = verify_folder(fetched, full=True)
    assert not report.ok
    (issue,) = [i for i in report.issues if i.path == SMALL]
    assert issue.kind == OUTSIDE and "outside the folder" in issue.detail


def test_folder_on_the_way_linked_outside_is_refused(fetched: Path, tmp_path: Path) -> None:
    # list the file under sub/ (as a checkpoint with folders would), then make sub/ a link
    manifest = fetched / ".sm70" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"][f"sub/{SMALL}"] = data["files"].pop(SMALL)
    manifest.write_text(json.dumps(data))
    outside = tmp_path / "sub-outside"
    outside.mkdir()
    shutil.move(fetched / SMALL, outside / SMALL)
    (fetched / "sub").symlink_to(outside, target_is_directory=True)
    assert _kinds(fetched)[f"sub/{SMALL}"] == OUTSIDE
    # the same layout with sub/ a real folder passes
    (fetched / "sub").unlink()
    shutil.move(outside, fetched / "sub")
    assert _kinds(fetched) == {}


def test_link_inside_the_folder_is_fine(fetched: Path) -> None:
    store = fetched / "store"
    store.mkdir()
    shutil.move(fetched / SMALL, store / "blob")
    (fetched / SMALL).symlink_to(Path("store") / "blob")
    kinds = _kinds(fetched)
    assert SMALL not in kinds  # followed, hashed, matches
    assert kinds == {"store/blob": "extra"}


def test_dangling_and_looping_links(fetched: Path) -> None:
    (fetched / SMALL).unlink()
    (fetched / SMALL).symlink_to(fetched / "nowhere")
    assert _kinds(fetched)[SMALL] == OUTSIDE
    (fetched / SMALL).unlink()
    os.symlink(SMALL, fetched / SMALL)  # points at itself
    assert _kinds(fetched)[SMALL] == OUTSIDE


def test_too_long_folder_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(Sm70Error, match="limit 255 bytes"):
        verify_folder(tmp_path / ("x" * 300))
