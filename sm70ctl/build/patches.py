"""The vllm_patch/patches series: list it, check it, apply it.

Each patch is checked with `git apply --check` against the tree as the patches before it
left it, then applied. On a conflict the build stops with the patch's file name and the
hunk that failed (its file and `@@` header), which is what someone rebasing the series
needs to see first.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sm70ctl.errors import Sm70Error

# The series' patches are tens of KiB; anything near this is not a patch.
MAX_PATCH_BYTES = 16 * 1024 * 1024
_PATCH_NAME = re.compile(r"^\d{4}-[a-z0-9][a-z0-9._-]*\.patch$")
_FAILED = re.compile(r"patch failed: (?P<file>.+?):(?P<line>\d+)")
_MISSING = re.compile(r"error: (?P<file>.+?): (No such file or directory|does not exist in index)")
_HUNK = re.compile(r"^@@ -(?P<old>\d+)(?:,\d+)? \+\d+(?:,\d+)? @@.*$")


class PatchError(Sm70Error):
    """A patch of the series does not apply."""


@dataclass(frozen=True)
class Patch:
    path: Path
    sha256: str

    @property
    def name(self) -> str:
        return self.path.name


def series_dir() -> Path:
    return Path(__file__).resolve().parent.parent.parent / "vllm_patch" / "patches"


def list_series(directory: Path) -> list[Patch]:
    """The patches in apply order (NNNN- prefix), each with its content digest."""
    from sm70ctl.readers import check_path, decode_text, read_bytes

    if not check_path(directory, "patch folder").is_dir():
        raise PatchError(f"patch folder {directory} does not exist")
    out = []
    for p in sorted(directory.glob("*.patch")):
        if not _PATCH_NAME.match(p.name):
            raise PatchError(
                f"patch file name {p.name!r} must look like NNNN-short-name.patch (lower case)"
            )
        try:  # a patch is text: a folder, binary file or one of gigabytes is refused here
            data = read_bytes(p, what="patch", max_bytes=MAX_PATCH_BYTES)
            decode_text(data, what="patch", name=str(p))
        except Sm70Error as exc:
            raise PatchError(exc.message) from None
        out.append(Patch(p, hashlib.sha256(data).hexdigest()))
    return out


def hunks(patch_text: str) -> list[tuple[str, int, str]]:
    """(file, old start line, @@ header) for every hunk of a unified diff."""
    out: list[tuple[str, int, str]] = []
    current = ""
    for line in patch_text.splitlines():
        if line.startswith("--- "):
            continue
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0].strip()
            current = target[2:] if target.startswith(("a/", "b/")) else target
            continue
        m = _HUNK.match(line)
        if m and current:
            out.append((current, int(m.group("old")), line))
    return out


def describe_failure(patch_text: str, stderr: str) -> str:
    """Turn `git apply` output into 'hunk #N of FILE (@@ ... @@)' (pure)."""
    m = _FAILED.search(stderr)
    if m:
        file, line = m.group("file"), int(m.group("line"))
        numbered = enumerate((h for h in hunks(patch_text) if h[0] == file), 1)
        for i, (_f, start, header) in numbered:
            if start == line:
                return f"hunk #{i} of {file} ({header}) does not match the source"
        return f"a hunk of {file} at line {line} does not match the source"
    m = _MISSING.search(stderr)
    if m:
        return f"{m.group('file')} does not exist in the source tree"
    tail = stderr.strip().splitlines()[-1:] or ["git apply failed"]
    return tail[0]


def _git_apply(args: list[str], tree: Path, patch: Path) -> subprocess.CompletedProcess[str]:
    # --unsafe-paths is not used: patches may only touch files inside the tree.
    return subprocess.run(
        ["git", "apply", *args, str(patch)],
        cwd=tree,
        capture_output=True,
        text=True,
        env={"PATH": _path_env(), "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tree)},
        check=False,
    )


def _path_env() -> str:
    return os.environ.get("PATH", "/usr/bin:/bin")


def apply_series(tree: Path, series: list[Patch], log=lambda m: None) -> list[str]:
    """Check then apply each patch in order; raise PatchError naming the patch and hunk."""
    applied: list[str] = []
    for p in series:
        text = p.path.read_text(encoding="utf-8")
        check = _git_apply(["--check", "--verbose"], tree, p.path)
        if check.returncode != 0:
            where = describe_failure(text, check.stderr + check.stdout)
            done = f" (applied before it: {', '.join(applied)})" if applied else ""
            raise PatchError(
                f"patch {p.name} does not apply: {where}{done}",
                hint=(
                    "rebase the patch on the pinned source (see vllm_patch/patches/SERIES.md), "
                    "or check that the lock pins the release the series was written for"
                ),
            )
        res = _git_apply([], tree, p.path)
        if res.returncode != 0:  # pragma: no cover - check passed, apply should too
            raise PatchError(f"patch {p.name} passed --check but failed: {res.stderr.strip()}")
        log(f"applied {p.name}")
        applied.append(p.name)
    return applied
