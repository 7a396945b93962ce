"""The scoring head written out in plain PyTorch, one request at a time, in float64.

The check for vllm_patch.clef.head_forward.ClefHead (packed requests, fp16, SDPA with a
block-diagonal mask): the same layout (docs/clef.md, the eps / GELU / scale choices in
head_forward's docstring) with explicit matmuls, an explicit softmax and the erf GELU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def reference_logits(t: Mapping[str, torch.Tensor], blocks: int, heads: int,
                     hidden: torch.Tensor, positions: Sequence[int], roles: Sequence[int],
                     kinds: Sequence[int], starts: Sequence[int]) -> list[float]:
    w = {k: v.double().cpu() for k, v in t.items()}
    h_all = hidden.double().cpu()
    out: list[float] = []
    for r in range(len(starts) - 1):
        idx = list(range(starts[r], starts[r + 1]))
        h = h_all[[positions[i] for i in idx]]
        z = _rms(h, w["head.in_norm.weight"]) @ w["head.in_proj.weight"].T
        z = z + w["head.in_proj.bias"]
        z = z + w["head.role_embed"][[roles[i] for i in idx]]
        z = z + w["head.kind_embed"][[kinds[i] for i in idx]]
        d = z.shape[1]
        dh = d // heads
        for j in range(blocks):
            b = f"head.blocks.{j}."
            qkv = _rms(z, w[b + "norm1.weight"]) @ w[b + "attn_qkv.weight"].T
            q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
            att = torch.zeros_like(z)
            for hd in range(heads):
                s = slice(hd * dh, (hd + 1) * dh)
                sc = (q[:, s] @ k[:, s].T) / math.sqrt(dh)
                e = torch.exp(sc - sc.max(dim=1, keepdim=True).values)
                att[:, s] = (e / e.sum(dim=1, keepdim=True)) @ v[:, s]
            z = z + att @ w[b + "attn_out.weight"].T
            f1 = _rms(z, w[b + "norm2.weight"]) @ w[b + "mlp_fc1.weight"].T
            g = 0.5 * f1 * (1.0 + torch.erf(f1 / math.sqrt(2.0)))
            z = z + g @ w[b + "mlp_fc2.weight"].T
        zn = _rms(z, w["head.out_norm.weight"])
        for row, i in enumerate(idx):
            kd = kinds[i]
            out.append(float(zn[row] @ w["head.out.weight"][kd] + w["head.out.bias"][kd]))
    return out
