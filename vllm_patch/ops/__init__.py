"""Our compiled ops (`torch.ops.sm70.*`): sources, the one loader, typed wrappers, references.

- `sources`: where the CUDA sources are (the checkout's `csrc/`, else the copy the wheel ships
  as `vllm_patch/_csrc/`), which translation units and include folder build them, and their
  content hash. No torch import.
- `build`: the compile flags and the build of the library (torch imported when building).
- `loader.load_ops()`: loads a prebuilt library that matches this runtime, else builds one
  under a file lock into a cache folder. Idempotent.
- `kernels`: typed wrappers over `torch.ops.sm70.*`; each loads the ops first.
- `reference`: plain-PyTorch definitions of what the ops compute, and the load-time repacks.

Importing this package imports neither torch nor vLLM.
"""
