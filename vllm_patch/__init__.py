"""sm70ctl's vLLM extension: the plugin entry point and the patch series.

- `vllm_patch.plugin.register` is the `vllm.general_plugins` entry point (idempotent).
- `vllm_patch.config` is the typed plugin configuration (SM70_PLUGIN_CONFIG).
- `vllm_patch/patches/` holds the patches for what plugin hooks cannot reach, documented
  in `patches/SERIES.md`; `sm70ctl build` applies them to the pinned vLLM sources.

Importing this package imports nothing from vLLM or torch.
"""
