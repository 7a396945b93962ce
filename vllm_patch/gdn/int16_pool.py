"""The int16 recurrent state inside vLLM's GDN pool: what it holds and when it is on (pure).

Opt-in (issue 23 item 3; its A/B against stock passed on an H200): the plugin turns it on
only when the GDN layer is on (`gdn.decode_layer`, SM70_GDN_KERNEL=sm70 or sm70_chunk) and
`gdn.state_dtype` is int16 (SM70_GDN_STATE_DTYPE, whose default is int16).

Each GDN layer's state then is three tensors in vLLM's hybrid page instead of two:
conv state (model dtype, unchanged), recurrent codes int16 [HV, V, K] and their scales
float32 [HV, V], one per stored row h[v, :] (the scheme of reference_gdn.state_int16_quantize:
step = max|row| / 32767). The scales are a third state tensor of the same MambaSpec, not
bytes carved from the page's padding: vLLM sizes the page from the spec (so the attention
block grows to hold it and the plan can count it), lays each state tensor out at its own
offset in every page (gpu_model_runner's MambaSpec branch), and copies each one with its own
copy function when prefix caching moves a state between blocks; carved bytes would be
invisible to all three, and the padding is too small anyway (under one KiB at TP=2 against
12 KiB of scales).
"""

from __future__ import annotations

STATE_DTYPE = "int16"
SCALE_DTYPE = "float32"
SCALE_BYTES = 4
CODE_BYTES = 2
# What vLLM's own calculator must give before we replace it: the model's float32 state.
BASE_STATE_DTYPE = "float32"


def wanted(decode_layer: bool, kernel: str, state_dtype: str) -> bool:
    """Whether the plugin puts the int16 pool in place (the GDN layer on, int16 asked)."""
    return decode_layer and kernel == "sm70" and state_dtype == STATE_DTYPE


def state_shapes(conv_shape: tuple[int, ...], temporal_shape: tuple[int, ...]
                 ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(conv, codes, scales) from vLLM's (conv, recurrent) shapes: scales drop the key axis."""
    if len(temporal_shape) != 3:
        raise ValueError(f"GDN recurrent state shape {temporal_shape}: expected (HV, V, K)")
    heads, rows, _ = temporal_shape
    return tuple(conv_shape), tuple(temporal_shape), (heads, rows)


def base_dtype_problem(temporal_dtype: str) -> str | None:
    """Why vLLM's own recurrent dtype cannot be replaced by int16 codes, or None."""
    if temporal_dtype != BASE_STATE_DTYPE:
        return (f"gdn.state_dtype=int16 replaces a {BASE_STATE_DTYPE} recurrent state, but vLLM "
                f"chose {temporal_dtype} (--mamba-ssm-cache-dtype / the model's mamba_ssm_dtype); "
                "leave it at float32 or set SM70_GDN_STATE_DTYPE=float32")
    return None


def page_bytes(heads: int, rows: int, keys: int, conv_elems: int, conv_bytes: int) -> int:
    """One layer's unpadded page with the int16 pool (what MambaSpec.page_size_bytes sums)."""
    return conv_elems * conv_bytes + heads * rows * (keys * CODE_BYTES + SCALE_BYTES)


def layer_refusal(reason: str) -> str:
    """The error when a layer our ops cannot run meets the int16 pool: vLLM's kernels cannot
    read int16 codes, so there is nothing to fall back to."""
    return (f"gdn.state_dtype=int16 needs our GDN ops on every layer, but {reason}; "
            "set SM70_GDN_STATE_DTYPE=float32")
