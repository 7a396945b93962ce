"""Download pinned model repositories, resumably, into SM70_WEIGHTS_DIR/<local_dir>.

The hub client (`huggingface_hub`) does the talking: `HfApi.list_repo_tree` for the file
listing at the pinned commit, `get_hf_file_metadata` (HEAD on `resolve/<commit>/<path>`)
for each file's location, and `http_get` for the bytes. We keep the byte loop of the
client but own the partial file: huggingface_hub 2.x deletes a partial download when the
process stops (its temporary name is unique per process), so a 32 GB checkpoint cut at
90 % would start over. Here each file streams into `.sm70/partial/<path>`, which survives
Ctrl-C or a kill; the next run sends `Range: bytes=<size>-` and carries on. Inside one
run the client itself also resumes with a Range request when the connection drops.

Every finished file is hashed (sha256) and compared with the hub's LFS sha256 (or, for
small non-LFS files, the git blob id) before it is renamed into place; the manifest is
rewritten atomically after each file, so an interruption loses at most the file in flight
and never leaves a half-written file under a name vLLM would load.

Secrets: the token goes to the client and nowhere else. It is not part of any message,
log line, manifest or repr (`FetchConfig.token` has `repr=False`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sm70ctl.errors import Sm70Error
from sm70ctl.settings.typed import SettingsView
from sm70ctl.weights import disk
from sm70ctl.weights.manifest import (
    STATE_DIR,
    FileEntry,
    Manifest,
    StatStamp,
    git_blob_oid,
    partial_path,
    read_manifest,
    safe_relpath,
    sha256_file,
    write_manifest,
)
from sm70ctl.weights.pins import ModelPin

Reporter = Callable[[str], None]


@dataclass(frozen=True)
class FetchConfig:
    """What fetching needs from the settings."""

    weights_dir: Path
    token: str | None = field(default=None, repr=False)  # never printed
    endpoint: str | None = None  # None: the client's default (HF_ENDPOINT or huggingface.co)
    progress: bool = True  # per-file progress bars (stderr)

    @classmethod
    def from_settings(cls, settings: SettingsView, **overrides: Any) -> FetchConfig:
        token = getattr(settings, "hf_token", None)
        if token is not None and hasattr(token, "get_secret_value"):  # pydantic SecretStr
            token = token.get_secret_value()
        return cls(
            weights_dir=Path(str(settings.weights_dir)).expanduser(),
            token=str(token) if token else None,
            **overrides,
        )

    def folder(self, pin: ModelPin) -> Path:
        return self.weights_dir / pin.local_dir


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    lfs_sha256: str | None = None
    git_oid: str | None = None


@dataclass(frozen=True)
class FilePlan:
    """What to do with one listed file, decided from the local state (pure)."""

    remote: RemoteFile
    action: str  # "keep" (already complete), "download", "resume"
    have: int = 0  # bytes already in the partial file


@dataclass
class FetchResult:
    name: str
    repo_id: str
    revision: str
    folder: str
    files: int = 0
    total_bytes: int = 0
    kept: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    bytes_downloaded: int = 0
    quant_problems: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "folder": self.folder,
            "files": self.files,
            "total_bytes": self.total_bytes,
            "kept": self.kept,
            "downloaded": self.downloaded,
            "resumed": self.resumed,
            "bytes_downloaded": self.bytes_downloaded,
            "quant_problems": self.quant_problems,
            "ok": not self.quant_problems,
        }


# --- pure decisions ---------------------------------------------------------------------


def refuse_placeholder(pin: ModelPin) -> None:
    if pin.is_placeholder:
        raise Sm70Error(
            f"model pin [models.{pin.name}] ({pin.repo_id}) has no verified revision: "
            f"{pin.unverified or 'no reason given'}",
            hint=f"put the 40-character commit you checked on the hub into `revision` of "
            f"[models.{pin.name}] in {pin.source or 'the lock file'} (and drop `unverified`), "
            "or pass --lock PATH",
        )


def filter_files(
    files: list[RemoteFile], include: tuple[str, ...], exclude: tuple[str, ...]
) -> list[RemoteFile]:
    """The listed files the pin's include/exclude patterns select (the client's rules)."""
    from huggingface_hub.utils import filter_repo_objects

    return list(
        filter_repo_objects(
            files,
            allow_patterns=list(include) or None,
            ignore_patterns=list(exclude) or None,
            key=lambda f: f.path,
        )
    )


def plan_files(
    files: list[RemoteFile], complete: set[str], partial_sizes: Mapping[str, int]
) -> list[FilePlan]:
    """Keep what is complete, resume what has a usable partial, download the rest."""
    plans = []
    for f in files:
        if f.path in complete:
            plans.append(FilePlan(f, "keep"))
            continue
        have = partial_sizes.get(f.path, 0)
        if 0 < have < f.size:
            plans.append(FilePlan(f, "resume", have))
        else:
            plans.append(FilePlan(f, "download", 0))
    return plans


def bytes_needed(plans: list[FilePlan]) -> int:
    return sum(p.remote.size - p.have for p in plans if p.action != "keep")


def hub_mismatch(remote: RemoteFile, sha256: str, git_oid: str | None) -> str | None:
    """Why a downloaded file differs from what the hub listed, or None when it matches."""
    if remote.lfs_sha256:
        if sha256 != remote.lfs_sha256.lower():
            return f"sha256 {sha256} but the hub lists LFS sha256 {remote.lfs_sha256}"
    elif remote.git_oid:
        if git_oid is None:
            return "the git blob id was not measured"
        if git_oid != remote.git_oid.lower():
            return f"git blob id {git_oid} but the hub lists {remote.git_oid}"
    else:  # nothing to check against: unverified bytes are never used
        return "the hub listed neither an LFS sha256 nor a git blob id for it"
    return None


# --- edges: hub -------------------------------------------------------------------------


def endpoint_label(cfg: FetchConfig) -> str:
    if cfg.endpoint:
        return cfg.endpoint
    from huggingface_hub import constants

    return constants.ENDPOINT


def _token_arg(cfg: FetchConfig) -> str | bool:
    # False, not None: an empty SM70_HF_TOKEN means "no token", not "look for one elsewhere".
    return cfg.token if cfg.token else False


@contextlib.contextmanager
def hub_errors(pin: ModelPin, cfg: FetchConfig, path: str | None = None) -> Iterator[None]:
    """Turn the client's exceptions into one-line Sm70Errors (no token, no traceback)."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{pin.repo_id}@{pin.revision}"
    endpoint = endpoint_label(cfg)
    try:
        yield
    except RevisionNotFoundError:
        raise Sm70Error(
            f"revision {pin.revision} of {pin.repo_id} was not found on {endpoint}",
            hint=f"check `revision` of [models.{pin.name}] in {pin.source or 'the lock file'}",
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise Sm70Error(
            f"repository {pin.repo_id} is not available on {endpoint} (HTTP {status}): it does "
            "not exist, or it is private or gated and the token is missing or lacks access",
            hint="set SM70_HF_TOKEN to a token with read access, or fix `repo_id` in the lock",
        ) from None
    except RemoteEntryNotFoundError:
        raise Sm70Error(f"{path or 'a file'} is listed but missing from {where} on {endpoint}") \
            from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise Sm70Error(
            f"the hub at {endpoint} answered HTTP {status} for {where}"
            + (f" ({path})" if path else ""),
            hint="run the same command again later; finished files are kept",
        ) from None
    except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as exc:
        raise Sm70Error(
            f"cannot reach the hub at {endpoint} ({exc.__class__.__name__})",
            hint="check the network or HF_ENDPOINT; `sm70ctl weights fetch --offline` "
            "checks the local files without the network",
        ) from None
    except httpx2.HTTPError as exc:
        raise Sm70Error(
            f"download from {endpoint} failed for {where}"
            + (f" ({path})" if path else "")
            + f": {exc.__class__.__name__}",
            hint="run the same command again: it resumes where it stopped",
        ) from None


def list_remote(pin: ModelPin, cfg: FetchConfig) -> list[RemoteFile]:
    """Every file of the pinned commit, with sizes and hashes, from the hub's tree listing."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=cfg.endpoint, token=_token_arg(cfg))
    with hub_errors(pin, cfg):
        entries = list(
            api.list_repo_tree(
                pin.repo_id, revision=pin.revision, repo_type=pin.repo_type, recursive=True
            )
        )
    out = []
    for e in entries:
        if isinstance(e, RepoFile):
            if not safe_relpath(e.path):
                raise Sm70Error(f"the hub listed an unsafe path {e.path!r} in "
                                f"{pin.repo_id}@{pin.revision}; refusing to write it")
            out.append(
                RemoteFile(
                    path=e.path,
                    size=int(e.size),
                    lfs_sha256=e.lfs.sha256 if e.lfs is not None else None,
                    git_oid=e.blob_id,
                )
            )
    return sorted(out, key=lambda f: f.path)


def _same_origin(a: str, b: str) -> bool:
    pa, pb = urlparse(a), urlparse(b)
    return (pa.scheme, pa.hostname, pa.port) == (pb.scheme, pb.hostname, pb.port)


def download_file(pin: ModelPin, cfg: FetchConfig, remote: RemoteFile, part: Path) -> None:
    """Stream one file into `part`, continuing from its current size (Range request)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(
        pin.repo_id, remote.path, repo_type=pin.repo_type, revision=pin.revision,
        endpoint=cfg.endpoint,
    )
    token = _token_arg(cfg)
    with hub_errors(pin, cfg, remote.path):
        meta = get_hf_file_metadata(url, token=token, endpoint=cfg.endpoint, retry_on_errors=True)
    if meta.commit_hash and meta.commit_hash != pin.revision:
        raise Sm70Error(
            f"{remote.path}: the hub served commit {meta.commit_hash}, not the pinned "
            f"{pin.revision}"
        )
    if meta.size is not None and meta.size != remote.size:
        raise Sm70Error(
            f"{remote.path}: the hub lists {remote.size} bytes but serves {meta.size} bytes"
        )
    target = url if meta.xet_file_data is not None else (meta.location or url)
    headers = build_hf_headers(token=token)
    if not _same_origin(url, target):
        headers.pop("authorization", None)  # signed CDN URL: the token stays with the hub
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > remote.size:
        part.unlink()
        have = 0
    try:
        with open(part, "ab") as f, hub_errors(pin, cfg, remote.path):
            http_get(
                target,
                f,
                resume_size=have,
                headers=headers,
                expected_size=remote.size,
                displayed_filename=remote.path,
                tqdm_class=None if cfg.progress else _NoBar,
            )
    except OSError as exc:  # raised by writes (and the final flush), not by the network
        if exc.errno == errno.ENOSPC:
            kept = part.stat().st_size if part.exists() else 0
            raise Sm70Error(
                f"disk full while writing {remote.path} into {part.parent}: "
                f"{kept} of {remote.size} bytes kept",
                hint="free some space and run the same command again: it resumes",
            ) from None
        if "Consistency check failed" in str(exc):
            raise Sm70Error(
                f"{remote.path}: the download stopped short of {remote.size} bytes",
                hint="run the same command again: it resumes where it stopped",
            ) from None
        raise


class _NoBar:
    """A do-nothing progress bar for --json / quiet runs (tqdm's interface, as used)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        pass

    def close(self) -> None:
        pass


# --- edges: local state -------------------------------------------------------------------


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """One fetch per folder at a time (the shared flock, released when the process ends)."""
    from sm70ctl.locking import FileLock, LockHeldError

    lock = FileLock(folder / STATE_DIR / "fetch.lock", "sm70ctl weights fetch")
    try:
        lock.acquire()
    except LockHeldError as exc:
        raise Sm70Error(
            f"another `sm70ctl weights fetch` is writing {folder}",
            hint=f"wait for it to finish (pid {exc.holder.get('pid', 'unknown')} holds "
                 f"{lock.path})",
        ) from None
    try:
        yield
    finally:
        lock.release()


def _matches_hub(path: Path, remote: RemoteFile) -> tuple[bool, str]:
    sha = sha256_file(path)
    oid = git_blob_oid(path) if not remote.lfs_sha256 and remote.git_oid else None
    return hub_mismatch(remote, sha, oid) is None, sha


def local_state(
    folder: Path, files: list[RemoteFile], old: Manifest | None, revision: str
) -> tuple[dict[str, FileEntry], dict[str, int]]:
    """Which listed files are already complete (with their entry) and partial sizes.

    A file counts as complete when its size matches and either the manifest of the same
    revision recorded it with an unchanged stat, or re-hashing it matches the hub.
    """
    complete: dict[str, FileEntry] = {}
    partial: dict[str, int] = {}
    for f in files:
        dest = folder / f.path
        part = partial_path(folder, f.path)
        if part.is_file():
            partial[f.path] = part.stat().st_size
        if not dest.is_file() or dest.stat().st_size != f.size:
            continue
        entry = FileEntry(size=f.size, lfs_sha256=f.lfs_sha256, git_oid=f.git_oid)
        prev = old.files.get(f.path) if old and old.revision == revision else None
        stamp = StatStamp.of(dest)
        if (
            prev is not None
            and prev.sha256
            and prev.stat == stamp
            and prev.lfs_sha256 == f.lfs_sha256
            and prev.git_oid == f.git_oid
        ):
            entry.sha256, entry.stat = prev.sha256, stamp
            complete[f.path] = entry
            continue
        ok, sha = _matches_hub(dest, f)
        if ok:
            entry.sha256, entry.stat = sha, stamp
            complete[f.path] = entry
    return complete, partial


def check_quant_folder(folder: Path) -> list[dict[str, Any]]:
    """Problems with `<folder>/config.json`'s quantization config, as plain dicts."""
    from sm70ctl.readers import read_json
    from sm70ctl.weights.quant import Problem, validate_quant_config

    path = folder / "config.json"
    if not path.exists():
        problems = [Problem("config.json", None, "present", f"{path} is missing")]
    else:
        try:
            config = read_json(path, what="model config")
        except Sm70Error as exc:
            problems = [Problem("config.json", None, "valid JSON", exc.message)]
        else:
            problems = validate_quant_config(config)
    return [p.to_dict() for p in problems]


# --- the fetch ----------------------------------------------------------------------------


def fetch_pin(
    pin: ModelPin,
    cfg: FetchConfig,
    *,
    report: Reporter = lambda _msg: None,
    free_bytes: Callable[[Path], int] = disk.free_bytes,
) -> FetchResult:
    """Bring `pin` into `cfg.folder(pin)`; resumable, hashed, recorded in the manifest."""
    refuse_placeholder(pin)
    folder = cfg.folder(pin)
    # Before any request: a weights folder that can never be written fails now, in one line.
    root = disk.existing_ancestor(folder)
    if not root.is_dir() or not os.access(root, os.W_OK):
        raise Sm70Error(
            f"SM70_WEIGHTS_DIR={cfg.weights_dir}: cannot create {folder} "
            f"({root} is {'not a folder' if not root.is_dir() else 'not writable'})",
            hint="point SM70_WEIGHTS_DIR at a folder this user can write",
        )
    result = FetchResult(pin.name, pin.repo_id, pin.revision, str(folder))

    report(f"{pin.name}: listing {pin.repo_id}@{pin.revision} on {endpoint_label(cfg)}")
    files = filter_files(list_remote(pin, cfg), pin.include, pin.exclude)
    if not files:
        raise Sm70Error(
            f"no file of {pin.repo_id}@{pin.revision} matches the include/exclude patterns of "
            f"[models.{pin.name}]"
        )
    result.files = len(files)
    result.total_bytes = sum(f.size for f in files)

    # Space first, before touching the folder: everything not yet on disk must fit.
    try:
        old = read_manifest(folder) if folder.is_dir() else None
    except Sm70Error as exc:  # rebuilt below: every file is re-hashed against the hub
        report(f"{pin.name}: {exc.message}; rebuilding it")
        old = None
    if folder.is_dir():
        complete, partial = local_state(folder, files, old, pin.revision)
    else:
        complete, partial = {}, {}
    plans = plan_files(files, set(complete), partial)
    need = bytes_needed(plans)
    disk.check_space(
        needed=need,
        free=free_bytes(cfg.weights_dir),
        folder=disk.existing_ancestor(cfg.weights_dir),
        what=f"{pin.repo_id}@{pin.revision[:12]} "
        f"({sum(p.action != 'keep' for p in plans)} files to download)",
    )

    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder):
        manifest = Manifest(
            name=pin.name,
            repo_id=pin.repo_id,
            revision=pin.revision,
            repo_type=pin.repo_type,
            include=list(pin.include),
            exclude=list(pin.exclude),
            complete=False,
            files={
                f.path: complete.get(f.path)
                or FileEntry(size=f.size, lfs_sha256=f.lfs_sha256, git_oid=f.git_oid)
                for f in files
            },
        )
        write_manifest(folder, manifest)
        todo = [p for p in plans if p.action != "keep"]
        result.kept = [p.remote.path for p in plans if p.action == "keep"]
        for i, plan in enumerate(todo, 1):
            f = plan.remote
            verb = f"resuming at {disk.human_bytes(plan.have)}" if plan.action == "resume" \
                else "downloading"
            report(f"[{i}/{len(todo)}] {f.path} ({disk.human_bytes(f.size)}): {verb}")
            part = partial_path(folder, f.path)
            if plan.action == "download":
                part.unlink(missing_ok=True)
            download_file(pin, cfg, f, part)
            sha = sha256_file(part)
            oid = git_blob_oid(part) if not f.lfs_sha256 and f.git_oid else None
            why = hub_mismatch(f, sha, oid)
            if why is not None:
                part.unlink(missing_ok=True)  # a bad partial must not be resumed
                raise Sm70Error(
                    f"{f.path}: downloaded content does not match the hub: {why}",
                    hint="run the same command again to download it afresh; if it fails "
                    "again the mirror or the pin is wrong",
                )
            dest = folder / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dest)
            manifest.files[f.path] = FileEntry(
                size=f.size, lfs_sha256=f.lfs_sha256, git_oid=f.git_oid,
                sha256=sha, stat=StatStamp.of(dest),
            )
            write_manifest(folder, manifest)
            result.bytes_downloaded += f.size - plan.have
            (result.resumed if plan.action == "resume" else result.downloaded).append(f.path)
        manifest.complete = True
        write_manifest(folder, manifest)

    if pin.check_quant:
        result.quant_problems = check_quant_folder(folder)
    return result


__all__ = [
    "FetchConfig",
    "FetchResult",
    "FilePlan",
    "RemoteFile",
    "bytes_needed",
    "check_quant_folder",
    "fetch_pin",
    "filter_files",
    "hub_mismatch",
    "plan_files",
    "refuse_placeholder",
]
