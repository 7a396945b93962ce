"""The scoring head's forward pass (layout `joint-schema-v1`, docs/clef.md); imports torch.

The only torch module of `vllm_patch.clef`: nothing else in the package imports it, so the
CPU-side pieces stay importable without torch.

What the layout leaves open is fixed here: every RMS norm uses eps 1e-6 (the base model's
rms_norm_eps) and runs in float32; the blocks' MLP is fc2(GELU(fc1(x))) with the exact
(erf) GELU; the blocks have no biases; attention is bidirectional over one request's
positions, head width = width / attention_heads, scale 1/sqrt(head width). Several requests
are scored in one call: their positions are packed and a block-diagonal mask keeps each
request's positions to themselves (`scaled_dot_product_attention` once per block, not
once per request).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.head import HeadConfig, head_tensors

EPS = 1e-6
QUESTION, OPTION = 0, 1


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


class ClefHead(torch.nn.Module):
    """The head's tensors on one device (fp16) and its forward over packed positions."""

    def __init__(self, cfg: HeadConfig, tensors: Mapping[str, torch.Tensor],
                 device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        want = head_tensors(cfg)
        self.names: dict[str, str] = {}
        for name, shape in want.items():
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape:
                got = None if t is None else tuple(t.shape)
                raise ClefError(f"head tensor {name!r}: shape {got}, the head config needs "
                                f"{shape}")
            key = name.replace(".", "_")
            self.register_buffer(key, t.to(device, torch.float16), persistent=False)
            self.names[name] = key

    def t(self, name: str) -> torch.Tensor:
        return getattr(self, self.names[name])

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, roles: torch.Tensor,
                kinds: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
        """One logit per position (float32 [P]).

        hidden [T, H] fp16: the model's final hidden states (after the final norm);
        positions [P]: the rows of `hidden` to read (each question's and option's last
        token), requests one after another; roles [P] (0 question, 1 option); kinds [P]
        (rows of the config's `kinds`); starts: where each request's positions begin in
        `positions`, plus the end (len(starts) = requests + 1). A question position's logit
        is computed like an option's; the caller reads the options' only."""
        c = self.cfg
        p = positions.numel()
        if len(starts) < 2 or starts[0] != 0 or starts[-1] != p or any(
                b < a for a, b in pairwise(starts)):
            raise ClefError(f"head: request starts {list(starts)} do not split {p} positions")
        h = _rms(hidden.index_select(0, positions), self.t("head.in_norm.weight"))
        z = F.linear(h, self.t("head.in_proj.weight"), self.t("head.in_proj.bias"))
        z = z + self.t("head.role_embed")[roles] + self.t("head.kind_embed")[kinds]
        seg = torch.repeat_interleave(
            torch.arange(len(starts) - 1, device=z.device),
            torch.tensor([b - a for a, b in pairwise(starts)],
                         device=z.device))
        same = seg.view(-1, 1) == seg.view(1, -1)  # [P, P] block-diagonal
        nh, dh = c.attention_heads, c.width // c.attention_heads
        for j in range(c.blocks):
            b = f"head.blocks.{j}."
            q, k, v = F.linear(_rms(z, self.t(b + "norm1.weight")),
                               self.t(b + "attn_qkv.weight")).split(c.width, dim=-1)
            q, k, v = (u.view(p, nh, dh).transpose(0, 1) for u in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=same,
                                               scale=1.0 / math.sqrt(dh))
            z = z + F.linear(a.transpose(0, 1).reshape(p, c.width),
                             self.t(b + "attn_out.weight"))
            m = F.gelu(F.linear(_rms(z, self.t(b + "norm2.weight")),
                                self.t(b + "mlp_fc1.weight")))
            z = z + F.linear(m, self.t(b + "mlp_fc2.weight"))
        zn = _rms(z, self.t("head.out_norm.weight"))
        w = self.t("head.out.weight")[kinds]  # [P, D]: each position's kind row
        return (zn.float() * w.float()).sum(-1) + self.t("head.out.bias")[kinds].float()


def head_from_folder(folder: Path, model_config: Mapping[str, Any], rank: int,
                     device: torch.device) -> ClefHead:
    """The head of a checked SM70_CLEF_DIR on `device` (whole on every GPU that scores:
    it is small, and splitting it would add a collective per block)."""
    from safetensors import safe_open

    from vllm_patch.clef.validate import validate_clef_dir

    try:
        checked = validate_clef_dir(folder, model_config, rank=rank, tp_sizes=(1,))
    except ClefError as exc:
        raise ClefError(f"SM70_CLEF_DIR={folder}: {exc}") from None
    cfg = checked.manifest.head
    with safe_open(str(folder / checked.manifest.head_file), framework="pt",
                   device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in head_tensors(cfg)}
    return ClefHead(cfg, tensors, device)
