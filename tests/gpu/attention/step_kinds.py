"""Which kernel served each kind of step, counted inside an engine on the SM70 backend.

The backend's own counters (backend.CALLS, the device counters) say how often each op ran,
not in which kind of step. Every step, graph replays included, first builds its attention
metadata on the CPU (`Sm70PagedMetadataBuilder.build`; the MTP drafter's steps through
`build_for_drafting`, which calls `build`), and that metadata holds the row split the
backend's `forward` follows: decode rows (num_decodes requests of q_per_seq rows each) go to
torch.ops.sm70.paged_decode, prefill rows to the builder's prefill kernel. `install` wraps
`build` to tally, per KV-cache group (its first layer name) and step kind, how many steps
were built. The capture builds (`build_for_cudagraph_capture`) do not go through the wrapped
method, so only served steps count.

`step_kind` is pure (tested on the CPU); `install` needs vLLM and our backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DRAFTER_PREFIX = "mtp."  # vLLM 0.22.1's Qwen3.5 MTP layers: mtp.layers.<n>.self_attn.attn


def step_kind(num_decodes: int, q_per_seq: int, num_prefills: int, prefill_kernel: str) -> str:
    """`decode_q<q>` (only decode rows), `decode_q<q>+prefill:<kernel>` (both in one step),
    `prefill:<kernel>` (no decode rows), `empty` (nothing to attend)."""
    parts = []
    if num_decodes:
        parts.append(f"decode_q{q_per_seq}")
    if num_prefills:
        parts.append(f"prefill:{prefill_kernel}")
    return "+".join(parts) or "empty"


def group_role(layer_name: str) -> str:
    """`drafter` for the MTP layer's group, `target` for the model's own layers."""
    return "drafter" if layer_name.startswith(DRAFTER_PREFIX) else "target"


def by_role(tally: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """The per-group tally summed per role (target / drafter)."""
    out: dict[str, dict[str, int]] = {}
    for layer, kinds in tally.items():
        role = out.setdefault(group_role(layer), {})
        for k, n in kinds.items():
            role[k] = role.get(k, 0) + n
    return out


def delta(after: Mapping[str, Mapping[str, int]],
          before: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """What a phase added to a role tally (both cumulative)."""
    out: dict[str, dict[str, int]] = {}
    for role, kinds in after.items():
        prev = before.get(role, {})
        d = {k: n - prev.get(k, 0) for k, n in kinds.items() if n - prev.get(k, 0)}
        if d:
            out[role] = d
    return out


TALLY: dict[str, dict[str, int]] = {}


def install() -> dict[str, dict[str, int]]:
    """Wrap Sm70PagedMetadataBuilder.build (once per process); returns the live tally."""
    from vllm_patch.attention import backend

    cls = backend.Sm70PagedMetadataBuilder
    if getattr(cls.build, "_step_kinds", False):
        return TALLY
    original = cls.build

    def build(self: Any, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Any:
        m = original(self, common_prefix_len, common_attn_metadata, fast_build)
        names = list(getattr(self, "layer_names", None) or ["?"])
        kinds = TALLY.setdefault(names[0], {})
        k = step_kind(m.num_decodes, m.q_per_seq, m.num_prefills, self.prefill_kernel)
        kinds[k] = kinds.get(k, 0) + 1
        return m

    build._step_kinds = True  # type: ignore[attr-defined]
    cls.build = build  # type: ignore[method-assign]
    return TALLY
