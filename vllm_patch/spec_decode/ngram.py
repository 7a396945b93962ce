"""The n-gram assist proposer's definition (pure Python; the reference the batch form is
tested against, and what the CPU bench runs).

Given a request's token ids (prompt and generated so far), a draft length k and the n-gram
bounds `n_min <= n <= n_max` (SM70_NGRAM_MIN / SM70_NGRAM_MAX), the proposal is:

- for n from `n_max` down to `n_min`, the suffix `tokens[-n:]`;
- its occurrences earlier in the context that are followed by at least k tokens, that is
  starts `i` with `tokens[i:i+n] == tokens[-n:]` and `i + n + k <= len(tokens)`;
- at the first n that has one, the latest such occurrence, and the k tokens after it;
- no n has one: no proposal.

So a proposal is exactly k tokens or nothing. vLLM 0.22.1's own `NgramProposer` differs in
two ways: it returns up to k tokens (the tokens after a match found near the end of the
context are cut short by the end), and among matches of the longest n it takes the earliest
in the context. Both are wrong for us: a row with fewer than k drafts breaks the uniform
1 + k decode batch that full CUDA graphs are captured for (and the MTP rows beside it
always carry k), and the latest occurrence is the one that reflects how the text is being
repeated now (a list or a file being re-emitted with edits), where the earliest reflects
its first draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramMatch:
    n: int  # length of the matched suffix
    start: int  # where its chosen earlier occurrence begins

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        at = self.start + self.n
        return list(tokens[at:at + k])


def check_bounds(k: int, n_min: int, n_max: int) -> None:
    """Refuses bounds no proposal can be made with (ValueError naming the rule)."""
    if k < 1:
        raise ValueError(f"k={k}: the draft length must be at least 1")
    if n_min < 1:
        raise ValueError(f"n_min={n_min}: the shortest n-gram must be at least 1 token")
    if n_max < n_min:
        raise ValueError(f"n_max={n_max} < n_min={n_min}: the n-gram bounds are reversed")


def find_match(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> NgramMatch | None:
    """The match the proposal copies from (see the module doc), or None."""
    check_bounds(k, n_min, n_max)
    size = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        last_start = size - n - k  # later starts lack k tokens after the occurrence
        if last_start < 0:
            continue
        suffix = list(tokens[size - n:])
        first = suffix[0]
        for i in range(last_start, -1, -1):
            if tokens[i] == first and list(tokens[i:i + n]) == suffix:
                return NgramMatch(n, i)
    return None


def propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Exactly k draft tokens copied from the context, or [] (see the module doc)."""
    match = find_match(tokens, k, n_min, n_max)
    return [] if match is None else match.draft(tokens, k)


def accepted_prefix(draft: Sequence[int], verified: Sequence[int]) -> int:
    """How many leading draft tokens the verifier kept: the common prefix of the draft and
    the tokens the target model produced at the same positions."""
    count = 0
    for d, v in zip(draft, verified, strict=False):
        if d != v:
            break
        count += 1
    return count
