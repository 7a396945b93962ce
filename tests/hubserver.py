"""A local HTTP server speaking the part of the Hugging Face Hub API that huggingface_hub
2.x calls to download a repository, for tests (127.0.0.1, ephemeral port, threads).

Endpoints (what the client calls, read from huggingface_hub's source):
- GET  /api/models/{repo}/revision/{rev}           repo_info / model_info (sha, siblings)
- GET  /api/models/{repo}/tree/{rev}[/{path}]      list_repo_tree (recursive, LFS sha256)
- POST /api/models/{repo}/paths-info/{rev}         get_paths_info
- HEAD /{repo}/resolve/{rev}/{path}                get_hf_file_metadata: ETag, X-Repo-Commit,
                                                   X-Linked-Etag / X-Linked-Size for LFS
- GET  /{repo}/resolve/{rev}/{path}                http_get: the bytes, honouring Range
Errors carry the hub's X-Error-Code header (RepoNotFound, RevisionNotFound,
EntryNotFound) so the client raises its own typed exceptions.

Faults for tests: `truncate_once[path] = n` sends the full Content-Length but only n bytes
and drops the connection (once); `stall_once[path] = n` sends n bytes then waits until
`release` is set (so a test can kill the client mid-file). Every request is recorded in
`requests` (method, path, headers) for assertions.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

LFS_THRESHOLD = 1024  # files this large (or *.safetensors) are served as LFS files


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, bytes]]  # commit sha -> {path: content}
    refs: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    token: str | None = None  # when set, every request must carry "Bearer <token>"

    @staticmethod
    def is_lfs(path: str, data: bytes) -> bool:
        return path.endswith(".safetensors") or len(data) >= LFS_THRESHOLD


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Seen] = []
        self.truncate_once: dict[str, int] = {}
        self.stall_once: dict[str, int] = {}
        self.ignore_range = False  # answer 200 with the whole file, like some CDNs
        self.release = threading.Event()
        self.stalled = threading.Event()  # set when a stall has begun
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------
    def add_repo(self, repo: Repo) -> None:
        self.repos[repo.repo_id] = repo

    @property
    def url(self) -> str:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- queries for tests -------------------------------------------------------------
    def range_requests(self, path_suffix: str) -> list[str]:
        return [
            s.headers["range"]
            for s in self.requests
            if s.method == "GET" and s.path.endswith(path_suffix) and "range" in s.headers
        ]

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree|paths-info)/"
                  r"(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    # --- helpers ------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message})

    def _resolve(self, repo_id: str, rev: str) -> tuple[Repo, str, dict[str, bytes]] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.token is not None and (
            self.headers.get("authorization") != f"Bearer {repo.token}"
        ):
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return None
        sha = repo.refs.get(rev, rev)
        files = repo.commits.get(sha)
        if files is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo, sha, files

    def _entry(self, repo: Repo, path: str, data: bytes) -> dict:
        entry = {"type": "file", "oid": git_oid(data), "size": len(data), "path": path}
        if repo.is_lfs(path, data):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    # --- verbs --------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._dispatch()

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        self.hub.record(Seen(self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        if self.command == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            self._body = self.rfile.read(length)
        if m := _API.match(path):
            return self._api(m, parse_qs(url.query))
        if m := _RESOLVE.match(path):
            return self._file(m)
        self._error(404, "EntryNotFound", f"no route for {path}")

    def _api(self, m: re.Match, query: dict) -> None:
        found = self._resolve(m["repo"], m["rev"])
        if found is None:
            return
        repo, sha, files = found
        if m["kind"] == "revision":
            body = {"id": repo.repo_id, "modelId": repo.repo_id, "sha": sha, "private":
                    repo.token is not None, "siblings": [{"rfilename": p} for p in sorted(files)]}
            return self._send(200, json.dumps(body).encode())
        if m["kind"] == "paths-info":
            form = parse_qs(self._body.decode()) if self._body else {}
            wanted = form.get("paths", [])
            entries = [self._entry(repo, p, files[p]) for p in wanted if p in files]
            return self._send(200, json.dumps(entries).encode())
        prefix = (m["path"] or "").strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries, dirs = [], set()
        for p in sorted(files):
            if prefix and not p.startswith(prefix + "/"):
                continue
            rest = p[len(prefix) + 1:] if prefix else p
            if "/" in rest and not recursive:
                dirs.add((prefix + "/" if prefix else "") + rest.split("/")[0])
                continue
            parts = rest.split("/")[:-1]
            for i in range(len(parts)):
                dirs.add((prefix + "/" if prefix else "") + "/".join(parts[: i + 1]))
            entries.append(self._entry(repo, p, files[p]))
        folders = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d}
                   for d in sorted(dirs)]
        self._send(200, json.dumps(folders + entries).encode())

    def _file(self, m: re.Match) -> None:
        found = self._resolve(m["repo"], m["rev"])
        if found is None:
            return
        repo, sha, files = found
        rel = m["path"]
        if rel not in files:
            return self._error(404, "EntryNotFound", f"{rel} does not exist at {sha}")
        data = files[rel]
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if repo.is_lfs(rel, data):
            digest = hashlib.sha256(data).hexdigest()
            headers |= {"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"',
                        "X-Linked-Size": str(len(data))}
        else:
            headers["ETag"] = f'"{git_oid(data)}"'
        if self.command == "HEAD":
            return self._send(200, data, headers, "application/octet-stream")

        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and not self.hub.ignore_range:
            r = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if r is None or int(r[1]) >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            start = int(r[1])
            end = int(r[2]) + 1 if r[2] else len(data)
            data = data[start:end]
            status = 206
            headers["Content-Range"] = f"bytes {start}-{start + len(data) - 1}/{len(files[rel])}"

        cut = self.hub.truncate_once.pop(rel, None)
        stall = self.hub.stall_once.pop(rel, None)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if cut is not None:
            self.wfile.write(data[:cut])
            self.wfile.flush()
            self.close_connection = True  # the client sees a body cut short
            return
        if stall is not None:
            self.wfile.write(data[:stall])
            self.wfile.flush()
            self.hub.stalled.set()
            self.hub.release.wait(60)
            self.close_connection = True
            return
        self.wfile.write(data)


# --- a tiny GPTQ-like repository for the weights tests ---------------------------------

MIB = 1024 * 1024
BIG = "model-00001-of-00002.safetensors"  # larger than the client's 10 MiB read chunk
SMALL = "model-00002-of-00002.safetensors"


def tiny_config() -> dict:
    """A config.json whose quantization_config passes the validator (the reference rules)."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 8,
            "full_attention_interval": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]
            + ["linear_attention"] * 3 + ["full_attention"],
        },
        "quantization_config": {
            "quant_method": "gptq",
            "bits": 8,
            "group_size": 128,
            "sym": False,
            "desc_act": False,
            "modules_to_not_convert": ["lm_head", "model.visual"],
            "dynamic": {
                "-:.*\\.self_attn\\.(q_proj|k_proj|v_proj|qkv_proj)$": {},
                "-:.*\\.linear_attn\\.(in_proj_b|in_proj_a|in_proj_ba)$": {},
            },
        },
    }


def tiny_files(seed: int = 7) -> dict[str, bytes]:
    import random

    rnd = random.Random(seed)
    return {
        "config.json": json.dumps(tiny_config(), indent=2).encode(),
        "tokenizer_config.json": b'{"model_max_length": 262144}\n',
        BIG: rnd.randbytes(12 * MIB + 123),
        SMALL: rnd.randbytes(1 * MIB + 7),
        "README.md": b"# tiny\n",
        "original/consolidated.pth": rnd.randbytes(2048),
    }


def lock_text(name: str, repo_id: str, revision: str, *, local_dir: str = "tiny",
              unverified: str = "") -> str:
    rev = f'revision = "{revision}"' if revision else f'unverified = "{unverified}"'
    return (
        f'[models.{name}]\nrepo_id = "{repo_id}"\n{rev}\nlocal_dir = "{local_dir}"\n'
        'include = ["*.json", "*.safetensors"]\nexclude = ["original/*"]\n'
        "check_quant = true\n"
    )
