"""Cross-field rules: combinations of settings that are refused, each with its reason.

Pure functions of a validated Settings object. Every rule that is broken is reported
(never just the first); each `Problem` names the variable to change, the related ones, the
rule, and what would be accepted. Most rules come from failures met on the reference
deployment (see FACTS.md).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from sm70ctl.settings.problems import Problem
from sm70ctl.settings.typed import SettingsView

GIB = 1024**3
# The coarse per-card bound; the memory plan does the exact check against real numbers.
V100_MEMORY_BYTES = 32 * GIB

Rule = Callable[[SettingsView], "Problem | None"]
RULES: list[tuple[str, Rule]] = []


def rule(rule_id: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        RULES.append((rule_id, fn))
        return fn

    return register


def _p(variable: str, value: object, rule_text: str, allowed: str, *related: str) -> Problem:
    return Problem(
        variable=variable, value=str(value), rule=rule_text, allowed=allowed, related=related
    )


def _graphs_on(s: SettingsView) -> bool:
    return s.cudagraph_mode != "none" and not s.enforce_eager


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@rule("spec-draft-graph-size")
def _spec_graph(s: SettingsView) -> Problem | None:
    """Refused: Speculative decoding with CUDA graphs on and `SM70_SPEC_TOKENS` + 1 not in
    `SM70_CUDAGRAPH_SIZES`, or, with full decode graphs, a size that is not a multiple of
    `SM70_SPEC_TOKENS` + 1 (vLLM 0.22.1 silently rounds it up: sizes count tokens).
    """
    if s.spec_method == "none" or not _graphs_on(s):
        return None
    need = s.spec_tokens + 1
    sizes = ",".join(str(x) for x in s.cudagraph_sizes)
    if need not in s.cudagraph_sizes:
        return _p(
            "SM70_SPEC_TOKENS", s.spec_tokens,
            f"draft length + 1 = {need} must be a captured CUDA-graph size "
            f"(SM70_CUDAGRAPH_SIZES={sizes}); otherwise verification steps run eagerly",
            f"add {need} to SM70_CUDAGRAPH_SIZES, or pick a draft length whose k+1 is listed",
            "SM70_CUDAGRAPH_SIZES",
        )
    # piecewise graphs take any token count; full decode graphs hold whole 1+k-token rows
    odd = [x for x in s.cudagraph_sizes if x % need]
    if s.cudagraph_mode != "piecewise" and odd:
        return _p(
            "SM70_CUDAGRAPH_SIZES", sizes,
            f"with full decode graphs and draft length {s.spec_tokens}, vLLM 0.22.1 silently "
            f"rounds capture sizes up to multiples of {need} tokens "
            f"({', '.join(map(str, odd))} would become "
            f"{', '.join(str(-(-x // need) * need) for x in odd)})",
            f"multiples of {need}, e.g. {','.join(str(need * n) for n in (1, 2, 4, 8, 16))}",
            "SM70_SPEC_TOKENS", "SM70_CUDAGRAPH_MODE",
        )
    return None


@rule("graph-sizes-within-batch")
def _graph_batch(s: SettingsView) -> Problem | None:
    """Refused: CUDA graphs on and a capture size above `SM70_MAX_NUM_BATCHED_TOKENS`
    (vLLM 0.22.1 silently drops it).
    """
    over = [x for x in s.cudagraph_sizes if x > s.max_num_batched_tokens]
    if not _graphs_on(s) or not over:
        return None
    return _p(
        "SM70_CUDAGRAPH_SIZES", ",".join(str(x) for x in s.cudagraph_sizes),
        f"vLLM 0.22.1 silently drops capture sizes above SM70_MAX_NUM_BATCHED_TOKENS="
        f"{s.max_num_batched_tokens} ({', '.join(map(str, over))})",
        f"sizes <= {s.max_num_batched_tokens}", "SM70_MAX_NUM_BATCHED_TOKENS",
    )


@rule("clef-max-model-len")
def _clef_len(s: SettingsView) -> Problem | None:
    """Refused: `SM70_CLEF` on and `SM70_CLEF_MAX_MODEL_LEN` > `SM70_MAX_MODEL_LEN`."""
    if s.clef and s.clef_max_model_len > s.max_model_len:
        return _p("SM70_CLEF_MAX_MODEL_LEN", s.clef_max_model_len,
                  "Clef context longer than SM70_MAX_MODEL_LEN",
                  f"<= SM70_MAX_MODEL_LEN ({s.max_model_len})", "SM70_MAX_MODEL_LEN")
    return None


@rule("gpu-count")
def _gpu_count(s: SettingsView) -> Problem | None:
    """Refused: The number of `SM70_GPUS` differs from `SM70_TENSOR_PARALLEL_SIZE` x
    `SM70_PIPELINE_PARALLEL_SIZE`.
    """
    want = s.tensor_parallel_size * s.pipeline_parallel_size
    if want != len(s.gpus):
        return _p(
            "SM70_GPUS", ",".join(s.gpus),
            f"lists {len(s.gpus)} GPU(s) but tensor x pipeline parallel size = "
            f"{s.tensor_parallel_size} x {s.pipeline_parallel_size} = {want}",
            f"exactly {want} GPUs, or change SM70_TENSOR_PARALLEL_SIZE / "
            "SM70_PIPELINE_PARALLEL_SIZE",
            "SM70_TENSOR_PARALLEL_SIZE", "SM70_PIPELINE_PARALLEL_SIZE",
        )
    return None


@rule("prefill-chunk")
def _prefill_chunk(s: SettingsView) -> Problem | None:
    """Refused: `SM70_PREFILL_CHUNK` > `SM70_MAX_NUM_BATCHED_TOKENS`."""
    if s.prefill_chunk > s.max_num_batched_tokens:
        return _p("SM70_PREFILL_CHUNK", s.prefill_chunk,
                  "prefill chunk larger than one scheduler step",
                  f"<= SM70_MAX_NUM_BATCHED_TOKENS ({s.max_num_batched_tokens})",
                  "SM70_MAX_NUM_BATCHED_TOKENS")
    return None


@rule("prompt-logprobs-chunk")
def _logprobs_chunk(s: SettingsView) -> Problem | None:
    """Refused: `SM70_PROMPT_LOGPROBS_CHUNK` > `SM70_MAX_NUM_BATCHED_TOKENS`."""
    if s.prompt_logprobs_chunk > s.max_num_batched_tokens:
        return _p("SM70_PROMPT_LOGPROBS_CHUNK", s.prompt_logprobs_chunk,
                  "prompt-logprobs slice larger than one scheduler step",
                  f"<= SM70_MAX_NUM_BATCHED_TOKENS ({s.max_num_batched_tokens})",
                  "SM70_MAX_NUM_BATCHED_TOKENS")
    return None


@rule("kv-fits-gpu")
def _kv_fits(s: SettingsView) -> Problem | None:
    """Refused: `SM70_KV_CACHE_BYTES` >= 32 GiB x `SM70_GPU_MEMORY_UTILIZATION` (coarse; the plan is
    exact).
    """
    budget = int(V100_MEMORY_BYTES * s.gpu_memory_utilization)
    if s.kv_cache_bytes >= budget:
        return _p(
            "SM70_KV_CACHE_BYTES", s.kv_cache_bytes,
            f"KV pool does not fit a 32 GiB V100 at utilization {s.gpu_memory_utilization} "
            "(coarse check; `sm70ctl plan` does the exact one)",
            f"< {budget} bytes ({budget / GIB:.2f} GiB)", "SM70_GPU_MEMORY_UTILIZATION",
        )
    return None


@rule("int12-needs-tp")
def _int12_tp(s: SettingsView) -> Problem | None:
    """Refused: `SM70_ALLREDUCE_MODE=int12` with `SM70_TENSOR_PARALLEL_SIZE=1`."""
    if s.allreduce_mode == "int12" and s.tensor_parallel_size < 2:
        return _p("SM70_ALLREDUCE_MODE", s.allreduce_mode,
                  "the 12-bit all-reduce exchange needs tensor parallelism (TP > 1)",
                  "auto or fp16 with SM70_TENSOR_PARALLEL_SIZE=1",
                  "SM70_TENSOR_PARALLEL_SIZE")
    return None


@rule("mamba-mode-kept")
def _mamba_mode(s: SettingsView) -> Problem | None:
    """Refused: a `SM70_MAMBA_CACHE_MODE` vLLM 0.22.1 silently replaces for Qwen3.5: `all`
    (it runs `align`; forcing `all` raises), and any mode but `align` with prefix caching or
    `none` without.
    """
    kept = "align" if s.enable_prefix_caching else "none"
    if s.mamba_cache_mode == kept:
        return None
    caching = "on" if s.enable_prefix_caching else "off"
    if s.mamba_cache_mode == "all":
        why = ("vLLM 0.22.1 has no `all` mode for Qwen3.5 (no per-block GDN state): it "
               f"silently runs `{kept}` instead, and forcing `all` raises")
    else:
        why = (f"with prefix caching {caching}, vLLM 0.22.1 silently replaces mamba cache "
               f"mode `{s.mamba_cache_mode}` by `{kept}`")
    return _p("SM70_MAMBA_CACHE_MODE", s.mamba_cache_mode, why,
              f"{kept} while SM70_ENABLE_PREFIX_CACHING is {caching}",
              "SM70_ENABLE_PREFIX_CACHING")


@rule("async-scheduling-spec")
def _async_spec(s: SettingsView) -> Problem | None:
    """Refused: `SM70_ASYNC_SCHEDULING=true` with speculative decoding (truncated generations in the
    reference).
    """
    if s.async_scheduling and s.spec_method != "none":
        return _p("SM70_ASYNC_SCHEDULING", "true",
                  "async scheduling with speculative decoding truncated generations in "
                  "the reference", "false while SM70_SPEC_METHOD is set",
                  "SM70_SPEC_METHOD")
    return None


@rule("custom-allreduce-full-graphs")
def _custom_ar(s: SettingsView) -> Problem | None:
    """Refused: `SM70_CUSTOM_ALLREDUCE=true` with a `full*` CUDA-graph mode (the IPC
    all-reduce breaks under full graphs).
    """
    if s.custom_allreduce and s.cudagraph_mode.startswith("full") and not s.enforce_eager:
        return _p("SM70_CUSTOM_ALLREDUCE", "true",
                  "vLLM's custom IPC all-reduce breaks under full CUDA graphs",
                  "false, or SM70_CUDAGRAPH_MODE=piecewise/none", "SM70_CUDAGRAPH_MODE")
    return None


@rule("public-host-needs-key")
def _host_key(s: SettingsView) -> Problem | None:
    """Refused: `SM70_HOST` is not a loopback address and `SM70_API_KEY` is empty."""
    if not is_loopback(s.host) and s.api_key is None:
        return _p("SM70_HOST", s.host,
                  "a non-loopback address exposes the API and requires SM70_API_KEY",
                  "127.0.0.1/::1/localhost, or set SM70_API_KEY", "SM70_API_KEY")
    return None


@rule("ngram-range")
def _ngram(s: SettingsView) -> Problem | None:
    """Refused: `SM70_NGRAM_MIN` > `SM70_NGRAM_MAX`."""
    if s.ngram_min > s.ngram_max:
        return _p("SM70_NGRAM_MIN", s.ngram_min, "shortest n-gram longer than the longest",
                  f"<= SM70_NGRAM_MAX ({s.ngram_max})", "SM70_NGRAM_MAX")
    return None


@rule("attention-backend-exists")
def _attention_backend(s: SettingsView) -> Problem | None:
    """Refused: `SM70_ATTENTION_BACKEND=SM70_PAGED` while the plugin has no backend class
    behind the name (`vllm_patch.attention.Sm70PagedBackend`, issue 22).
    """
    if s.attention_backend != "SM70_PAGED":
        return None
    # Reads our own package's source, not vLLM (absent here): the same test the plugin
    # makes before it registers the backend.
    from vllm_patch.plugin import ATTENTION_CLASS, attention_backend_defined

    if attention_backend_defined():
        return None
    return _p("SM70_ATTENTION_BACKEND", s.attention_backend,
              f"the plugin defines no {ATTENTION_CLASS} yet, so vLLM would fail at start-up",
              "TRITON_ATTN (vLLM's own backend) or FLEX_ATTENTION")


@rule("paged-decode-rows")
def _paged_decode_rows(s: SettingsView) -> Problem | None:
    """Refused: `SM70_ATTENTION_BACKEND=SM70_PAGED` with speculation of more draft tokens
    (`SM70_SPEC_TOKENS`) than its decode kernel verifies (1 + k query rows, at most 4).
    """
    if s.attention_backend != "SM70_PAGED" or s.spec_method == "none":
        return None
    from vllm_patch.attention.rules import MAX_DECODE_ROWS

    if s.spec_tokens + 1 <= MAX_DECODE_ROWS:
        return None
    return _p("SM70_SPEC_TOKENS", s.spec_tokens,
              f"SM70_ATTENTION_BACKEND=SM70_PAGED verifies {s.spec_tokens + 1} query rows per "
              f"sequence; its decode kernel takes at most {MAX_DECODE_ROWS}",
              f"<= {MAX_DECODE_ROWS - 1}, SM70_SPEC_METHOD=none or another backend",
              "SM70_ATTENTION_BACKEND", "SM70_SPEC_METHOD")


@rule("paged-kv-dtype")
def _paged_kv_dtype(s: SettingsView) -> Problem | None:
    """Refused: `SM70_ATTENTION_BACKEND=SM70_PAGED` with a KV cache other than
    `int8_per_token_head` (`SM70_KV_CACHE_DTYPE`), the only page its kernels read: vLLM's
    config builder accepts the pair and the engine would fail at start-up.
    """
    if s.attention_backend != "SM70_PAGED":
        return None
    from vllm_patch.attention.rules import KV_CACHE_DTYPE

    if s.kv_cache_dtype == KV_CACHE_DTYPE:
        return None
    return _p("SM70_KV_CACHE_DTYPE", s.kv_cache_dtype,
              f"SM70_ATTENTION_BACKEND=SM70_PAGED reads only the {KV_CACHE_DTYPE} KV cache",
              f"{KV_CACHE_DTYPE}, or SM70_ATTENTION_BACKEND=TRITON_ATTN",
              "SM70_ATTENTION_BACKEND")


def rules_table() -> list[tuple[str, str]]:
    """(rule id, when it refuses) for the docs."""
    return [
        (rid, " ".join((fn.__doc__ or "").removeprefix("Refused: ").split())) for rid, fn in RULES
    ]


def check_rules(settings: SettingsView, skip: frozenset[str] = frozenset()) -> list[Problem]:
    """Every broken cross-field rule; rules touching a variable in `skip` are left out
    (those variables already failed on their own and hold their defaults here)."""
    problems = []
    for _rule_id, fn in RULES:
        problem = fn(settings)
        if problem is None:
            continue
        if skip & {problem.variable, *problem.related}:
            continue
        problems.append(problem)
    return problems
