"""The SM70 attention backend for vLLM 0.22.1's full-attention layers (issue 22).

It subclasses TRITON_ATTN's classes so the KV page stays TRITON_ATTN's int8_per_token_head
page (vllm_patch.attention.layout; the memory plan is the stock one) and the builder's
buffers and metadata stay vLLM's. What changes:

- the KV write (`do_kv_cache_update`) is torch.ops.sm70.kv_int8_write, through strided views
  of that page;
- a step's decode rows (requests of 1..4 query tokens, MTP verification rows included: the
  builder reorders with `_init_reorder_batch_threshold(1, supports_spec_as_decode=True)`)
  run torch.ops.sm70.paged_decode; the split is decided on the CPU in `build`
  (rules.split_rows), the split count from the batch, the SM count and the driver's
  occupancy, so `forward` does no host sync and is capture-safe;
- the remaining rows (chunked prefill, extends, mixed lengths) run vLLM's own Triton
  `unified_attention` on the same cache (SM70_PREFILL_ATTENTION=triton, the default), or,
  opt-in (cutlass_fmha), torch.ops.sm70.fmha_prefill: the chunk's own K/V as the fp16
  tensors `forward` gets, the earlier context from the page through strides, the context
  lengths made on the device in `build` (no host sync in `forward`). The op reads this
  page's 260-byte rows with 4-byte loads (it picks the load width from the strides at
  launch); the builder still refuses, at start-up, a page whose strides it could not
  address (rules.check_prefill_kernel). triton stays the default until the GPU A/B
  (tests/gpu/attention/device_backend_ab.py) has passed on the FMHA route.

CUDA graphs: UNIFORM_BATCH (the GDN builder's level; ALWAYS buys nothing on this model).
A captured decode graph keeps the split count of its capture, which `build_for_cudagraph_capture`
sizes for max_model_len (the kernel's schedule reads the lengths on the device at replay).

CALLS counts Python calls per route (a CUDA graph counts once, at capture); with
`count_on_device(True)` the decode and FMHA prefill routes also add 1 to a device counter
of their own inside the step, which graph replays execute too (the A/B reads them to prove
our ops ran).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.ops.triton_unified_attention import unified_attention

from vllm_patch.attention import layout, rules
from vllm_patch.ops import kernels
from vllm_patch.ops.reference import decode_num_splits

# prefill_fmha_beside_decode: FMHA prefill calls of steps that also had decode rows
CALLS: dict[str, int] = {"kv_write": 0, "decode": 0, "prefill_triton": 0, "prefill_fmha": 0,
                         "prefill_fmha_beside_decode": 0}
# (route, device index) -> int64 counter on that device; routes "decode", "prefill_fmha"
_device_counts: dict[tuple[str, int], torch.Tensor] = {}
DEVICE_ROUTES = ("decode", "prefill_fmha")
_count_on_device = False
_lock = threading.Lock()


def count_on_device(on: bool, device: torch.device | str | None = None) -> None:
    """Also count decode and FMHA prefill launches with a device-side add (seen by
    CUDA-graph replays). The counters are made here, before any capture: made inside one,
    their zeroing would be part of the graph and every replay would reset them."""
    global _count_on_device
    _count_on_device = on
    if on:
        dev = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        with _lock:
            for route in DEVICE_ROUTES:
                _device_counts.setdefault((route, dev.index or 0),
                                          torch.zeros((), dtype=torch.int64, device=dev))


def device_count(route: str) -> int | None:
    """Launches of one route ("decode", "prefill_fmha") as the device counted them (None
    when counting is off)."""
    ts = [t for (r, _), t in _device_counts.items() if r == route]
    if not ts:
        return None
    return sum(int(t.item()) for t in ts)


def device_decode_count() -> int | None:
    """Decode launches as the device counted them (None when counting is off)."""
    return device_count("decode")


def _bump_device(device: torch.device, route: str = "decode") -> None:
    t = _device_counts.get((route, device.index or 0))
    if t is not None:  # a device count_on_device did not prepare is not counted
        t.add_(1)


def prefill_kernel() -> str:
    """SM70_PREFILL_ATTENTION as the plugin config carries it (attention.prefill_kernel)."""
    from vllm_patch.config import PluginConfig

    return rules.prefill_route(PluginConfig.from_env())


def slot_name() -> str:
    """The registry slot the plugin uses: SM70_PAGED on a patched vLLM, else CUSTOM."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return "SM70_PAGED" if hasattr(AttentionBackendEnum, "SM70_PAGED") else "CUSTOM"


@dataclasses.dataclass
class Sm70PagedMetadata(TritonAttentionMetadata):
    num_decodes: int = 0
    q_per_seq: int = 0
    num_decode_tokens: int = 0
    decode_splits: int = 1
    num_prefills: int = 0
    max_prefill_query_len: int = 0
    prefill_query_start_loc: torch.Tensor | None = None
    # set only on the FMHA route: each prefill row's tokens already in the cache
    prefill_ctx_lens: torch.Tensor | None = None


class Sm70PagedMetadataBuilder(TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        spec = vllm_config.speculative_config
        # refused here, at KV-cache set-up, not at the first verification step
        rules.decode_rows_per_seq(getattr(spec, "num_speculative_tokens", None),
                                  bool(getattr(spec, "parallel_drafting", False)))
        rules.check_heads(self.num_heads_q, self.num_heads_kv)
        self.prefill_kernel = prefill_kernel()
        rules.check_prefill_kernel(self.prefill_kernel,
                                   rules.page_strides(kv_cache_spec.block_size,
                                                       self.num_heads_kv))
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                         if torch.device(device).type == "cuda" else 1)
        self._blocks_per_sm: dict[tuple[int, str], int] = {}

    def _splits(self, max_context: int, num_decodes: int, q_per_seq: int) -> int:
        key = (q_per_seq, kernels.arch_path())
        if key not in self._blocks_per_sm:  # the driver's occupancy, asked once per shape
            self._blocks_per_sm[key] = kernels.paged_decode_blocks_per_sm(q_per_seq)
        return decode_num_splits(max_context, num_decodes, self.num_heads_kv, self.sm_count,
                                 ctas_per_sm=self._blocks_per_sm[key])

    def _with_split(self, base: TritonAttentionMetadata, common: Any,
                    max_context: int) -> Sm70PagedMetadata:
        split = rules.split_rows(common.query_start_loc_cpu.tolist(),
                                 self.reorder_batch_threshold or 1)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        m = Sm70PagedMetadata(**fields)
        m.num_decodes = split.num_decodes
        m.q_per_seq = split.q_per_seq
        m.num_decode_tokens = split.num_decode_tokens
        m.num_prefills = split.num_prefills
        m.max_prefill_query_len = split.max_prefill_query_len
        if split.num_decodes:
            m.decode_splits = self._splits(max_context, split.num_decodes, split.q_per_seq)
        if split.num_prefills:
            qsl = common.query_start_loc[split.num_decodes:] - split.num_decode_tokens
            m.prefill_query_start_loc = qsl
            if self.prefill_kernel == rules.PREFILL_FMHA:
                # on the device, without a sync: a row's context is its length less its chunk
                rows = qsl.shape[0] - 1
                q_lens = qsl[1:] - qsl[:-1]
                seq = base.seq_lens[split.num_decodes:split.num_decodes + rows]
                m.prefill_query_start_loc = qsl.to(torch.int32).contiguous()
                m.prefill_ctx_lens = (seq - q_lens).to(torch.int32).contiguous()
        return m

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Sm70PagedMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return self._with_split(base, common_attn_metadata, common_attn_metadata.max_seq_len)

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> Sm70PagedMetadata:
        base = TritonAttentionMetadataBuilder.build(self, 0, common_attn_metadata)
        # the graph replays with any lengths up to max_model_len: size the splits for that
        m = self._with_split(base, common_attn_metadata, self.max_model_len)
        # capture with one-token contexts (fast, as TRITON_ATTN does); replays read the
        # runner's real lengths from the same buffer
        m.seq_lens.fill_(1)
        return m


class Sm70PagedImpl(TritonAttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, use_alibi_sqrt: bool = False,
                 chunk_lookback: int = -1) -> None:
        problems = rules.refusals(head_size, rules.MODEL_DTYPE, kv_cache_dtype)
        extras = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                  "logits_soft_cap": logits_soft_cap or None, "sinks": sinks}
        problems += [f"{k} not supported" for k, v in extras.items() if v is not None]
        if attn_type != AttentionType.DECODER:
            problems.append(f"attention type {attn_type} not supported")
        if chunk_lookback != -1:
            problems.append(f"chunk_lookback {chunk_lookback} not supported")
        if problems:
            raise rules.AttentionConfigError("SM70_PAGED cannot serve this layer: "
                                             + "; ".join(problems))
        rules.check_heads(num_heads, num_kv_heads)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks, use_alibi_sqrt, chunk_lookback)
        self.supports_quant_query_input = False  # the decode kernel reads fp16 queries
        self._op_views: tuple[Any, ...] | None = None

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # keyed on the scale view itself: the runner drops _k_scale_cache when it rebuilds
        # the KV cache after profiling, and _ensure_scale_caches then makes a new one
        self._ensure_scale_caches(kv_cache)
        ks = self._k_scale_cache
        if self._op_views is None or self._op_views[0] is not ks:
            assert ks is not None and self._v_scale_cache is not None
            self._op_views = (ks, *layout.op_views(kv_cache, ks, self._v_scale_cache))
        return self._op_views[1:]

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        k, v, ks, vs = self._views(kv_cache)
        n = min(key.shape[0], slot_mapping.shape[0])
        kernels.kv_int8_write(key[:n], value[:n], k, v, ks, vs, slot_mapping[:n])
        CALLS["kv_write"] += 1

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Sm70PagedMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("SM70_PAGED does not fuse output quantization")
        if attn_metadata is None:  # the profiling run
            return output.fill_(0)
        m = attn_metadata
        k, v, ks, vs = self._views(kv_cache)
        nd = m.num_decode_tokens
        if m.num_decodes:
            out = kernels.paged_decode(query[:nd], k, v, ks, vs, m.block_table[:m.num_decodes],
                                       m.seq_lens[:m.num_decodes], m.q_per_seq, self.scale,
                                       m.decode_splits)
            output[:nd].copy_(out)
            CALLS["decode"] += 1
            if _count_on_device:
                _bump_device(query.device)
        if m.num_prefills and m.prefill_ctx_lens is not None:
            self._prefill_fmha(query, key, value, kv_cache, m, output)
        elif m.num_prefills:
            key_cache, value_cache = kv_cache.unbind(1)
            end = m.num_actual_tokens
            unified_attention(
                q=query[nd:end], k=key_cache, v=value_cache, out=output[nd:end],
                cu_seqlens_q=m.prefill_query_start_loc, max_seqlen_q=m.max_prefill_query_len,
                seqused_k=m.seq_lens[m.num_decodes:], max_seqlen_k=m.max_seq_len,
                softmax_scale=self.scale, causal=True, alibi_slopes=None,
                use_alibi_sqrt=False, window_size=self.sliding_window,
                block_table=m.block_table[m.num_decodes:], softcap=self.logits_soft_cap,
                q_descale=None, k_descale=None, v_descale=None,
                seq_threshold_3D=m.seq_threshold_3D,
                num_par_softmax_segments=m.num_par_softmax_segments,
                softmax_segm_output=m.softmax_segm_output,
                softmax_segm_max=m.softmax_segm_max,
                softmax_segm_expsum=m.softmax_segm_expsum, sinks=None, output_scale=None,
                mm_prefix_range=None, kv_quant_mode=self._kv_quant_mode,
                k_scale_cache=self._k_scale_cache, v_scale_cache=self._v_scale_cache,
                chunk_lookback=self.chunk_lookback, use_td=self.use_td,
            )
            CALLS["prefill_triton"] += 1
        return output

    def _prefill_fmha(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, m: Sm70PagedMetadata,
                      output: torch.Tensor) -> None:
        """The prefill rows through torch.ops.sm70.fmha_prefill: the chunk's K/V are this
        step's fp16 key/value rows (already written to the cache by do_kv_cache_update, but
        the op reads only the first ctx tokens from there)."""
        self._views(kv_cache)  # makes the scale views
        assert m.prefill_query_start_loc is not None and m.prefill_ctx_lens is not None
        kc, vc, cs, ss = layout.fmha_views(kv_cache, self._k_scale_cache, self._v_scale_cache)
        nd, end = m.num_decode_tokens, m.num_actual_tokens
        out = kernels.fmha_prefill(
            query[nd:end], key[nd:end], value[nd:end], kc, vc, self._k_scale_cache,
            self._v_scale_cache, cs, ss, m.block_table[m.num_decodes:],
            m.prefill_query_start_loc, m.prefill_ctx_lens, int(kv_cache.shape[2]),
            m.max_prefill_query_len, self.scale)
        output[nd:end].copy_(out)
        CALLS["prefill_fmha"] += 1
        if m.num_decodes:
            CALLS["prefill_fmha_beside_decode"] += 1
        if _count_on_device:
            _bump_device(query.device, "prefill_fmha")


class Sm70PagedBackend(TritonAttentionBackend):
    """fp16, int8_per_token_head KV, head size 256; TRITON_ATTN's page and block sizes
    (multiples of 16: the hybrid alignment then gives the stock 1,584-token blocks of the
    memory plan, and vLLM's Triton prefill reads the same cache)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [rules.KV_CACHE_DTYPE]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return slot_name()

    @staticmethod
    def get_impl_cls() -> type[Sm70PagedImpl]:
        return Sm70PagedImpl

    @staticmethod
    def get_builder_cls() -> type[Sm70PagedMetadataBuilder]:
        return Sm70PagedMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [rules.HEAD_SIZE]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size == rules.HEAD_SIZE

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype == rules.KV_CACHE_DTYPE

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: Any,
                               *args: Any, **kwargs: Any) -> list[str]:
        # our reasons name the value and the rule; vLLM's generic ones for the same three
        # checks would only repeat them
        generic = {"head_size not supported", "dtype not supported",
                   "kv_cache_dtype not supported"}
        theirs = super().validate_configuration(head_size, dtype, kv_cache_dtype, *args,
                                                **kwargs)
        ours = rules.refusals(head_size, str(dtype).removeprefix("torch."), kv_cache_dtype)
        return ours + [r for r in theirs if r not in generic]
