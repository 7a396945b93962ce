"""A stand-in for `python -m vllm.entrypoints.openai.api_server`, for the fast serve and
warmup tests: a real HTTP server process answering /health, /v1/models and
/v1/completions on the --host/--port it is given, whose misbehaviour is chosen through
FAKE_* variables (die while starting, exit after a while, ignore SIGTERM, "compile" into
the cache folders). `fake_vllm_path(tmp)` writes it as a `vllm` package and returns the
folder to put on PYTHONPATH; serve then starts it with the tool's own interpreter.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

SERVER = r'''
import argparse, json, os, signal, sys, time, uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=8000)
ap.add_argument("--model")
ap.add_argument("--served-model-name", default="fake")
ap.add_argument("--config")
args, _rest = ap.parse_known_args()
mode = os.environ.get("FAKE_MODE", "ok")
marker = os.environ.get("FAKE_MARKER")
if marker:
    with open(marker, "a") as f:
        f.write(f"started {os.getpid()}\n")
print(f"fake vllm: pid {os.getpid()} model {args.model} port {args.port}", flush=True)
if args.config and os.environ.get("FAKE_PRINT_CONFIG"):  # a server that logs its args
    print("fake vllm: args from --config: " + open(args.config).read().strip(), flush=True)
if os.environ.get("FAKE_PRINT_ENV"):  # a server that logs a variable it inherited
    name = os.environ["FAKE_PRINT_ENV"]
    print(f"fake vllm: {name}={os.environ.get(name)}", flush=True)
print("fake vllm: SM70 vars seen: " + ",".join(sorted(k for k in os.environ
      if k.startswith("SM70_") and k != "SM70_PLUGIN_CONFIG")), flush=True)
print("fake vllm: CUDA_VISIBLE_DEVICES=" + repr(os.environ.get("CUDA_VISIBLE_DEVICES")),
      flush=True)

cache = os.environ.get("VLLM_CACHE_ROOT")
compile_mode = os.environ.get("FAKE_COMPILE", "")
if cache and compile_mode:
    d = Path(cache) / "torch_compile_cache"
    d.mkdir(parents=True, exist_ok=True)
    if compile_mode == "always":
        (d / f"graph-{uuid.uuid4().hex}.bin").write_text("x")
    elif not (d / "graph.bin").exists():
        (d / "graph.bin").write_text("compiled")
        print("fake vllm: compiled graph", flush=True)
    else:
        print("fake vllm: loaded graph from cache", flush=True)

if mode == "die":
    for i in range(5):
        print(f"fake vllm: loading step {i}", flush=True)
    print("fake vllm: RuntimeError: CUDA out of memory (simulated)", flush=True)
    sys.exit(3)

if mode == "ignore_term":
    signal.signal(signal.SIGTERM, lambda *a: print("fake vllm: ignoring SIGTERM", flush=True))
else:
    def _term(*a):
        print("fake vllm: SIGTERM, shutting down", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, _term)

time.sleep(float(os.environ.get("FAKE_STARTUP_DELAY", "0.3")))

class H(BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": args.served_model_name}]})
        else:
            self._send(404, {})
    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        self.rfile.read(n)
        self._send(200, {"choices": [{"text": "ok"}]})
    def log_message(self, *a):
        pass

srv = ThreadingHTTPServer((args.host, args.port), H)
srv.daemon_threads = True
print("fake vllm: ready", flush=True)
deadline = float(os.environ.get("FAKE_EXIT_AFTER", "0"))
if deadline:
    import threading
    def _later():
        time.sleep(deadline)
        print("fake vllm: exiting on purpose", flush=True)
        os._exit(1)
    threading.Thread(target=_later, daemon=True).start()
srv.serve_forever()
'''


def fake_vllm_path(root: Path) -> Path:
    base = Path(root) / "fake_vllm"
    pkg = base / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (base / "vllm", base / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(SERVER)
    return base


def alive(pid: int) -> bool:
    """Running, and not a zombie left to a parent (or PID 1) that does not reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def fake_env(tmp: Path, port: int, **extra: str) -> dict[str, str]:
    """A process environment for `sm70ctl serve --device cpu` against the fake server."""
    model = Path(tmp) / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["FakeForCausalLM"]}')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM70_", "FAKE_"))}
    env.update({
        "PYTHONPATH": str(fake_vllm_path(tmp)),
        "SM70_SERVE_PYTHON": sys.executable,
        "SM70_MODEL_DIR": str(model),
        "SM70_PORT": str(port),
        "SM70_LOCK_DIR": str(Path(tmp) / "locks"),
        "SM70_LOG_DIR": str(Path(tmp) / "logs"),
        "SM70_CACHE_DIR": str(Path(tmp) / "cache"),
        "SM70_STARTUP_TIMEOUT": "30s",
        "SM70_SHUTDOWN_GRACE": "5s",
        "COLUMNS": "200",
    })
    env.update(extra)
    return env
