#!/usr/bin/env bash
# Download the pinned vLLM sdist named in the lock into build/ci/, verified by sha256,
# so tests/test_patches_series.py can apply vllm_patch/patches to the real sources.
# Idempotent: a present file whose sha256 matches is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
python - <<'PY'
import hashlib, os, sys, urllib.request
from pathlib import Path
from sm70ctl.build.lock import load_lock

a = load_lock().archive("vllm")
dest = Path("build/ci") / a.filename
dest.parent.mkdir(parents=True, exist_ok=True)

def sha(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

if dest.is_file() and sha(dest) == a.sha256:
    print(f"{dest}: present, sha256 ok")
    sys.exit(0)
tmp = dest.with_suffix(".part")
with urllib.request.urlopen(a.url, timeout=120) as r, tmp.open("wb") as f:
    while block := r.read(1 << 20):
        f.write(block)
got = sha(tmp)
if got != a.sha256:
    tmp.unlink()
    sys.exit(f"{a.filename}: sha256 {got} does not match the lock's {a.sha256}")
os.replace(tmp, dest)
print(f"{dest}: downloaded, sha256 ok")
PY
