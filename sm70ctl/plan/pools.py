"""The KV cache and the Gated DeltaNet state pool on one GPU (pure).

KV, per full-attention layer, per token, per GPU: K and V for each local KV head, plus
the per-token, per-head scales of the quantised formats. vLLM's `int8_per_token_head`
keeps one fp32 scale per token and head for K and one for V, so at TP=2 with 4 KV heads:
2 x 2 x (256 B + 4 B) = 1040 B per layer (1024 B of values: 16 layers -> 16 KiB/token).

GDN state, per linear-attention layer, per sequence slot, per GPU (vLLM's
`gated_delta_net_state_shape`):
- recurrent: (value heads / TP) x key_head_dim x value_head_dim in the state dtype, and for
  int16 a float32 scale per value row: (value heads / TP) x value_head_dim x 4 B (the
  plugin's int16 pool, vllm_patch/gdn/int16_pool.py: 12 KiB per layer at TP=2);
- conv: (conv kernel - 1 + speculative tokens) x conv_dim / TP in fp16, where
  conv_dim = 2 x key_dim + value_dim (q, k and v all go through the causal conv). vLLM keeps
  one extra column per speculative token so a rejected draft can roll the conv back.

Two paths (`SERVED`, `TARGET`):
- served: what vLLM 0.22.1 allocates today (`layout_served`): its hybrid allocator, one page
  size for both kinds. The block size starts at CacheConfig's 16 (or --block-size), then
  `_align_hybrid_block_size` raises it to the smallest multiple of the backend's kernel
  block alignment whose attention page holds a GDN page, and the GDN page is padded to it.
  Layers go in groups of equal size (the smallest kind's count, or the largest when it is
  below 1.5 times that), one pool tensor per position in a group, so one block costs
  page x group size; blocks = pool // page // group size. Nothing is reserved up front:
  a request draws its attention blocks and, per GDN group, the state pages its mamba cache
  mode keeps (align: 2 + k, none: 1 + k) from the same blocks.
  With SM70_GDN_KERNEL=sm70 and SM70_GDN_STATE_DTYPE=int16 (opt-in) the plugin makes vLLM
  allocate the int16 state with its row scales, and the served path plans that page.
- target: what our plugin is designed to do (issues 22 and 23, not served yet):
  split pools (SM70_SPLIT_POOLS) reserve max_num_seqs x state_block_multiplier slots up
  front and hold KV blocks of `block_size` tokens (auto: 16) in the rest; unified (split
  off) keeps vLLM's one page size but still reserves those slots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sm70ctl.errors import Sm70Error
from sm70ctl.plan.shapes import ceil_div

# KV cache dtype -> (bytes per element, bytes of scale per token and head, for K or V)
KV_DTYPES: dict[str, tuple[float, int]] = {
    "auto": (2, 0),
    "float16": (2, 0),
    "fp16": (2, 0),
    "bfloat16": (2, 0),
    "fp8": (1, 0),
    "fp8_e4m3": (1, 0),
    "fp8_e5m2": (1, 0),
    "int8_per_token_head": (1, 4),
    "fp8_per_token_head": (1, 4),
    "int4_per_token_head": (0.5, 2),
}
STATE_DTYPES = {"fp32": 4, "float32": 4, "int16": 2, "fp16": 2, "float16": 2, "bfloat16": 2}
INT16_ROW_SCALE_BYTES = 4  # float32 per row of an int16 recurrent state
CONV_STATE_BYTES = 2  # the conv state stays in the model dtype (fp16 on V100)
AUTO_BLOCK = 16  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE
SERVED, TARGET = "served", "target"
PATHS = (SERVED, TARGET)
# Kernel block alignment per attention backend: the smallest of its
# get_supported_kernel_block_sizes() (vLLM's TRITON_ATTN and FLEX_ATTENTION: multiples of
# 16; SM70_PAGED keeps TRITON_ATTN's page and block sizes: vllm_patch/attention/README.md).
BACKEND_BLOCK_ALIGN = {"TRITON_ATTN": 16, "FLEX_ATTENTION": 16, "SM70_PAGED": 16}
# Backends vLLM 0.22.1 serves with this stack today.
SERVED_BACKENDS = ("TRITON_ATTN", "FLEX_ATTENTION", "SM70_PAGED")


def kv_bytes_per_token_layer(kv_heads_gpu: int, head_dim: int, kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPES:
        raise Sm70Error(
            f"SM70_KV_CACHE_DTYPE={kv_dtype!r} is not planned",
            hint=f"allowed: {', '.join(KV_DTYPES)}",
        )
    elem, scale = KV_DTYPES[kv_dtype]
    return int(2 * kv_heads_gpu * (head_dim * elem + scale))


@dataclass(frozen=True)
class GdnPage:
    recurrent: int
    conv: int

    @property
    def total(self) -> int:
        return self.recurrent + self.conv


def gdn_page(value_heads_gpu: int, dk: int, dv: int, conv_dim_gpu: int, kernel: int,
             spec_tokens: int, state_dtype: str) -> GdnPage:
    if state_dtype not in STATE_DTYPES:
        raise Sm70Error(
            f"SM70_GDN_STATE_DTYPE={state_dtype!r} is not planned",
            hint=f"allowed: {', '.join(STATE_DTYPES)}",
        )
    # int16 codes carry one float32 scale per stored row h[v, :] (vllm_patch/gdn/int16_pool.py:
    # a third state tensor of the page), counted with the recurrent state
    scales = value_heads_gpu * dv * INT16_ROW_SCALE_BYTES if state_dtype == "int16" else 0
    return GdnPage(
        recurrent=value_heads_gpu * dk * dv * STATE_DTYPES[state_dtype] + scales,
        conv=(kernel - 1 + spec_tokens) * conv_dim_gpu * CONV_STATE_BYTES,
    )


@dataclass(frozen=True)
class PoolLayout:
    """How one GPU's pool bytes divide into GDN state and KV."""

    mode: str  # "split" | "unified" (target path) | "served"
    pool_bytes: int
    block_size: int
    attn_layers: int
    gdn_layers: int
    kv_bytes_per_token: int  # all attention layers on this GPU
    state_bytes_per_slot: int  # all GDN layers on this GPU
    slots_per_seq: int
    slots: int
    state_pool_bytes: int
    kv_blocks: int
    kv_pool_bytes: int  # bytes actually holding KV blocks
    unused_bytes: int  # rounding left-over of the pool
    page_bytes: int = 0  # unified: one page, per layer
    layer_group: int = 0  # unified: layers per group
    num_blocks: int = 0  # unified: blocks in the pool (vLLM's KVCacheConfig.num_blocks)
    gdn_groups: int = 0  # served: GDN layer groups, each drawing its own state pages
    path: str = TARGET

    @property
    def state_pages_per_request(self) -> int:
        """Served path: the blocks one request's GDN state takes from the pool."""
        return self.gdn_groups * self.slots_per_seq if self.path == SERVED else 0

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the pool holds (the longest single sequence)."""
        groups = self._attn_groups()
        # no blocks when the state pool takes more than the pool (never negative tokens)
        blocks = max(self.kv_blocks - self.state_pages_per_request, 0)
        return (blocks // groups) * self.block_size

    @property
    def block_bytes(self) -> int:
        """Pool bytes one KV block costs (all attention layers on this GPU)."""
        if self.mode in ("unified", SERVED):
            return self.page_bytes * self.layer_group
        return self.block_size * self.kv_bytes_per_token

    @property
    def kv_region(self) -> int:
        return self.pool_bytes - self.state_pool_bytes

    def _attn_groups(self) -> int:
        if self.mode in ("unified", SERVED) and self.layer_group:
            return ceil_div(self.attn_layers, self.layer_group)
        return 1

    def blocks_for(self, tokens: int) -> int:
        """Blocks one request of `tokens` takes (served: its GDN state pages too)."""
        return (ceil_div(tokens, self.block_size) * self._attn_groups()
                + self.state_pages_per_request)

    def concurrency(self, context: int, max_num_seqs: int) -> dict[str, int]:
        """How many sequences of `context` tokens run at once, and what limits it."""
        by_kv = max(self.kv_blocks, 0) // max(1, self.blocks_for(context))
        if self.path == SERVED:  # state pages come from the same blocks, none up front
            by_state = max(self.kv_blocks, 0) // max(1, self.state_pages_per_request)
        else:
            by_state = self.slots // max(1, self.slots_per_seq)
        return {
            "context": context,
            "by_kv": by_kv,
            "by_state": by_state,
            "by_max_num_seqs": max_num_seqs,
            "sequences": min(by_kv, by_state, max_num_seqs),
        }

    def to_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "kv_tokens": self.kv_tokens,
                "state_pages_per_request": self.state_pages_per_request}


def layout_pool(pool_bytes: int, *, split: bool, block_size: int, attn_layers: int,
                kv_layer_token: int, gdn_layers: int, gdn_page_bytes: int,
                slots_per_seq: int, max_num_seqs: int) -> PoolLayout:
    """Divide `pool_bytes` into the state pool and KV blocks (negative KV when short)."""
    slots = max_num_seqs * slots_per_seq if gdn_layers else 0
    kv_tok = attn_layers * kv_layer_token
    slot_bytes = gdn_layers * gdn_page_bytes
    if split or not gdn_layers or not attn_layers:
        bs = block_size or AUTO_BLOCK
        state = slots * slot_bytes
        region = pool_bytes - state
        block_bytes = bs * kv_tok
        blocks = region // block_bytes if block_bytes else 0
        used = max(blocks, 0) * block_bytes
        return PoolLayout("split", pool_bytes, bs, attn_layers, gdn_layers, kv_tok, slot_bytes,
                          slots_per_seq, slots, state, blocks, used, pool_bytes - state - used)
    # unified: one page size per layer; layers in groups of `group`, one pool tensor per
    # group position, so a page costs page_bytes x group across the pool
    bs = block_size or AUTO_BLOCK * ceil_div(gdn_page_bytes, AUTO_BLOCK * kv_layer_token)
    page = max(bs * kv_layer_token, gdn_page_bytes)
    group = min(attn_layers, gdn_layers)
    pages = pool_bytes // (page * group)
    gdn_groups = ceil_div(gdn_layers, group)
    state_pages = slots * gdn_groups
    kv_pages = pages - state_pages
    return PoolLayout("unified", pool_bytes, bs, attn_layers, gdn_layers,
                      ceil_div(attn_layers, group) * group * kv_layer_token,
                      gdn_groups * group * page, slots_per_seq, slots,
                      state_pages * page * group, kv_pages, max(kv_pages, 0) * page * group,
                      pool_bytes - pages * page * group, page, group, pages)


def mamba_pages_per_request(mamba_cache_mode: str, spec_tokens: int) -> int:
    """State pages one request holds per GDN group (vLLM's MambaSpec.max_memory_usage_bytes):
    align keeps the running state and the last block boundary's, none only the running one,
    each with one page per speculative token."""
    if mamba_cache_mode == "align":
        return 2 + spec_tokens
    if mamba_cache_mode == "none":
        return 1 + spec_tokens
    raise Sm70Error(f"SM70_MAMBA_CACHE_MODE={mamba_cache_mode!r} is not planned",
                    hint="vLLM 0.22.1 keeps align or none for Qwen3.5")


def hybrid_block_size(block_size: int, align: int, kv_layer_token: int,
                      gdn_page_bytes: int) -> int:
    """vLLM's block size for a hybrid model (update_block_size_for_backend): --block-size
    or the default 16 (the backend's alignment when it does not take 16), raised to the
    smallest multiple of max(alignment, that size) whose attention page holds a GDN page."""
    block = block_size or (AUTO_BLOCK if AUTO_BLOCK % align == 0 else align)
    if not gdn_page_bytes or not kv_layer_token:
        return block
    step = max(align, block)
    return max(block, step * ceil_div(gdn_page_bytes, step * kv_layer_token))


def layer_group_size(attn_layers: int, gdn_layers: int) -> int:
    """Layers per KV cache group (vLLM's _get_kv_cache_groups_uniform_page_size)."""
    counts = [n for n in (attn_layers, gdn_layers) if n]
    smallest, largest = min(counts), max(counts)
    return largest if largest < smallest * 1.5 else smallest


def layout_served(pool_bytes: int, *, block_size: int, align: int, attn_layers: int,
                  kv_layer_token: int, gdn_layers: int, gdn_page_bytes: int,
                  state_pages: int) -> PoolLayout:
    """What vLLM 0.22.1 allocates for --kv-cache-memory-bytes = `pool_bytes` (the served
    path of the module doc); `state_pages` is mamba_pages_per_request's figure."""
    bs = hybrid_block_size(block_size, align, kv_layer_token, gdn_page_bytes if attn_layers
                           else 0)
    page = max(bs * kv_layer_token, gdn_page_bytes)
    group = layer_group_size(attn_layers, gdn_layers)
    blocks = pool_bytes // page // group
    attn_groups = ceil_div(attn_layers, group)
    gdn_groups = ceil_div(gdn_layers, group)
    per_request = state_pages if gdn_layers else 0
    return PoolLayout(SERVED, pool_bytes, bs, attn_layers, gdn_layers,
                      attn_groups * group * kv_layer_token, gdn_groups * group * page,
                      per_request, 0, 0, blocks, blocks * page * group,
                      pool_bytes - blocks * page * group, page, group, blocks, gdn_groups,
                      SERVED)
