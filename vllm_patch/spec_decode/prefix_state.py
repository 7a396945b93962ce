"""R8 of ../runtime_patches/README.md: prefix-cache hits of a hybrid model with MTP/EAGLE.

The bug (vLLM 0.22.1, a hybrid model with an EAGLE-style drafter (MTP) and prefix caching in
`align` mode; measured on the H200 in stock vLLM and in our stack by
`tests/gpu/serving/device_spec_diag.py`, engines SM / OM): a request that hits the prefix
cache is told that `L` tokens are computed while its full-attention blocks cover fewer
than `L` tokens. The attention layers then read, for the missing positions, KV of freshly
allocated blocks that nobody wrote: greedy output differs from plain decoding from the
first generated token, whatever the drafts.

How the hit length comes out wrong (`vllm/v1/core/kv_cache_coordinator.py`):
- with a drafter, every KV cache group counts as an EAGLE group when none is flagged
  (`:59-64`; only DeepSeek V4 flags one), the Mamba/GDN group included;
- `HybridKVCacheCoordinator.find_longest_cache_hit` lets an EAGLE group look one block past
  the current candidate length (`:567-571`) on the understanding that its manager then
  drops the last matched block. The full-attention manager does drop it
  (`single_type_kv_cache_manager.py:519`); `MambaManager.find_longest_cache_hit` never does
  (`:858-903`: a state checkpoint cannot be dropped back one block);
- so after full attention has matched `n` blocks and dropped one, the GDN group finds its
  checkpoint at block `n` and raises the candidate back to `n` blocks; the loop takes that
  as settled (`curr_hit_length >= hit_length`), and the final truncation (`:597-602`) only
  shortens full attention's list, it cannot lengthen it. Example: block 528, a 528-token
  prompt cached, then a 529-token prompt sharing it: hit 528 tokens, full-attention blocks
  0, GDN blocks 1.

The fix: the GDN groups of `align` mode lose the one-block look-ahead (they search up to the
current candidate, which full attention has already reduced by its drop), so a group can
only keep or shorten the hit, never lengthen it; the scheduler already places an EAGLE
request's last checkpoint one block before its last full block (`scheduler.py:309-312`),
exactly where the reduced hit lands. As a second line, a hit whose per-group block lists
do not all cover exactly the hit length is refused (no hit: the prompt is recomputed),
counted on the coordinator. Both act only in coordinators whose EAGLE groups include an
`align` GDN group: hybrid + align + MTP/EAGLE. Requests without a hit and engines without a
drafter are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_patch import rebind

logger = logging.getLogger("vllm_patch")

TARGET = rebind.Target(
    module="vllm.v1.core.kv_cache_coordinator", owner="HybridKVCacheCoordinator",
    attr="find_longest_cache_hit", version="0.22.1",
    params=("self", "block_hashes", "max_cache_hit_length"),
    # names the 0.22.1 body uses for the look-ahead this fix takes away from the GDN groups
    names=frozenset({"eagle_attn_group_indices", "attention_groups", "find_longest_cache_hit"}),
    mark="__sm70_prefix_state__")
MARK = TARGET.mark
STATE_ATTR = "_sm70_prefix_state"  # on the coordinator: what the fix did there


class PrefixStatePatchError(rebind.RebindError):
    """The rebinding's target is not the function it was written against."""


@dataclass(frozen=True)
class GroupKind:
    """What the fix needs to know of one attention group of the coordinator."""

    state: bool  # a Mamba/GDN group: one state checkpoint per block, nothing to drop
    cache_mode: str = ""  # its mamba_cache_mode ("" for attention groups)


def lookahead_groups(eagle: Iterable[int], kinds: Sequence[GroupKind]) -> set[int]:
    """The attention groups that may look one block past the current hit length (pure).

    `eagle`: vLLM's EAGLE attention-group indices; `kinds`: one entry per attention group.
    An `align` state group is taken out: its finder does not drop the extra block, so the
    look-ahead would lengthen the hit past what full attention holds."""
    out = set()
    for i in eagle:
        if not 0 <= i < len(kinds):
            raise ValueError(f"EAGLE attention group {i}: the coordinator has {len(kinds)}")
        if not (kinds[i].state and kinds[i].cache_mode == "align"):
            out.add(i)
    return out


def hit_is_consistent(hit_length: int, blocks_per_group: Sequence[int],
                      block_sizes: Sequence[int]) -> bool:
    """Whether every KV cache group's hit list covers exactly `hit_length` tokens (pure).

    vLLM allocates each group's blocks after its hit list; a list shorter than the hit
    leaves positions nobody computed (a longer one, for a GDN group, a state of a later
    position)."""
    if len(blocks_per_group) != len(block_sizes):
        raise ValueError(f"{len(blocks_per_group)} hit lists for {len(block_sizes)} groups")
    return all(n * size == hit_length for n, size in zip(blocks_per_group, block_sizes,
                                                         strict=True))


def _kinds(coordinator: Any) -> list[GroupKind]:
    from vllm.v1.kv_cache_interface import MambaSpec

    return [GroupKind(True, str(spec.mamba_cache_mode)) if isinstance(spec, MambaSpec)
            else GroupKind(False) for spec, _ids, _cls in coordinator.attention_groups]


def arm(coordinator: Any) -> dict[str, Any] | None:
    """Take the look-ahead away from this coordinator's align GDN groups (once); returns
    the fix's record on it, or None where the fix does not apply (no such EAGLE group)."""
    state = coordinator.__dict__.get(STATE_ATTR)
    if state is None:
        eagle = set(coordinator.eagle_attn_group_indices)
        kept = lookahead_groups(eagle, _kinds(coordinator))
        state = {"applies": kept != eagle, "removed": sorted(eagle - kept), "hits": 0,
                 "refused": 0}
        if state["applies"]:
            coordinator.eagle_attn_group_indices = kept
        coordinator.__dict__[STATE_ATTR] = state
    return state if state["applies"] else None


def checked(coordinator: Any, state: dict[str, Any],
            result: tuple[tuple[list[Any], ...], int]) -> tuple[tuple[list[Any], ...], int]:
    """The coordinator's answer, or no hit where its lists do not cover the hit length."""
    blocks, hit = result
    sizes = [g.kv_cache_spec.block_size for g in coordinator.kv_cache_config.kv_cache_groups]
    if hit_is_consistent(hit, [len(b) for b in blocks], sizes):
        if hit:
            state["hits"] += 1
        return result
    state["refused"] += 1
    if state["refused"] == 1:
        logger.warning("sm70 plugin: a prefix-cache hit of %d tokens with per-group lists "
                       "%s refused (recomputed instead)", hit, [len(b) for b in blocks])
    return tuple([] for _ in blocks), 0


def check_target(func: Any, version: str) -> None:
    rebind.check(TARGET, func, version, PrefixStatePatchError)


def wrap(original: Any) -> Any:
    def find_longest_cache_hit(self: Any, block_hashes: Any,
                               max_cache_hit_length: int) -> Any:
        state = arm(self)
        result = original(self, block_hashes, max_cache_hit_length)
        return result if state is None else checked(self, state, result)

    return find_longest_cache_hit


_INSTALLER = rebind.Installer(
    TARGET, wrap, "acts for hybrid models with align prefix caching and MTP/EAGLE",
    PrefixStatePatchError)
install = _INSTALLER.install
install_or_refuse = _INSTALLER.install_or_refuse
outcome = _INSTALLER.outcome
# now if vLLM's coordinator module is loaded, else right after the engine core's scheduler
# imports it
install_when_imported = _INSTALLER.install_when_imported
