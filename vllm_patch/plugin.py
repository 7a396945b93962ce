"""The `vllm.general_plugins` entry point: `register()`.

vLLM calls `register()` in every process it starts (API server, engine core, each
worker), possibly more than once per process; it must be idempotent and cheap. It reads
the plugin configuration (vllm_patch.config, from SM70_PLUGIN_CONFIG) and registers what
vLLM's hooks reach:

- our custom ops: the prebuilt csrc/ library `sm70ctl build` installs in vllm_patch/_lib/,
  when it matches this runtime (`vllm_patch.ops.loader.load_prebuilt`; torch is imported
  only when a library file exists; kernels that find none build it on first use);
- the `sm70_gptq` quantization config (vllm_patch.quantization): GPTQ-int8 checkpoints'
  linear layers and the int8 lm_head on our GEMV/GEMM, when vLLM is importable and
  `gemm.int8_gemv` is on (off: vLLM's own GPTQ path, which a V100 cannot run);
- the SM70 attention backend, registered with vLLM's backend registry
  (`register_backend`) under SM70_PAGED (the name patch 0002 adds), or in the CUSTOM slot
  of an unpatched vLLM, only when `vllm_patch.attention` really defines the class
  `Sm70PagedBackend` (a vLLM `AttentionBackend`; vllm_patch/attention/backend.py, bound
  lazily by the package); without it nothing is registered and sm70ctl's settings refuse
  SM70_ATTENTION_BACKEND=SM70_PAGED (`attention_backend_defined`, which reads the source
  without importing vLLM);
- the GDN layer's decode rows on our ops (vllm_patch.gdn, a `register_oot` subclass of
  vLLM's layer), only when `gdn.decode_layer` is on (off by default; its prefill rows too
  with `gdn.prefill` "sm70"); with
  `gdn.state_dtype` int16 as well (opt-in), the int16-pool layer and a model subclass under
  the same architecture name (vllm_patch/gdn/int16_model.py).

What hooks cannot reach (the archs vLLM's own kernels are compiled for) is in the patch
series, applied at build time. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm_patch")

# The entry point's name in pyproject.toml: what an explicit VLLM_PLUGINS must list.
PLUGIN_NAME = "sm70"
ATTENTION_MODULE = "vllm_patch.attention"
ATTENTION_CLASS_NAME = "Sm70PagedBackend"
ATTENTION_CLASS = f"{ATTENTION_MODULE}.{ATTENTION_CLASS_NAME}"

_lock = threading.Lock()
_state: dict[str, Any] = {}


def register() -> dict[str, Any]:
    """Register sm70ctl's extensions with vLLM; later calls return the first call's report."""
    with _lock:
        if _state:
            _state["calls"] += 1
            return dict(_state)
        from vllm_patch.config import PluginConfig

        config = PluginConfig.from_env()
        report: dict[str, Any] = {"calls": 1, "config": config}
        report["custom_ops"] = _load_custom_ops()
        report["attention_backend"] = _register_attention_backend()
        report["quantization"] = _register_quantization(config)
        report["prompt_logprobs"] = _install_prompt_logprobs(config)
        report["gdn_layer"] = _register_gdn_layer(config)
        report["ngram_assist"] = _install_ngram_assist(config)
        report["settle_accepted_state"] = _install_settle_accepted_state(config)
        report["exact_prefix_hits"] = _install_exact_prefix_hits(config)
        report["tool_call_split_tag"] = _install_split_start_tag()
        report["spec_gates"] = _install_spec_gates(config)
        _state.update(report)
        logger.info("sm70 plugin registered: custom ops %s, attention backend %s, "
                    "quantization %s", report["custom_ops"], report["attention_backend"],
                    report["quantization"])
        return dict(_state)


def registered() -> dict[str, Any]:
    """What `register()` did in this process (empty before the first call)."""
    return dict(_state)


def _load_custom_ops() -> str:
    from vllm_patch.ops.loader import load_prebuilt

    return load_prebuilt()


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def attention_backend_defined() -> bool:
    """Whether `vllm_patch.attention` binds `Sm70PagedBackend` at its top level, read from
    its source (pure of vLLM: sm70ctl's settings ask this where vLLM is not installed).

    A folder without `__init__.py` (say, one holding only a README) is a namespace
    package: `find_spec` finds it, but it defines nothing, so it does not count.
    """
    try:
        spec = importlib.util.find_spec(ATTENTION_MODULE)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    return ATTENTION_CLASS_NAME in _top_level_names(tree)


def _register_attention_backend() -> str:
    if not attention_backend_defined():
        return f"absent ({ATTENTION_CLASS} is not defined)"
    try:
        from vllm.v1.attention.backend import AttentionBackend
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:
        return "skipped (this vLLM has no register_backend)"
    # The class itself, not just the module's name: vLLM imports this path when the
    # backend is chosen, and a name that resolves to nothing fails only then.
    try:
        backend = getattr(importlib.import_module(ATTENTION_MODULE), ATTENTION_CLASS_NAME, None)
    except ImportError as exc:
        logger.warning("sm70 attention backend not registered: %s", exc)
        return f"absent ({ATTENTION_MODULE} does not import: {exc})"
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        return f"absent ({ATTENTION_CLASS} is not a vLLM AttentionBackend class)"
    # A vLLM built by `sm70ctl build` has the SM70_PAGED name (patch 0002); an unpatched
    # one only offers the CUSTOM slot (then use --attention-backend CUSTOM).
    slot = getattr(AttentionBackendEnum, "SM70_PAGED", None) or AttentionBackendEnum.CUSTOM
    register_backend(slot, ATTENTION_CLASS)
    return f"{slot.name} -> {ATTENTION_CLASS}"


def _register_gdn_layer(config: Any) -> str:
    """vllm_patch.gdn's subclass of vLLM's GDN layer (decode rows on our ops), when asked."""
    if not config.gdn.decode_layer:
        return "off (gdn.decode_layer is false)"
    if config.gdn.kernel != "sm70":
        return f"off (gdn.kernel is {config.gdn.kernel})"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.gdn import int16_pool, layer

    # int16 also registers the model subclass: layer.register
    int16 = int16_pool.wanted(config.gdn.decode_layer, config.gdn.kernel, config.gdn.state_dtype)
    return layer.register(int16_state=int16, prefill=config.gdn.prefill)


def _register_quantization(config: Any) -> str:
    if not config.gemm.int8_gemv:
        return "off (gemm.int8_gemv is false)"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.quantization import sm70_gptq

    return sm70_gptq.register(config.gemm.gemv_max_rows, config.gemm.int8_lm_head)


def _install_prompt_logprobs(config: Any) -> str:
    """R5 of runtime_patches/README.md; `logprobs.prompt_chunk` 0 leaves vLLM's own path."""
    if config.logprobs.prompt_chunk <= 0:
        return f"off (logprobs.prompt_chunk is {config.logprobs.prompt_chunk})"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.logprobs import runner_patch

    return runner_patch.install_when_imported(config.logprobs.prompt_chunk)


def _install_ngram_assist(config: Any) -> str:
    """R6 of runtime_patches/README.md: armed when `spec.ngram_assist` is on; the wrapper
    acts only in runners whose speculative method is MTP (the method is vLLM's config,
    which no plugin process has when `register()` runs), others get vLLM's drafts."""
    if not config.spec.ngram_assist:
        return "off (spec.ngram_assist is false)"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.spec_decode import runner_hook

    return runner_hook.install_when_imported(config.spec)


def _install_settle_accepted_state(config: Any) -> str:
    """R7 of runtime_patches/README.md: the GDN state of a decode step without drafts after
    accepted drafts (acts only in runners of hybrid models with speculative decoding)."""
    if not config.spec.settle_accepted_state:
        return "off (spec.settle_accepted_state is false)"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.spec_decode import accepted_state

    return accepted_state.install_when_imported()


def _install_exact_prefix_hits(config: Any) -> str:
    """R8 of runtime_patches/README.md: a prefix-cache hit of a hybrid model with MTP/EAGLE
    that full attention does not cover (acts only in coordinators with align GDN groups
    among the EAGLE groups)."""
    if not config.spec.exact_prefix_hits:
        return "off (spec.exact_prefix_hits is false)"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.spec_decode import prefix_state

    return prefix_state.install_when_imported()


def _install_spec_gates(config: Any) -> str:
    """R10 of runtime_patches/README.md: the gates of the speculative rows of a mixed GDN
    step (acts only on calls whose gates and queries differ in rows: steps mixing requests
    with and without drafts, or drafts and prefill chunks)."""
    if not config.spec.gather_spec_gates:
        return "off (spec.gather_spec_gates is false)"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.gdn import spec_gates

    return spec_gates.install_when_imported()


def _install_split_start_tag() -> str:
    """R9 of runtime_patches/README.md: a streamed qwen3_coder call whose `<tool_call>` comes
    in several tokens (acts in the API server, the process that streams chat answers)."""
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.tool_calls import split_start_tag

    return split_start_tag.install_when_imported()
