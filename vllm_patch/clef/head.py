"""The scoring head's config (the `head` object of `clef.json`) and the tensors it implies.

Layout `joint-schema-v1` (docs/clef.md): the head reads the base model's final hidden
states (after the final norm) at the last token of each question and of each option the
prompt renders, projects them to `width`, adds a role (question / option) and a kind
embedding, mixes all of one request's positions through `blocks` pre-norm attention + MLP
blocks (so questions and options are scored jointly), and gives each option position one
logit from its kind's output row. This is the layout our loader accepts; the published
head's own layout has not been seen here (its pin is a placeholder), so a converter, or a
new layout version, follows when it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_patch.clef.errors import ClefError

ARCHITECTURE = "joint-schema-v1"
KINDS = ("choice", "score", "likelihood")
# the plan counts the head at this many fp16 parameters (sm70ctl/plan/clef.py); a larger
# head would not fit the memory the plan set aside
MAX_HEAD_PARAMS = 128_000_000
MAX_QUESTIONS = 64
LIMITS = {  # field: (least, most)
    "width": (64, 16384),
    "blocks": (0, 16),
    "attention_heads": (1, 256),
    "mlp_size": (1, 65536),
    "max_questions": (1, MAX_QUESTIONS),
    "max_options": (2, 256),
    "max_score_values": (2, 1001),
    "max_context": (256, 1 << 20),
}
FIELDS = {"architecture", "input_size", "kinds", *LIMITS}
# the head config the real-shape spec and docs/clef.md use for Qwen3.8-27B (our layout at
# the size FACTS.md gives, 65-128M parameters: this one has about 111M)
REFERENCE_HEAD: dict[str, Any] = {
    "architecture": ARCHITECTURE, "input_size": 5120, "width": 2048, "blocks": 2,
    "attention_heads": 16, "mlp_size": 8192, "kinds": list(KINDS), "max_questions": 64,
    "max_options": 32, "max_score_values": 101, "max_context": 32768,
}


@dataclass(frozen=True)
class HeadConfig:
    input_size: int
    width: int
    blocks: int
    attention_heads: int
    mlp_size: int
    kinds: tuple[str, ...]
    max_questions: int
    max_options: int
    max_score_values: int
    max_context: int


def parse_head_config(raw: Any, hidden_size: int, where: str = "clef.json: head") -> HeadConfig:
    """A HeadConfig from the manifest's `head` object; ClefError naming the field."""
    if not isinstance(raw, Mapping):
        raise ClefError(f"{where}: must be a JSON object")
    unknown = sorted(set(raw) - FIELDS)
    missing = sorted(FIELDS - set(raw))
    if unknown or missing:
        raise ClefError(f"{where}: unknown fields {unknown}, missing fields {missing}")
    if raw["architecture"] != ARCHITECTURE:
        raise ClefError(f"{where}.architecture = {raw['architecture']!r}; this loader reads "
                        f"{ARCHITECTURE!r}")
    values: dict[str, int] = {}
    for name, (lo, hi) in {**LIMITS, "input_size": (1, 1 << 20)}.items():
        v = raw[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ClefError(f"{where}.{name} = {v!r} is not an integer from {lo} to {hi}")
        values[name] = v
    if values["input_size"] != hidden_size:
        raise ClefError(f"{where}.input_size = {values['input_size']} is not the model's "
                        f"hidden_size {hidden_size}")
    if values["width"] % values["attention_heads"]:
        raise ClefError(f"{where}.width = {values['width']} is not divisible by "
                        f"attention_heads = {values['attention_heads']}")
    kinds = raw["kinds"]
    if (not isinstance(kinds, list) or not kinds or any(k not in KINDS for k in kinds)
            or len(set(kinds)) != len(kinds)):
        raise ClefError(f"{where}.kinds = {kinds!r}: a non-empty list of distinct kinds "
                        f"from {list(KINDS)}")
    cfg = HeadConfig(kinds=tuple(kinds), **values)
    n = head_params(cfg)
    if n > MAX_HEAD_PARAMS:
        raise ClefError(f"{where}: {n:,} parameters, more than the {MAX_HEAD_PARAMS:,} the "
                        "memory plan sets aside for the head")
    return cfg


def head_tensors(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the head, name -> shape (all fp16)."""
    d, f, k = c.width, c.mlp_size, len(c.kinds)
    out: dict[str, tuple[int, ...]] = {
        "head.in_norm.weight": (c.input_size,),
        "head.in_proj.weight": (d, c.input_size),
        "head.in_proj.bias": (d,),
        "head.role_embed": (2, d),  # row 0 question, row 1 option
        "head.kind_embed": (k, d),  # rows in `kinds` order
    }
    for j in range(c.blocks):
        b = f"head.blocks.{j}."
        out |= {
            b + "norm1.weight": (d,),
            b + "attn_qkv.weight": (3 * d, d),
            b + "attn_out.weight": (d, d),
            b + "norm2.weight": (d,),
            b + "mlp_fc1.weight": (f, d),
            b + "mlp_fc2.weight": (d, f),
        }
    out |= {"head.out_norm.weight": (d,), "head.out.weight": (k, d), "head.out.bias": (k,)}
    return out


def head_params(c: HeadConfig) -> int:
    total = 0
    for shape in head_tensors(c).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
