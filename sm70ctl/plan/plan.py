"""The memory plan: `compute_plan(model, inputs, gpus) -> Plan`, every item in bytes (pure).

Per GPU, in allocation order: CUDA context, weights (by tensor class), Clef's correction and
head, workspaces, allocator reserve, then the pool (GDN state + KV). The budget is
floor(total x SM70_GPU_MEMORY_UTILIZATION). The pool is SM70_KV_CACHE_BYTES when set, else
whatever the budget leaves. The plan fits when every GPU's items stay inside its budget, the
state pool fits in the pool and the KV left holds SM70_MAX_MODEL_LEN tokens; otherwise it
names the first item that overflows and by how many bytes, and says what does fit.

The pool follows one of two paths (pools.py): `served` (the default), what vLLM 0.22.1
allocates with the code that runs today (its hybrid allocator, the model's GDN state dtype,
the attention backend's block alignment), or `target`, the design the not-yet-served
settings describe (SM70_GDN_STATE_DTYPE, SM70_SPLIT_POOLS, SM70_STATE_BLOCK_MULTIPLIER).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.plan import clef as clef_mod
from sm70ctl.plan.model_checks import check_parallel
from sm70ctl.plan.model_config import FULL, ModelShape
from sm70ctl.plan.pools import (
    BACKEND_BLOCK_ALIGN,
    PATHS,
    SERVED,
    SERVED_BACKENDS,
    STATE_DTYPES,
    GdnPage,
    PoolLayout,
    gdn_page,
    kv_bytes_per_token_layer,
    layout_pool,
    layout_served,
    mamba_pages_per_request,
)
from sm70ctl.plan.shapes import kv_heads_per_gpu, pp_layer_ranges, stage_tensors
from sm70ctl.plan.weights import WeightOptions, by_class
from sm70ctl.plan.workspaces import WorkspaceInputs, workspace_items
from sm70ctl.settings.typed import SettingsView

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class PlanInputs:
    """The settings the plan reads; defaults are the reference deployment (FACTS.md)."""

    tensor_parallel_size: int = 2
    pipeline_parallel_size: int = 1
    max_model_len: int = 262_144
    kv_cache_bytes: int = 10_630_627_328
    kv_cache_dtype: str = "int8_per_token_head"
    gpu_memory_utilization: float = 0.96
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 2048  # vLLM's --long-prefill-token-threshold
    block_size: int = 0
    state_block_multiplier: int = 8
    gdn_state_dtype: str = "int16"
    gdn_kernel: str = "triton"  # sm70 / sm70_chunk with gdn_state_dtype int16: the int16 pool
    split_pools: bool = True
    allocator_reserve: int = 256 * MiB
    cuda_context_reserve: int = 512 * MiB
    int8_lm_head: bool = True
    attn_weights_12bit: bool = False
    clef: bool = False
    clef_rank: int = 256
    prompt_logprobs_chunk: int = 256
    max_logprobs: int = 20
    cudagraph_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)
    allreduce_buffer_bytes: int = 16 * MiB
    decode_max_splits: int = 64
    draft_head_dtype: str = "int8"
    spec_tokens: int = 3
    spec_method: str = "mtp"
    gdn_chunk_size: int = 64
    enforce_eager: bool = False
    limit_images: int = 20
    limit_videos: int = 2
    quantization: str = "gptq"
    path: str = SERVED  # which pool path the plan describes (pools.py)
    mamba_cache_mode: str = "align"
    attention_backend: str = "SM70_PAGED"
    model_dir: Path | None = None  # SM70_MODEL_DIR: its config.json is planned when present

    @property
    def vision(self) -> bool:
        """vLLM leaves the vision encoder out when every modality's limit is 0."""
        return self.limit_images > 0 or self.limit_videos > 0

    @classmethod
    def from_settings(cls, settings: SettingsView, **overrides: Any) -> PlanInputs:
        """Take every field the settings object has (attribute = variable name lower-cased
        without SM70_); fields it lacks keep their reference defaults."""
        values: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if hasattr(settings, name):
                values[name] = getattr(settings, name)
        if "cudagraph_sizes" in values:
            values["cudagraph_sizes"] = _int_tuple(values["cudagraph_sizes"])
        for key in ("kv_cache_dtype", "gdn_state_dtype", "gdn_kernel", "draft_head_dtype",
                    "spec_method",
                    "quantization", "mamba_cache_mode"):
            if key in values:
                values[key] = str(getattr(values[key], "value", values[key])).lower()
        if "attention_backend" in values:
            backend = values["attention_backend"]
            values["attention_backend"] = str(getattr(backend, "value", backend)).upper()
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def validate(self) -> None:
        def bad(var: str, value: Any, rule: str) -> Sm70Error:
            return Sm70Error(f"SM70_{var.upper()}={value!r}: {rule}")

        for var in ("tensor_parallel_size", "pipeline_parallel_size", "max_model_len",
                    "max_num_seqs", "max_num_batched_tokens", "prefill_chunk",
                    "state_block_multiplier",
                    "gdn_chunk_size"):
            if getattr(self, var) < 1:
                raise bad(var, getattr(self, var), "must be at least 1")
        for var in ("kv_cache_bytes", "block_size", "allocator_reserve", "cuda_context_reserve",
                    "prompt_logprobs_chunk", "max_logprobs", "allreduce_buffer_bytes",
                    "decode_max_splits", "spec_tokens", "clef_rank"):
            if getattr(self, var) < 0:
                raise bad(var, getattr(self, var), "must not be negative")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.draft_head_dtype not in ("fp16", "float16", "int8", "int4"):
            raise bad("draft_head_dtype", self.draft_head_dtype, "allowed: float16, int8, int4")
        if self.gdn_state_dtype not in STATE_DTYPES:
            raise bad("gdn_state_dtype", self.gdn_state_dtype,
                      f"allowed: {', '.join(STATE_DTYPES)}")
        if self.path not in PATHS:
            raise Sm70Error(f"plan path {self.path!r} is not known",
                            hint=f"allowed: {', '.join(PATHS)}")
        if self.attention_backend not in BACKEND_BLOCK_ALIGN:
            raise bad("attention_backend", self.attention_backend,
                      f"allowed: {', '.join(BACKEND_BLOCK_ALIGN)}")
        if self.block_size % BACKEND_BLOCK_ALIGN[self.attention_backend]:
            raise bad("block_size", self.block_size,
                      f"{self.attention_backend} takes multiples of "
                      f"{BACKEND_BLOCK_ALIGN[self.attention_backend]} tokens")

    @property
    def speculative(self) -> int:
        """Draft tokens per step (0 when speculative decoding is off)."""
        return self.spec_tokens if self.spec_method not in ("", "none", "off") else 0


def _int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        return tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int


@dataclass
class PlanItem:
    section: str  # weights | clef | workspace | reserve | pool
    key: str
    label: str
    bytes: int
    detail: dict[str, Any] = field(default_factory=dict)


# What an overflow is about: the items pass the budget ("budget"), the GDN state pool
# does not fit in the pool ("state"), or the KV left does not hold SM70_MAX_MODEL_LEN
# ("kv"). Only the last leaves a real pool whose figures can be reported.
BUDGET, STATE, KV = "budget", "state", "kv"


@dataclass
class Overflow:
    gpu: int
    item: str
    by_bytes: int
    message: str
    kind: str = BUDGET


@dataclass
class GpuPlan:
    gpu: Gpu
    stage: int
    tp_rank: int
    budget: int
    items: list[PlanItem]
    layout: PoolLayout
    fixed_bytes: int
    pool_available: int  # what the budget leaves for the pool after the fixed items
    overflow: Overflow | None
    kv_needed_bytes: int  # pool bytes of KV one SM70_MAX_MODEL_LEN sequence takes

    @property
    def weights_bytes(self) -> int:
        return sum(i.bytes for i in self.items if i.section == "weights")

    @property
    def used_bytes(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def free_bytes(self) -> int:
        return self.budget - self.used_bytes


@dataclass
class Plan:
    model: ModelShape
    inputs: PlanInputs
    gpus: list[GpuPlan]
    context: int
    warnings: list[str]
    kv_bytes_per_token_layer: int
    gdn_page: GdnPage | None
    gdn_state_dtype: str = ""  # the recurrent state dtype the pool holds

    @property
    def overflow(self) -> Overflow | None:
        return next((g.overflow for g in self.gpus if g.overflow), None)

    @property
    def fits(self) -> bool:
        return self.overflow is None

    @property
    def within_budget(self) -> bool:
        """Every GPU's items, the pool included, stay inside its budget: the pool exists,
        so what it holds is a real figure even when SM70_MAX_MODEL_LEN does not fit."""
        return not any(g.overflow and g.overflow.kind == BUDGET for g in self.gpus)

    @property
    def longest_sequence(self) -> int:
        """Tokens of the longest single sequence; 0 when the plan passes the budget (a pool
        that cannot be allocated holds nothing)."""
        if not self.within_budget:
            return 0
        return min(g.layout.kv_tokens for g in self.gpus)

    def concurrency(self, context: int) -> dict[str, int]:
        per = [g.layout.concurrency(context, self.inputs.max_num_seqs) for g in self.gpus]
        worst = min(per, key=lambda c: c["sequences"])
        if not self.within_budget:
            return {**worst, "by_kv": 0, "by_state": 0, "sequences": 0}
        return worst


def _stage_kinds(m: ModelShape, layers: range) -> set[str]:
    return {"full" if m.layer_types[i] == FULL else "linear" for i in layers}


def compute_plan(model: ModelShape, inputs: PlanInputs, gpus: list[Gpu],
                 context: int | None = None) -> Plan:
    """The byte-exact plan of `model` under `inputs` on `gpus` (pure)."""
    inputs.validate()
    tp, pp = inputs.tensor_parallel_size, inputs.pipeline_parallel_size
    if len(gpus) < tp * pp:
        raise Sm70Error(
            f"{len(gpus)} GPU(s) given, but SM70_TENSOR_PARALLEL_SIZE={tp} x "
            f"SM70_PIPELINE_PARALLEL_SIZE={pp} needs {tp * pp}",
            hint=f"give --gpus {tp * pp}x32GiB or lower the parallel sizes",
        )
    check_parallel(model, tp, pp)
    warnings: list[str] = list(model.warnings) + _quantization_warnings(model, inputs)
    state_dtype = (served_state_dtype(model, inputs) if inputs.path == SERVED
                   else inputs.gdn_state_dtype)
    if model.linear_layers:
        warnings += path_warnings(inputs, state_dtype)
    spec = inputs.speculative
    # n-gram drafting keeps the conv-state columns for rollback but loads no MTP layer
    mtp = inputs.spec_method == "mtp" and spec > 0 and model.mtp_num_hidden_layers > 0
    opts = WeightOptions(inputs.int8_lm_head, inputs.attn_weights_12bit, inputs.draft_head_dtype,
                         served=inputs.path == SERVED)
    # the plugin makes its int8 lm_head only in a model served by sm70_gptq
    int8_head = inputs.int8_lm_head and model.quant is not None
    ranges = pp_layer_ranges(model.num_layers, pp)
    # One forward pass carries up to SM70_MAX_NUM_BATCHED_TOKENS tokens (several short
    # prefills and decodes together); the prefill chunk only caps one prompt's share.
    tokens = inputs.max_num_batched_tokens
    sizes = () if inputs.enforce_eager else inputs.cudagraph_sizes
    ws_in = WorkspaceInputs(
        tp, pp, tokens, inputs.max_num_seqs, spec, inputs.max_logprobs,
        inputs.prompt_logprobs_chunk, sizes, inputs.allreduce_buffer_bytes,
        inputs.decode_max_splits, inputs.gdn_chunk_size, inputs.cuda_context_reserve,
        inputs.allocator_reserve, int8_weights=model.quant is not None,
        int16_state=state_dtype == "int16")
    kv_layer_tok = kv_bytes_per_token_layer(kv_heads_per_gpu(model, tp), model.head_dim,
                                            inputs.kv_cache_dtype)
    page = None
    if model.linear_layers:
        page = gdn_page(model.linear_num_value_heads // tp, model.linear_key_head_dim,
                        model.linear_value_head_dim, model.gdn_conv_dim // tp,
                        model.linear_conv_kernel_dim, spec, state_dtype)

    plans: list[GpuPlan] = []
    for stage, layers in enumerate(ranges):
        last = stage == pp - 1
        items: list[PlanItem] = []
        tensors = stage_tensors(model, tp, pp, stage, mtp=mtp, int8_lm_head=int8_head,
                                vision=inputs.vision)
        stage_warn: list[str] = []
        for c in by_class(tensors, model.quant, opts, stage_warn):
            items.append(PlanItem("weights", f"weights.{c.cls}", c.label, c.total,
                                  {"parts": c.parts, "formats": c.formats, "tensors": c.tensors}))
        warnings += [w for w in stage_warn if w not in warnings]
        if inputs.clef:
            for key, label, b, detail in clef_mod.clef_items(model, tp, layers, last,
                                                             inputs.clef_rank):
                items.append(PlanItem("clef", key, label, b, detail))
        kinds = _stage_kinds(model, layers)
        attn = sum(1 for i in layers if model.layer_types[i] == FULL)
        attn += model.mtp_num_hidden_layers if (mtp and last) else 0
        gdn = sum(1 for i in layers if model.layer_types[i] != FULL)
        for it in workspace_items(model, ws_in, kinds=kinds, last=last, has_attention=attn > 0):
            section = "reserve" if it.key in ("cuda_context", "allocator") else "workspace"
            items.append(PlanItem(section, it.key, it.label, it.bytes, it.detail))
        budget_of = {g.index: math.floor(g.total_bytes * inputs.gpu_memory_utilization)
                     for g in gpus}
        for tp_rank in range(tp):
            gpu = gpus[stage * tp + tp_rank]
            budget = budget_of[gpu.index]
            plans.append(_gpu_plan(gpu, stage, tp_rank, budget, items, inputs, attn, gdn,
                                   kv_layer_tok, page.total if page else 0))
    return Plan(model, inputs, plans, context or inputs.max_model_len, warnings,
                kv_layer_tok, page, state_dtype if page else "")


def _quantization_warnings(model: ModelShape, inputs: PlanInputs) -> list[str]:
    """The checkpoint's quantization_config decides the weights; SM70_QUANTIZATION only
    decides vLLM's --quantization flag, so say when the two disagree."""
    if inputs.quantization == "gptq" and model.quant is None:
        return ["SM70_QUANTIZATION=gptq, but the model config has no quantization_config: "
                "vLLM refuses a 16-bit checkpoint with --quantization gptq (set "
                "SM70_QUANTIZATION=none); planned as 16-bit"]
    if inputs.quantization == "none" and model.quant is not None:
        return ["SM70_QUANTIZATION=none, but the model config has a GPTQ "
                "quantization_config: vLLM still loads it as GPTQ; planned as GPTQ"]
    return []


def served_state_dtype(model: ModelShape, inputs: PlanInputs | None = None) -> str:
    """The GDN recurrent state dtype vLLM 0.22.1 allocates: int16 when the plugin's int16
    pool is on (SM70_GDN_KERNEL=sm70 or sm70_chunk with SM70_GDN_STATE_DTYPE=int16: the
    plugin's own rule, vllm_patch/gdn/int16_pool.wanted), else the model config's
    mamba_ssm_dtype (Qwen3.5's `float32`), else the model dtype (float16 on Volta)."""
    from vllm_patch.config import GDN_KERNEL_SETTING
    from vllm_patch.gdn.int16_pool import wanted

    if inputs is not None and inputs.gdn_kernel in GDN_KERNEL_SETTING:
        kernel, decode_layer, _ = GDN_KERNEL_SETTING[inputs.gdn_kernel]
        if wanted(decode_layer, kernel, inputs.gdn_state_dtype):
            return "int16"
    return model.mamba_ssm_dtype or "float16"


def path_warnings(inputs: PlanInputs, state_dtype: str) -> list[str]:
    """What the served path leaves out of the settings, said once."""
    if inputs.path != SERVED:
        return [f"plan path `target`: SM70_GDN_STATE_DTYPE={inputs.gdn_state_dtype}, "
                f"SM70_SPLIT_POOLS={str(inputs.split_pools).lower()} and "
                f"SM70_STATE_BLOCK_MULTIPLIER={inputs.state_block_multiplier} as our plugin "
                "is designed to use them (issue 23); vLLM 0.22.1 does not allocate this "
                "today (the default path `served` says what it does)"]
    unserved = []
    if inputs.gdn_state_dtype != state_dtype:
        # int16 is served only by the plugin's GDN layer (SM70_GDN_KERNEL=sm70 / sm70_chunk)
        unserved.append(f"SM70_GDN_STATE_DTYPE={inputs.gdn_state_dtype} with "
                        f"SM70_GDN_KERNEL={inputs.gdn_kernel} (vLLM's GDN kernels read "
                        "float32 only; SM70_GDN_KERNEL=sm70 or sm70_chunk serves int16)")
    if inputs.split_pools:
        unserved.append("SM70_SPLIT_POOLS=true (a design beyond vLLM 0.22.1's one pool)")
    out = []
    if unserved:
        out.append(f"plan path `served` (what vLLM 0.22.1 allocates today): "
                   f"{' and '.join(unserved)} not served, so the state is "
                   f"{state_dtype}, drawn with the KV from vLLM's one pool, and "
                   "SM70_STATE_BLOCK_MULTIPLIER has no effect; `sm70ctl plan --path target` "
                   "plans the design")
    if inputs.attention_backend not in SERVED_BACKENDS:
        out.append(f"SM70_ATTENTION_BACKEND={inputs.attention_backend} is not served yet "
                   "(issue 22: vLLM refuses it at start-up); planned with its "
                   f"{BACKEND_BLOCK_ALIGN[inputs.attention_backend]}-token kernel block")
    return out


def _layout(pool: int, inputs: PlanInputs, attn: int, gdn: int, kv_layer_tok: int,
            page: int, seqs: int) -> PoolLayout:
    if inputs.path == SERVED:
        return layout_served(
            pool, block_size=inputs.block_size,
            align=BACKEND_BLOCK_ALIGN[inputs.attention_backend], attn_layers=attn,
            kv_layer_token=kv_layer_tok, gdn_layers=gdn, gdn_page_bytes=page,
            state_pages=mamba_pages_per_request(inputs.mamba_cache_mode, inputs.speculative))
    return layout_pool(pool, split=inputs.split_pools, block_size=inputs.block_size,
                       attn_layers=attn, kv_layer_token=kv_layer_tok, gdn_layers=gdn,
                       gdn_page_bytes=page, slots_per_seq=inputs.state_block_multiplier,
                       max_num_seqs=seqs)


def _gpu_plan(gpu: Gpu, stage: int, tp_rank: int, budget: int, stage_items: list[PlanItem],
              inputs: PlanInputs, attn: int, gdn: int, kv_layer_tok: int,
              page: int) -> GpuPlan:
    items = [PlanItem(i.section, i.key, i.label, i.bytes, i.detail) for i in stage_items]
    fixed = sum(i.bytes for i in items)
    available = budget - fixed
    pool = inputs.kv_cache_bytes or max(available, 0)
    layout = _layout(pool, inputs, attn, gdn, kv_layer_tok, page, inputs.max_num_seqs)
    _check_align_block(layout, inputs)
    if layout.mode == SERVED:  # vLLM reserves no state: each request draws its pages
        items.append(PlanItem("pool", "pool.state", "GDN state pool (none reserved: pages "
                              "drawn per request from the blocks below)", 0,
                              {"pages_per_request": layout.state_pages_per_request,
                               "bytes_per_page_group": layout.page_bytes * layout.layer_group}))
    else:
        items.append(PlanItem("pool", "pool.state", "GDN state pool", layout.state_pool_bytes,
                              {"slots": layout.slots,
                               "bytes_per_slot": layout.state_bytes_per_slot}))
    items.append(PlanItem("pool", "pool.kv", "KV cache pool", pool - layout.state_pool_bytes,
                          {"tokens": layout.kv_tokens, "blocks": layout.kv_blocks,
                           "block_size": layout.block_size,
                           "bytes_per_token": layout.kv_bytes_per_token}))
    overflow = _overflow(gpu, items, budget, layout, inputs)
    kv_needed = layout.blocks_for(inputs.max_model_len) * layout.block_bytes
    return GpuPlan(gpu, stage, tp_rank, budget, items, layout, fixed, available, overflow,
                   kv_needed)


def _check_align_block(layout: PoolLayout, inputs: PlanInputs) -> None:
    """vLLM 0.22.1 stops at start-up (VllmConfig.validate_block_size) when `align` mode's
    block, which the GDN page makes large, is longer than a step or a prefill chunk: a block
    boundary must fall inside every scheduled chunk for its state to be kept."""
    if layout.mode != SERVED or inputs.mamba_cache_mode != "align" or not layout.gdn_layers:
        return
    for var, value in (("SM70_MAX_NUM_BATCHED_TOKENS", inputs.max_num_batched_tokens),
                       ("SM70_PREFILL_CHUNK", inputs.prefill_chunk)):
        if value < layout.block_size:
            raise Sm70Error(
                f"{var}={value}: below the {layout.block_size:,}-token KV block vLLM 0.22.1 "
                "sets for this model, which SM70_MAMBA_CACHE_MODE=align requires it to hold "
                "(vLLM stops at start-up)",
                hint=f"set {var} to at least {layout.block_size}, or turn prefix caching off "
                     "(SM70_ENABLE_PREFIX_CACHING=false, SM70_MAMBA_CACHE_MODE=none)")


def _overflow(gpu: Gpu, items: list[PlanItem], budget: int, layout: PoolLayout,
              inputs: PlanInputs) -> Overflow | None:
    total = 0
    for it in items:
        total += it.bytes
        if total > budget:
            return Overflow(gpu.index, it.label, total - budget,
                            f"GPU {gpu.index}: {it.label} overflows the budget "
                            f"(SM70_GPU_MEMORY_UTILIZATION={inputs.gpu_memory_utilization} of "
                            f"{gpu.total_bytes:,} B = {budget:,} B) by {total - budget:,} B")
    if layout.state_pool_bytes > layout.pool_bytes:
        by = layout.state_pool_bytes - layout.pool_bytes
        return Overflow(gpu.index, "GDN state pool", by,
                        f"GPU {gpu.index}: GDN state pool ({layout.slots} slots) needs "
                        f"{layout.state_pool_bytes:,} B, the pool has {layout.pool_bytes:,} B: "
                        f"short by {by:,} B", STATE)
    need_blocks = layout.blocks_for(inputs.max_model_len)
    if layout.kv_blocks < need_blocks:
        need = need_blocks * layout.block_bytes
        by = need - layout.kv_region
        return Overflow(gpu.index, "KV cache pool", by,
                        f"GPU {gpu.index}: KV cache pool holds {layout.kv_tokens:,} tokens, "
                        f"SM70_MAX_MODEL_LEN={inputs.max_model_len:,} needs "
                        f"{need:,} B of KV, {layout.kv_region:,} B left after the state pool: "
                        f"short by {by:,} B", KV)
    return None


# Relaxations tried, in order, when a plan does not fit: each keeps the ones before it.
RELAXATIONS: list[tuple[str, dict[str, Any]]] = [
    ("as configured, pool = what the budget leaves", {"kv_cache_bytes": 0}),
    ("no logprobs", {"max_logprobs": 0}),
    ("text only (no vision tower)", {"limit_images": 0, "limit_videos": 0}),
    ("no speculative decoding (no MTP layer)", {"spec_method": "none"}),
    ("one sequence, one state slot", {"max_num_seqs": 1, "state_block_multiplier": 1}),
]
# What a path ignores is never offered as a relaxation (the served path reserves no state
# slots, so SM70_STATE_BLOCK_MULTIPLIER changes nothing there).
_IGNORED = {SERVED: {"state_block_multiplier"}}
_SERVED_LABELS = {"one sequence, one state slot": "one sequence"}
_ENV = {"kv_cache_bytes": "SM70_KV_CACHE_BYTES", "max_logprobs": "SM70_MAX_LOGPROBS",
        "limit_images": "SM70_LIMIT_IMAGES", "limit_videos": "SM70_LIMIT_VIDEOS",
        "spec_method": "SM70_SPEC_METHOD", "spec_tokens": "SM70_SPEC_TOKENS",
        "max_num_seqs": "SM70_MAX_NUM_SEQS",
        "state_block_multiplier": "SM70_STATE_BLOCK_MULTIPLIER"}


def what_fits(model: ModelShape, inputs: PlanInputs, gpus: list[Gpu]) -> list[dict[str, Any]]:
    """The longest single sequence after each relaxation in turn, until one holds
    SM70_MAX_MODEL_LEN; each step names the settings it changes (SM70_KV_CACHE_BYTES=0
    means: let the pool take what the budget leaves).

    Each row's figures are those of the plan with exactly the row's settings applied (the
    state slots of every SM70_MAX_NUM_SEQS sequence reserved), so setting them and
    SM70_MAX_MODEL_LEN to the row's longest sequence gives a plan that fits."""
    steps: list[dict[str, Any]] = []
    changes: dict[str, Any] = {}
    ignored = _IGNORED.get(inputs.path, set())
    for label, change in RELAXATIONS:
        if inputs.path == SERVED:
            label = _SERVED_LABELS.get(label, label)
        changes.update({k: v for k, v in change.items() if k not in ignored})
        trial = compute_plan(model, replace(inputs, **changes), gpus)
        steps.append({
            "step": label,
            "settings": {_ENV[k]: v for k, v in changes.items()},
            "pool_bytes": min(g.layout.pool_bytes for g in trial.gpus),
            "longest_sequence": trial.longest_sequence,
            "holds_max_model_len": trial.fits,
        })
        if trial.fits:
            break
    return steps
