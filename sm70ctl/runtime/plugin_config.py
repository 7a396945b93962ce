"""What vllm_patch reads from SM70_PLUGIN_CONFIG, built from the settings (pure).

`vllm_patch.config` defines the classes; this is the only place they are filled in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sm70ctl.errors import Sm70Error
from sm70ctl.settings.typed import SettingsView

if TYPE_CHECKING:
    from vllm_patch.config import PluginConfig

PLUGIN_CONFIG_ENV = "SM70_PLUGIN_CONFIG"


def plugin_config(settings: SettingsView) -> dict[str, Any]:
    """What vllm_patch reads from SM70_PLUGIN_CONFIG (see vllm_patch/config.py)."""
    return plugin_config_obj(settings).to_dict()


def plugin_config_obj(settings: SettingsView, allreduce_mode: str | None = None) -> PluginConfig:
    """`allreduce_mode`: the all-reduce resolved from the probed topology (fp16, int12 or
    nccl: sm70ctl.devices.topology); None passes SM70_ALLREDUCE_MODE as set."""
    from vllm_patch.config import (
        DRAFT_HEAD_DTYPES,
        GDN_KERNEL_SETTING,
        AllreduceConfig,
        AttentionConfig,
        ClefConfig,
        GdnConfig,
        GemmConfig,
        LogprobsConfig,
        MemoryConfig,
        PluginConfig,
        SparsePrefillConfig,
        SpecConfig,
    )

    s = settings
    if s.draft_head_dtype not in DRAFT_HEAD_DTYPES:
        raise Sm70Error(
            f"SM70_DRAFT_HEAD_DTYPE={s.draft_head_dtype}: the plugin stores the MTP draft layer "
            f"as {' or '.join(DRAFT_HEAD_DTYPES)} only (int4 is not implemented; "
            "`sm70ctl plan --path target` counts it)",
            hint="set SM70_DRAFT_HEAD_DTYPE=int8",
        )
    gdn_kernel, decode_layer, prefill = GDN_KERNEL_SETTING[s.gdn_kernel]
    return PluginConfig(
        memory=MemoryConfig(
            state_block_multiplier=s.state_block_multiplier, split_pools=s.split_pools
        ),
        attention=AttentionConfig(
            prefill_kernel=s.prefill_attention,
            decode_tensor_cores=s.decode_tensor_cores,
            uniform_decode=s.uniform_decode,
            decode_max_splits=s.decode_max_splits,
            paged_prefill=s.paged_prefill,
        ),
        sparse_prefill=SparsePrefillConfig(
            enabled=s.sparse_prefill,
            percent=float(s.sparse_prefill_percent),
            mass=float(s.sparse_prefill_mass),
            block=s.sparse_prefill_block,
            min_len=s.sparse_prefill_min_len,
            decode_top_fraction=float(s.sparse_decode_top_fraction),
        ),
        gemm=GemmConfig(
            int8_gemv=s.int8_gemv,
            attn_weights_12bit=s.attn_weights_12bit,
            int8_lm_head=s.int8_lm_head,
            tuning=s.gemm_tuning,
            gemv_max_rows=s.gemv_max_rows,
        ),
        allreduce=AllreduceConfig(
            mode=allreduce_mode or s.allreduce_mode, buffer_bytes=s.allreduce_buffer_bytes
        ),
        gdn=GdnConfig(kernel=gdn_kernel, chunk_size=s.gdn_chunk_size,
                      state_dtype=s.gdn_state_dtype, decode_layer=decode_layer, prefill=prefill),
        spec=SpecConfig(
            draft_head_dtype=s.draft_head_dtype,
            draft_cudagraph=s.draft_cudagraph,
            ngram_assist=s.ngram_assist,
            ngram_min=s.ngram_min,
            ngram_max=s.ngram_max,
        ),
        clef=ClefConfig(
            enabled=s.clef,
            dir=str(s.clef_dir),
            rank=s.clef_rank,
            max_model_len=s.clef_max_model_len,
            max_questions=s.clef_max_questions,
        ),
        logprobs=LogprobsConfig(prompt_chunk=s.prompt_logprobs_chunk),
    )
