"""The plan as plain data (for --json and the table) and its human figures (pure)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sm70ctl.plan.plan import GiB, MiB, Plan

# Display groups for the bar chart and the table's subtotals: (key, label, colour)
GROUPS = [
    ("runtime", "CUDA context + allocator reserve", "#8d99ae"),
    ("w.vocab", "embedding + lm_head", "#1d4e89"),
    ("w.attn", "attention weights", "#3a7ca5"),
    ("w.gdn", "Gated DeltaNet weights", "#2a9d8f"),
    ("w.mlp", "MLP weights", "#5aa469"),
    ("w.other", "vision tower, MTP, norms", "#9c89b8"),
    ("clef", "Clef correction + head", "#c8553d"),
    ("workspace", "workspaces (activations, logits, graphs)", "#f2a541"),
    ("pool.state", "GDN state pool", "#b5179e"),
    ("pool.kv", "KV cache pool", "#7209b7"),
]

# Names short enough to print inside a bar segment
SHORT = {"w.vocab": "embed+head", "w.gdn": "GDN", "w.mlp": "MLP", "w.attn": "attn",
         "pool.state": "GDN state", "pool.kv": "KV", "free": "free", "workspace": "work"}


def group_of(key: str) -> str:
    if key in ("cuda_context", "allocator"):
        return "runtime"
    if key in ("weights.embed", "weights.lm_head"):
        return "w.vocab"
    if key.startswith("weights.attn"):
        return "w.attn"
    if key.startswith("weights.gdn"):
        return "w.gdn"
    if key == "weights.mlp":
        return "w.mlp"
    if key.startswith("weights."):
        return "w.other"
    if key.startswith("clef."):
        return "clef"
    if key.startswith("pool."):
        return key
    return "workspace"


def mib(b: int) -> str:
    return f"{b / MiB:,.1f}"


def gib(b: int) -> str:
    return f"{b / GiB:,.2f}"


def plan_to_dict(plan: Plan, meta: dict[str, Any]) -> dict[str, Any]:
    inputs = plan.inputs
    ov = plan.overflow
    conc = plan.concurrency(plan.context)
    page = plan.gdn_page
    gpus = []
    for g in plan.gpus:
        gpus.append({
            "index": g.gpu.index,
            "name": g.gpu.name,
            "total_bytes": g.gpu.total_bytes,
            "budget_bytes": g.budget,
            "pipeline_stage": g.stage,
            "tp_rank": g.tp_rank,
            "weights_bytes": g.weights_bytes,
            "used_bytes": g.used_bytes,
            "free_bytes": g.free_bytes,
            "pool_available_bytes": g.pool_available,
            "items": [{"section": i.section, "key": i.key, "label": i.label,
                       "bytes": i.bytes, **({"detail": i.detail} if i.detail else {})}
                      for i in g.items],
            "pool": g.layout.to_dict(),
            "overflow": asdict(g.overflow) if g.overflow else None,
            "kv_needed_bytes": g.kv_needed_bytes,
        })
    m = plan.model
    return {
        "fits": plan.fits,
        "model": {
            "source": meta.get("model_source"),
            "path": m.source,
            "architecture": m.architecture,
            "layers": m.num_layers,
            "full_attention_layers": len(m.full_layers),
            "linear_attention_layers": len(m.linear_layers),
            "mtp_layers": m.mtp_num_hidden_layers,
            "vocab_size": m.vocab_size,
            "quantization": (f"gptq int{m.quant.default.bits} g{m.quant.default.group_size}"
                             f"{'' if m.quant.default.sym else ' asym'}") if m.quant else None,
        },
        "gpus_source": meta.get("gpus_source"),
        "gpus_note": meta.get("gpus_note"),
        "settings_source": meta.get("settings_source"),
        "inputs": {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in asdict(inputs).items()},
        "path": inputs.path,
        "gdn_state_dtype": plan.gdn_state_dtype,
        "kv_bytes_per_token_per_layer": plan.kv_bytes_per_token_layer,
        "kv_bytes_per_token": plan.gpus[0].layout.kv_bytes_per_token,
        "gdn_page_bytes": ({"recurrent": page.recurrent, "conv": page.conv,
                            "total": page.total} if page else None),
        "max_model_len": inputs.max_model_len,
        "longest_sequence_tokens": plan.longest_sequence,
        "concurrency": conc,
        "overflow": asdict(ov) if ov else None,
        "within_budget": plan.within_budget,
        "gpus": gpus,
        "warnings": plan.warnings,
        "projected": "computed by sm70ctl plan from shapes and settings; not measured",
    }
