"""Fixes to vLLM 0.22.1's tool-call parsing in the API server (runtime_patches/README.md R9)."""
