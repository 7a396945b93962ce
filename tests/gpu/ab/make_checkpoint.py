"""Make a random-weight Qwen3.5 hybrid checkpoint twice from the same numbers (GPU machine).

`<out>/int8/`: asymmetric GPTQ-int8 group-128 tensors (qweight/qzeros/scales/g_idx, classic
"gptq" format storing zero - 1) with the reference checkpoint's `quantization_config`
(`dynamic` and `modules_to_not_convert` as in sm70ctl/data/qwen3.8-27b/config.json).
`<out>/fp16/`: the same model with every quantized layer replaced by its exact fp16
dequantization, and no quantization_config. Both share the tokenizer (a byte-level one built
here) and every unquantized tensor, so stock vLLM on fp16/ and our plugin on int8/ compute
the same function up to kernel rounding.

What stays 16-bit follows FACTS.md, decided here by its own regex (not by the plugin's rules,
so a wrong rule in the plugin shows up as a load failure): q/k/v, in_proj_b/a, layer 0's MLP
and GDN, the MTP layer, the vision tower, embeddings and lm_head.

The lm_head rows lie on a per-row int8 grid, so the plugin's load-time int8 head reproduces
them (up to the fp16 rounding of each row's scale): the A/B then measures our kernels, not
the lm_head's quantisation loss (that is measured in the bench, not here). Its scale makes
logits spread like a trained model's (std about 4), so greedy steps are not near-ties.

Run: python tests/gpu/ab/make_checkpoint.py --shape tiny --out /tmp/ab/tiny
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SERVING = ROOT / "tests" / "gpu" / "serving"  # tiny_serving: chat template, processor configs
REFERENCE_CONFIG = ROOT / "sm70ctl" / "data" / "qwen3.8-27b" / "config.json"
GROUP = 128
KEEP_FP16 = re.compile(
    r"self_attn\.(q|k|v)_proj\.|linear_attn\.in_proj_(a|b)\.|layers\.0\.(mlp|linear_attn)\."
)
LINEAR = re.compile(
    r"^model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|"
    r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)|"
    r"mlp\.(gate|up|down)_proj)\.weight$"
)
VOCAB_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

SHAPES: dict[str, dict] = {
    # 3 GDN + 1 full attention; head_dim 256, 12 query / 2 KV heads (GQA 6:1).
    "tiny": dict(hidden=512, mlp=1024, layers=["linear_attention"] * 3 + ["full_attention"],
                 heads=12, kv_heads=2, k_heads=4, v_heads=8, vocab=2048),
    # The real model's shapes, 4 layers (3 GDN + 1 full) and the MTP layer.
    "slice": dict(hidden=5120, mlp=17408, layers=["linear_attention"] * 3 + ["full_attention"],
                  heads=24, kv_heads=4, k_heads=16, v_heads=48, vocab=248320),
    # The same shapes, 16 layers (12 GDN + 4 full, the model's 3:1 pattern): deep enough that
    # a decode step is GPU-bound on the H200 (the 4-layer slice's step is vLLM's host time).
    "slice16": dict(hidden=5120, mlp=17408,
                    layers=(["linear_attention"] * 3 + ["full_attention"]) * 4,
                    heads=24, kv_heads=4, k_heads=16, v_heads=48, vocab=248320),
}


def text_config(s: dict) -> dict:
    v = s["vocab"]
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": v,
        "hidden_size": s["hidden"],
        "intermediate_size": s["mlp"],
        "num_hidden_layers": len(s["layers"]),
        "layer_types": s["layers"],
        "full_attention_interval": 4,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": 256,
        "attn_output_gate": True,
        "linear_num_key_heads": s["k_heads"],
        "linear_num_value_heads": s["v_heads"],
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "eos_token_id": v - 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "dtype": "float16",
    }


def full_config(s: dict) -> dict:
    v = s["vocab"]
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config(s),
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 64,
                          "intermediate_size": 128, "num_heads": 2, "in_channels": 3,
                          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "out_hidden_size": s["hidden"], "num_position_embeddings": 64,
                          "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": []},
        # the ids build_tokenizer gives these tokens (vLLM's Qwen3-VL processing finds the
        # vision segments and their m-RoPE positions by these config ids)
        "vision_start_token_id": v - 61, "vision_end_token_id": v - 60,
        "image_token_id": v - 59, "video_token_id": v - 58,
        "tie_word_embeddings": False,
        "dtype": "float16",
        "torch_dtype": "float16",
    }


def reference_quant_config() -> dict:
    return json.loads(REFERENCE_CONFIG.read_text())["quantization_config"]


def build_tokenizer(vocab: int, eos_id: int, out: Path) -> None:
    """Byte-level tokenizer: 256 byte tokens, the special tokens at the config's ids, fillers."""
    if str(SERVING) not in sys.path:
        sys.path.insert(0, str(SERVING))
    from tiny_serving import add_serving_tokens, chat_template, write_serving_files
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table: dict[str, int] = {ch: i for i, ch in enumerate(sorted(alphabet))}
    special_ids = {VOCAB_SPECIALS[0]: eos_id}
    for i, tok in enumerate(VOCAB_SPECIALS[1:]):
        special_ids[tok] = vocab - 63 + i
    # <think>, <tool_call> and the other tokens vLLM's reasoning and tool parsers need
    serving = add_serving_tokens(table, vocab)
    used = set(table.values()) | set(special_ids.values())
    fill = (i for i in range(vocab) if i not in used)
    for tok, i in special_ids.items():
        table[tok] = i
    while len(table) < vocab:
        i = next(fill)
        table[f"<|f{i}|>"] = i
    tk = Tokenizer(models.BPE(vocab=table, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(VOCAB_SPECIALS))
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in serving])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=VOCAB_SPECIALS[0],
                                   pad_token=VOCAB_SPECIALS[0])
    fast.chat_template = chat_template()
    fast.save_pretrained(str(out))
    write_serving_files(out)


def quantize_gptq(w, zero_offset: int = 1):
    """Asymmetric int8 g128 of W [N, K]: (qweight, qzeros, scales, g_idx, dequantized W fp16)."""
    import torch

    from vllm_patch.ops.reference import dequant_gptq_int8, pack_gptq_int8

    n, k = w.shape
    wg = w.float().reshape(n, k // GROUP, GROUP)
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-8).half()  # the checkpoint's fp16 scales
    sf = scale.float()
    zero = torch.round(-lo / sf).clamp(zero_offset, 255)  # stored as zero - offset >= 0
    codes = torch.clamp(torch.round(wg / sf[..., None]) + zero[..., None], 0, 255)
    codes_kn = codes.reshape(n, k).t().contiguous()  # [K, N]
    qweight, qzeros, scales = pack_gptq_int8(
        codes_kn.to(torch.uint8), zero.t().contiguous(), scale.t().contiguous(), zero_offset
    )
    deq = dequant_gptq_int8(qweight, qzeros, scales, GROUP, zero_offset)  # [K, N] fp32
    g_idx = (torch.arange(k, dtype=torch.int32, device=w.device) // GROUP).contiguous()
    return qweight, qzeros, scales, g_idx, deq.t().contiguous().half()


def lm_head_on_int8_grid(vocab: int, hidden: int, gen, device):
    import torch

    q = torch.randint(-127, 128, (vocab, hidden), generator=gen, device=device)
    q[:, 0] = torch.where(torch.rand(vocab, generator=gen, device=device) < 0.5, -127, 127)
    row_scale = (4.0 / hidden**0.5) / 73.0  # uniform codes have std 73: logits std about 4
    jitter = 1 + 0.25 * torch.rand(vocab, 1, generator=gen, device=device)
    return (q.float() * row_scale * jitter).half()


def add_mtp(sd: dict, full_layer: int, hidden: int, gen, device) -> None:
    """The MTP layer's tensors (copies of a full-attention layer, a random fc), fp16."""
    import torch

    src = f"model.language_model.layers.{full_layer}."
    for name in [k for k in sd if k.startswith(src)]:
        sd["mtp.layers.0." + name[len(src):]] = sd[name].clone()
    fc = torch.randn(hidden, 2 * hidden, generator=gen, device=device) * 0.02
    sd["mtp.fc.weight"] = fc.half()
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        sd[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.float16, device=device)


def make(shape: str, out: Path, seed: int = 0) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    s = SHAPES[shape]
    t0 = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    cfg_dict = full_config(s)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in cfg_dict.items() if k != "model_type"}
    cfg = AutoConfig.for_model("qwen3_5", **kwargs)
    with device:
        model = Qwen3_5ForConditionalGeneration(cfg).to(torch.float16)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    sd["lm_head.weight"] = lm_head_on_int8_grid(s["vocab"], s["hidden"], gen, device)
    add_mtp(sd, s["layers"].index("full_attention"), s["hidden"], gen, device)

    int8_sd: dict = {}
    fp16_sd: dict = {}
    quantized: list[str] = []
    for name, t in sd.items():
        if LINEAR.match(name) and not KEEP_FP16.search(name):
            # Random weights with a per-group offset, so the zeros differ from 128.
            n, k = t.shape
            w = torch.randn(n, k, generator=gen, device=device) * 0.02
            w += (torch.rand(n, k // GROUP, 1, generator=gen, device=device) - 0.5).mul(
                0.02).expand(n, k // GROUP, GROUP).reshape(n, k)
            qweight, qzeros, scales, g_idx, deq = quantize_gptq(w)
            base = name[: -len(".weight")]
            int8_sd.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros,
                            f"{base}.scales": scales, f"{base}.g_idx": g_idx})
            fp16_sd[name] = deq
            quantized.append(base)
        else:
            int8_sd[name] = t
            fp16_sd[name] = t
    if not quantized:
        raise SystemExit(f"no tensor name matched {LINEAR.pattern}: {sorted(sd)[:8]} ...")

    for sub, tensors, quant in (("int8", int8_sd, True), ("fp16", fp16_sd, False)):
        d = out / sub
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()},
                  str(d / "model.safetensors"), metadata={"format": "pt"})
        conf = dict(cfg_dict)
        if quant:
            conf["quantization_config"] = reference_quant_config()
        (d / "config.json").write_text(json.dumps(conf, indent=1))
        build_tokenizer(s["vocab"], cfg_dict["text_config"]["eos_token_id"], d)
    info = {"shape": shape, "dir": str(out), "quantized_layers": quantized,
            "tensors": len(sd), "seconds": round(time.time() - t0, 1),
            "int8_bytes": (out / "int8" / "model.safetensors").stat().st_size,
            "fp16_bytes": (out / "fp16" / "model.safetensors").stat().st_size}
    (out / "made.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    print(json.dumps(make(a.shape, a.out, a.seed))[:2000])
