"""A tiny Qwen3 checkpoint for the CPU end-to-end tests, built on the spot.

Two halves in one file:
- `build_tiny_model(dest, python)` is what tests call from the tool's environment (no
  torch there): it runs this same file as a script under the serving interpreter.
- Run as a script (`python tinymodel.py DEST`) inside the serving environment, it trains
  a byte-level BPE tokenizer on a small local corpus, writes random Qwen3 weights with
  safetensors and a chat template that renders tools (so a tool call can be served).

The weights are random, with one deliberate bias: every token that is only whitespace,
and every special token, gets a strongly negative logit (end-of-turn a little less).
Grammar-constrained decoding
(tool calls, JSON) may place whitespace anywhere, so an unbiased random model can wander
through blanks until `max_tokens`; with the bias it always takes the structural token,
which makes the tool-call test deterministic. Free-running completions never stop early.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

VOCAB_SIZE = 512
HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 32  # 16 crashes vLLM's CPU attention (TOOLCHAIN.md)
MAX_POSITIONS = 4096
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
]

# Our own template: ChatML turns, tools listed as JSON in the system turn, tool calls in
# <tool_call> tags (what vLLM's `hermes` parser reads), tool results as user turns.
CHAT_TEMPLATE = """\
{%- set sys_text = messages[0].content if messages and messages[0].role == 'system' else '' -%}
{%- if tools or sys_text -%}
<|im_start|>system
{{ sys_text }}
{%- if tools %}
Tools you may call, one JSON object per line:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.
{%- endif %}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{%- set args = call.function.arguments %}
{"name": "{{ call.function.name }}", "arguments": {{ args if args is string else args | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

_WORDS_TEXT = (
    "the a of to and in is it that for on with as was at by be this from or have an not are "
    "weather city unit celsius fahrenheit temperature today tomorrow paris london tokyo hello "
    "world model server volta tensor core kernel cache warm cold token prompt answer question "
    "tool call function name arguments parameters result value true false null"
)
_WORDS = _WORDS_TEXT.split()


def _corpus() -> list[str]:
    # Deterministic text covering words, digits, JSON punctuation and whitespace runs.
    lines = []
    for i in range(400):
        words = [_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(12)]
        lines.append(" ".join(words).capitalize() + ".")
        lines.append(json.dumps({"name": words[0], "arguments": {words[1]: words[2], "n": i}}))
        lines.append(f"  {i} + {i * 3} = {i * 4}\n\t{words[3]}_{words[4]}()")
    return lines


def _build(dest: Path) -> None:  # runs inside the serving interpreter
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dest))

    vocab = tok.get_vocab()
    n_tokens = max(vocab.values()) + 1
    assert n_tokens <= VOCAB_SIZE, n_tokens
    decoder = decoders.ByteLevel()
    penalised = [
        idx
        for text, idx in vocab.items()
        if text in SPECIAL_TOKENS or decoder.decode([text]).strip() == ""
    ]

    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    weights: dict[str, torch.Tensor] = {}
    embed = rnd(VOCAB_SIZE, HIDDEN)
    embed[:, 0] = 1.0  # a constant direction that survives the residual stream
    weights["model.embed_tokens.weight"] = embed
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        weights[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
        weights[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        weights[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        weights[p + "mlp.gate_proj.weight"] = rnd(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = rnd(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = rnd(HIDDEN, INTERMEDIATE)
    weights["model.norm.weight"] = torch.ones(HIDDEN)
    head = torch.randn(VOCAB_SIZE, HIDDEN, generator=g)
    head[:, 0] = 0.0
    head[penalised, 0] = -4.0  # the constant direction pushes these far down
    # End of turn: far below any ordinary token, above the other penalised ones, so a
    # grammar that allows "another tool call or stop" stops.
    head[vocab["<|im_end|>"], 0] = -2.0
    weights["lm_head.weight"] = head
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dest / "model.safetensors"))

    eos = vocab["<|im_end|>"]
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": vocab["<|endoftext|>"],
        "eos_token_id": eos,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def build_tiny_model(dest: Path, python: str | Path, timeout: float = 300) -> Path:
    """Build the tiny model at `dest` with the serving interpreter `python`."""
    proc = subprocess.run(
        [str(python), str(Path(__file__).resolve()), str(dest)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tiny model build failed:\n{proc.stdout}\n{proc.stderr}")
    return dest


if __name__ == "__main__":
    _build(Path(sys.argv[1]))
