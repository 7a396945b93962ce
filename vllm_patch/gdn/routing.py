"""Which GDN batches our ops take, and what they are given (pure: no torch, no vLLM).

vLLM 0.22.1's GDN metadata (vllm/v1/attention/backends/gdn_attn.py) sorts a step into three
kinds of rows: prefills (chunked FLA), plain decodes (one token, state slot
non_spec_state_indices_tensor[n]) and MTP verification rows (1 + k tokens, one state slot
per position in spec_state_indices_tensor[n, :], initial state at column
num_accepted_tokens[n] - 1). The two decode kinds never share a step (the builder turns
plain decodes into prefills when spec rows exist). Decode-only steps always run on our
decode ops. A step with a prefill row goes to vLLM's own path whole (FLA) unless the plugin's
`gdn.prefill` is "sm70" (SM70_GDN_KERNEL=sm70_chunk); then `prefill_plan` splits it:

- without MTP rows, the builder's batch order is plain decodes first (one token each), then
  prefills; all of them are "non-spec" rows (non_spec_query_start_loc, one state slot each
  in non_spec_state_indices_tensor, has_initial_state per row). vLLM runs the decodes
  through FLA's chunk kernel as 1-token sequences; we run them on our decode ops (the same
  recurrence on the same slot, without a 64-token chunk for one token) and the prefills
  after them on our conv1d prefill + chunked prefill, with the sequence and token offsets
  rebased past the decodes;
- with MTP rows, vLLM's index tensors gather the tokens (spec_token_indx,
  non_spec_token_indx): the MTP rows go to our decode ops exactly as in a decode-only MTP
  step, the non-spec rows (all prefills here, plain decodes included) to our prefill ops;
  zero-length padded rows sit at the back of the non-spec rows and are left out
  (num_prefills does not count them).

The chunked prefill runs two-pass when the metadata carries `chunk_indices` (FLA's table,
made by the builder on the host and copied without a sync; the two-pass op needs it to size
its first pass, and it is the faster one: docs/gdn.md); otherwise one-pass, which needs no
table (making one would cost a device sync). FLA numbers chunks by non-empty sequence,
ours by sequence: the same numbers while the empty rows are all at the back, which is how
the builder pads. The in-tree CuteDSL prefill backend (Blackwell only, opt-in) builds its
own table, so with it we take one-pass.

In full CUDA-graph steps the builder pads the index and query-start tensors to the graph's
batch with the null block (0) and empty sequences; the sequence counts it reports are the
real ones, so the ops get exactly the first `num_decodes` (or `num_spec_decodes`) rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Where a step goes.
STOCK_NO_METADATA = "stock:no_metadata"  # vLLM's warm-up / profile run
STOCK_PREFILL = "stock:prefill"  # a prefill row is in the step
STOCK_EMPTY = "stock:empty"  # no decode rows at all
STOCK_MIXED = "stock:mixed"  # plain and MTP decode rows in one step
STOCK_UNSUPPORTED = "stock:unsupported"  # the layer's shapes or dtypes (unsupported_reason)
OURS_DECODE = "sm70:decode"
OURS_SPEC = "sm70:spec"
OURS_PREFILL = "sm70:prefill"  # prefill rows (and plain decodes before them) on our ops
OURS_PREFILL_SPEC = "sm70:prefill+spec"  # prefill rows and MTP rows in one step on our ops

HEAD_DIM = 128
CONV_WIDTH = 4
MAX_STATE_COLUMNS = 8  # the recurrent kernel's 1 + k limit
SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True)
class LayerShape:
    """What the layer is, as the support rule needs it (names as vLLM's layer spells them)."""

    activation_dtype: str  # of mixed_qkv / a / b, e.g. "float16"
    ssm_state_dtype: str
    conv_state_dtype: str
    a_log_dtype: str
    dt_bias_dtype: str
    head_k_dim: int
    head_v_dim: int
    num_k_heads: int  # per GPU
    num_v_heads: int  # per GPU
    conv_kernel_size: int
    activation: str | None
    conv_state_dim_first: bool
    num_spec: int
    ssm_scale_dtype: str | None = None  # the int16 pool's row scales (None: no scales)


def unsupported_reason(s: LayerShape) -> str | None:
    """None when our ops can run this layer's decode rows; else why not, in one line."""
    if s.conv_state_dim_first:
        return "conv state in the DS layout (VLLM_SSM_CONV_STATE_LAYOUT=DS); our conv needs SD"
    if s.activation_dtype != "float16":
        return f"activations are {s.activation_dtype}; our ops take float16"
    if s.conv_state_dtype != "float16":
        return f"conv state is {s.conv_state_dtype}; our conv takes float16"
    if s.ssm_state_dtype == "int16":
        if s.ssm_scale_dtype != "float32":
            return (f"int16 recurrent state with scales {s.ssm_scale_dtype}; our op takes "
                    "float32 row scales")
    elif s.ssm_state_dtype != "float32":
        return (f"recurrent state is {s.ssm_state_dtype}; our op takes float32 or int16 "
                "with float32 row scales")
    if s.a_log_dtype != "float32":
        return f"A_log is {s.a_log_dtype}; our op takes float32"
    if s.dt_bias_dtype not in ("float32", "float16"):
        return f"dt_bias is {s.dt_bias_dtype}; our op takes float32 or float16"
    if s.head_k_dim != HEAD_DIM or s.head_v_dim != HEAD_DIM:
        return f"head sizes {s.head_k_dim}/{s.head_v_dim}; our kernels are built for 128/128"
    if s.num_k_heads < 1 or s.num_v_heads % s.num_k_heads:
        return f"{s.num_v_heads} value heads do not group over {s.num_k_heads} key heads"
    if s.conv_kernel_size != CONV_WIDTH:
        return f"conv width {s.conv_kernel_size}; our conv is width {CONV_WIDTH}"
    if s.activation is not None and s.activation not in SILU_NAMES:
        return f"activation {s.activation!r}; our conv applies SiLU or nothing"
    if 1 + s.num_spec > MAX_STATE_COLUMNS:
        return (f"{s.num_spec} speculative tokens; our kernel keeps at most "
                f"{MAX_STATE_COLUMNS} state columns")
    return None


def route(meta: Any | None, unsupported: str | None = None, prefill: str = "fla") -> str:
    """Where a step with this GDNAttentionMetadata (None: no metadata) goes; `prefill` is
    the plugin's gdn.prefill (steps with a prefill row: "fla" vLLM's path, "sm70" ours;
    the config and `layer.set_prefill` refuse any other, so a step does not check again)."""
    if meta is None:
        return STOCK_NO_METADATA
    if unsupported is not None:
        return STOCK_UNSUPPORTED
    if meta.num_prefills > 0:
        if prefill != "sm70":
            return STOCK_PREFILL
        return OURS_PREFILL if meta.spec_sequence_masks is None else OURS_PREFILL_SPEC
    if meta.spec_sequence_masks is not None:
        if meta.num_decodes > 0:  # the builder never makes this; vLLM's path would see both
            return STOCK_MIXED
        return OURS_SPEC if meta.num_spec_decodes > 0 else STOCK_EMPTY
    return OURS_DECODE if meta.num_decodes > 0 else STOCK_EMPTY


@dataclass(frozen=True)
class DecodeArgs:
    """The metadata rows one decode step hands our two ops (sliced views of vLLM's own)."""

    num_seqs: int
    query_start_loc: Any  # [num_seqs + 1] int32
    state_indices: Any  # [num_seqs] (plain) or [num_seqs, 1 + k] (MTP) int32
    num_accepted: Any | None  # [num_seqs] int32, MTP only
    num_tokens: int  # rows of mixed_qkv / a / b / core_attn_out the layer owns this step


def decode_args(meta: Any, kind: str) -> DecodeArgs:
    """Slice the metadata for a step `route` sent to OURS_DECODE or OURS_SPEC."""
    if kind == OURS_DECODE:
        n = int(meta.num_decodes)
        return DecodeArgs(n, meta.non_spec_query_start_loc[: n + 1],
                          meta.non_spec_state_indices_tensor[:n], None,
                          int(meta.num_actual_tokens))
    if kind == OURS_SPEC:
        n = int(meta.num_spec_decodes)
        return DecodeArgs(n, meta.spec_query_start_loc[: n + 1],
                          meta.spec_state_indices_tensor[:n], meta.num_accepted_tokens[:n],
                          int(meta.num_actual_tokens))
    raise ValueError(f"decode_args takes {OURS_DECODE} or {OURS_SPEC}, got {kind!r}")


@dataclass(frozen=True)
class PrefillPlan:
    """How a step `route` sent to OURS_PREFILL or OURS_PREFILL_SPEC is split (host ints).

    Non-spec rows are numbered as vLLM's non-spec tensors number them; their tokens are
    the first tokens of the step (no MTP rows) or gathered by non_spec_token_indx."""

    num_decodes: int  # plain decode rows at the front of the non-spec rows: our decode ops
    num_prefills: int  # non-spec rows num_decodes .. num_decodes + num_prefills: prefill ops
    # their tokens, right after the decodes' num_decodes tokens; without MTP rows vLLM's
    # count includes the padded tail of the step (rows past the last sequence, which the
    # ops leave alone)
    prefill_tokens: int
    num_spec: int  # MTP rows (0 without): our decode ops on the spec_token_indx tokens
    gathered: bool  # tokens gathered by vLLM's index tensors (MTP rows in the step)
    two_pass: bool  # vLLM's chunk table is there and in FLA's numbering
    num_tokens: int  # rows of the layer's tensors this step (num_actual_tokens)

    @property
    def first_prefill_token(self) -> int:
        """Where the prefill rows' tokens start in the non-spec token stream (each plain
        decode row is one token)."""
        return self.num_decodes

    @property
    def chunk_rows_skipped(self) -> int:
        """Rows of vLLM's chunk table that belong to the decode rows (one chunk each)."""
        return self.num_decodes


def prefill_plan(meta: Any, kind: str, prefill_backend: str = "triton") -> PrefillPlan:
    """Split a step with a prefill row between our decode and prefill ops; prefill_backend
    is vLLM's resolved GDN prefill backend (the layer's `gdn_prefill_backend`)."""
    if kind not in (OURS_PREFILL, OURS_PREFILL_SPEC):
        raise ValueError(f"prefill_plan takes {OURS_PREFILL} or {OURS_PREFILL_SPEC}, "
                         f"got {kind!r}")
    gathered = kind == OURS_PREFILL_SPEC
    num_decodes = 0 if gathered else int(meta.num_decodes)
    if gathered and int(meta.num_decodes):  # the builder reclassifies them as prefills
        raise ValueError("a step with MTP rows reports plain decode rows; vLLM 0.22.1's "
                         "builder never makes one")
    return PrefillPlan(
        num_decodes=num_decodes,
        num_prefills=int(meta.num_prefills),
        prefill_tokens=int(meta.num_prefill_tokens),
        num_spec=int(meta.num_spec_decodes) if gathered else 0,
        gathered=gathered,
        two_pass=meta.chunk_indices is not None and prefill_backend != "cutedsl",
        num_tokens=int(meta.num_actual_tokens),
    )
