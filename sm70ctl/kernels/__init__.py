"""What the CLI and CI need of our Volta (sm_70) kernels: the NVRTC compile-and-resource check
and the list of kernel instantiations it compiles.

The ops' Python face (the loader, the typed wrappers, the references) is `vllm_patch.ops`, which
vLLM's processes import without sm70ctl. Nothing here imports torch or sm70ctl.settings at
import time, so CI (no torch) can use the NVRTC checker.
"""
