"""What vLLM and our kernels require of a model before any of the plan's arithmetic (pure).

`check_model` holds the rules of the model alone (attention heads a multiple of the KV
heads, GDN value heads a multiple of the key heads, head sizes the attention backends
take); `check_parallel` those of the model under SM70_TENSOR_PARALLEL_SIZE and
SM70_PIPELINE_PARALLEL_SIZE, as vLLM applies them when it shards the layers: a model vLLM
would refuse to load is refused here too, with the setting, the value and the rule.
Upper bounds on every count (`FIELD_MAX`) are read by the config parser, so an absurd
config (10^8 layers) is refused before anything is built from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm70ctl.errors import Sm70Error

if TYPE_CHECKING:
    from sm70ctl.plan.model_config import ModelShape

# Far above any published model, far below what makes the plan slow or large: a config
# past one of these is a mistake or a hostile file, not a model to plan.
MAX_LAYERS = 1024
FIELD_MAX: dict[str, int] = {
    "num_hidden_layers": MAX_LAYERS,
    "mtp_num_hidden_layers": 64,
    "depth": MAX_LAYERS,  # vision tower blocks
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "num_heads": 1024,
    "linear_num_key_heads": 1024,
    "linear_num_value_heads": 1024,
    "head_dim": 1024,
    "linear_key_head_dim": 1024,
    "linear_value_head_dim": 1024,
    "linear_conv_kernel_dim": 64,
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "out_hidden_size": 1 << 20,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 30,
    "num_position_embeddings": 1 << 24,
    "in_channels": 64,
    "patch_size": 1024,
    "temporal_patch_size": 64,
    "spatial_merge_size": 64,
    "full_attention_interval": MAX_LAYERS,
}
# TRITON_ATTN, the attention backend vLLM uses on Volta, takes head sizes from 32 up
MIN_HEAD_DIM = 32


def check_model(m: ModelShape, where: str) -> None:
    """The rules of the model alone; `where` is the config's key prefix (text_config.)."""
    if m.num_attention_heads % m.num_key_value_heads:
        raise Sm70Error(
            f"model config: `{where}num_attention_heads` = {m.num_attention_heads} is not a "
            f"multiple of `{where}num_key_value_heads` = {m.num_key_value_heads}: grouped-query "
            "attention shares each KV head among a whole number of query heads")
    if m.full_layers and m.head_dim < MIN_HEAD_DIM:
        raise Sm70Error(
            f"model config: `{where}head_dim` = {m.head_dim} is below {MIN_HEAD_DIM}, the "
            "smallest head size vLLM's Triton attention backend (the one Volta runs) takes")
    if m.linear_layers and m.linear_num_value_heads % m.linear_num_key_heads:
        raise Sm70Error(
            f"model config: `{where}linear_num_value_heads` = {m.linear_num_value_heads} is "
            f"not a multiple of `{where}linear_num_key_heads` = {m.linear_num_key_heads}: "
            "Gated DeltaNet shares each key head among a whole number of value heads")


def _shards(tp: int, what: str, n: int, key: str) -> None:
    if n % tp:
        raise Sm70Error(
            f"SM70_TENSOR_PARALLEL_SIZE={tp}: the model's {n} {what} (`{key}`) are not "
            f"divisible by {tp}; vLLM splits them evenly across the GPUs",
            hint=f"set SM70_TENSOR_PARALLEL_SIZE to a divisor of {n}")


def check_parallel(m: ModelShape, tp: int, pp: int) -> None:
    """vLLM's sharding rules for `m` at TP = `tp`, PP = `pp`."""
    _shards(tp, "attention heads", m.num_attention_heads, "num_attention_heads")
    kv = m.num_key_value_heads
    # fewer KV heads than GPUs: each is copied to tp / kv GPUs, which must be whole
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise Sm70Error(
            f"SM70_TENSOR_PARALLEL_SIZE={tp}: the model's {kv} KV heads "
            f"(`num_key_value_heads`) can be neither split evenly across {tp} GPUs nor "
            f"copied a whole number of times to them; vLLM refuses this",
            hint=f"set SM70_TENSOR_PARALLEL_SIZE to a divisor or a multiple of {kv}")
    _shards(tp, "MLP features", m.intermediate_size, "intermediate_size")
    if m.linear_layers:
        _shards(tp, "GDN key heads", m.linear_num_key_heads, "linear_num_key_heads")
        _shards(tp, "GDN value heads", m.linear_num_value_heads, "linear_num_value_heads")
    if pp > m.num_layers:
        raise Sm70Error(
            f"SM70_PIPELINE_PARALLEL_SIZE={pp} exceeds the model's {m.num_layers} layers: "
            "every pipeline stage needs at least one",
            hint=f"set SM70_PIPELINE_PARALLEL_SIZE at or below {m.num_layers}")
