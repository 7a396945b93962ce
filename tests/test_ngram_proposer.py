"""The n-gram assist proposer's definition (vllm_patch/spec_decode/ngram.py).

Property tests check `find_match` / `propose` against a brute-force reading of the rule
written here independently (every start of every n, scanned forward): the result is empty or
exactly k tokens that follow an earlier occurrence of the matched suffix, the longest n with
such an occurrence wins, the latest occurrence wins, and empty means no n has one.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_patch.spec_decode.ngram import accepted_prefix, check_bounds, find_match, propose


def valid_starts(tokens: list[int], n: int, k: int) -> list[int]:
    """Every start of an occurrence of the n-token suffix with k tokens after it."""
    size = len(tokens)
    if n > size:
        return []
    suffix = tuple(tokens[size - n:])
    return [i for i in range(size) if i + n + k <= size and tuple(tokens[i:i + n]) == suffix]


# Small alphabets make matches common; the bounds cover k = 1, 3, 7 and more.
cases = st.tuples(
    st.lists(st.integers(0, 3), max_size=60) | st.lists(st.integers(0, 1), max_size=40),
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(0, 5),
)


@settings(max_examples=600, deadline=None)
@given(cases)
def test_proposal_is_k_tokens_after_the_latest_occurrence_of_the_longest_suffix(
        case: tuple[list[int], int, int, int]) -> None:
    tokens, k, n_min, extra = case
    n_max = n_min + extra
    draft = propose(tokens, k, n_min, n_max)
    match = find_match(tokens, k, n_min, n_max)
    assert len(draft) in (0, k)
    if match is None:
        assert draft == []
        assert all(not valid_starts(tokens, n, k) for n in range(n_min, n_max + 1))
        return
    n, i = match.n, match.start
    assert n_min <= n <= n_max
    # An earlier occurrence of the suffix, with the k tokens after it copied.
    assert tokens[i:i + n] == tokens[len(tokens) - n:] and i + n + k <= len(tokens)
    assert draft == tokens[i + n:i + n + k]
    # The longest n wins ...
    assert all(not valid_starts(tokens, longer, k) for longer in range(n + 1, n_max + 1))
    # ... and, at that n, the latest occurrence.
    assert i == max(valid_starts(tokens, n, k))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 8),
       st.integers(1, 3))
def test_periodic_text_always_gets_a_proposal(block: list[int], k: int, n_min: int) -> None:
    """A block repeated often enough that a period shift of at least k exists: the suffix
    occurs one such shift earlier with k tokens after it, so there is always a draft."""
    reps = -(-(k + n_min) // len(block)) + 1
    tokens = block * reps
    assert len(propose(tokens, k, n_min, n_min + 4)) == k


def test_worked_examples() -> None:
    #         0  1  2  3  4  5  6  7  8
    tokens = [5, 1, 2, 7, 8, 1, 2, 9, 1, 2]
    # Suffix (1, 2) occurs at 1 and 5; the latest one with 2 tokens after it is 5.
    assert find_match(tokens, 2, 2, 4) is not None
    assert propose(tokens, 2, 2, 4) == [9, 1]
    # k = 3 fits after both: still the latest.
    assert propose(tokens, 3, 2, 4) == [9, 1, 2]
    # k = 4: the occurrence at 5 has only 3 tokens after it; the one at 1 has 4+.
    assert propose(tokens, 4, 2, 4) == [7, 8, 1, 2]
    # Longest wins: (9, 1, 2)? no earlier; (1, 2) yes -> n = 2.
    assert find_match(tokens, 2, 2, 4).n == 2  # type: ignore[union-attr]
    # Nothing repeats: no proposal.
    assert propose([1, 2, 3, 4, 5], 3, 1, 4) == []
    # Too short a context for n_min.
    assert propose([1], 1, 2, 3) == []


def test_the_longest_suffix_wins_over_a_later_shorter_one() -> None:
    # (3, 1, 2) occurs at 0 with "4 4" after it; (1, 2) alone occurs later at 6 with "6 6".
    tokens = [3, 1, 2, 4, 4, 0, 1, 2, 6, 6, 3, 1, 2]
    assert propose(tokens, 2, 2, 3) == [4, 4]
    assert propose(tokens, 2, 2, 2) == [6, 6]


def test_differs_from_up_to_k_and_earliest() -> None:
    """Where vLLM's NgramProposer would return fewer than k tokens (the only match ends
    near the end of the context), this proposer returns nothing; where there are two
    occurrences, it copies from the latest, not the earliest."""
    tokens = [1, 2, 3, 1, 2]  # (1, 2) at 0 has 3 tokens after it: 3, 1, 2
    assert propose(tokens, 3, 2, 2) == [3, 1, 2]
    assert propose(tokens, 4, 2, 2) == []  # only 3 follow: never a short draft
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert propose(tokens, 1, 2, 2) == [8]  # the earliest would give 7


def test_bounds_are_checked() -> None:
    for k, lo, hi, word in ((0, 1, 2, "draft length"), (1, 0, 2, "shortest"),
                            (1, 3, 2, "reversed")):
        with pytest.raises(ValueError, match=word):
            check_bounds(k, lo, hi)
    check_bounds(3, 2, 8)


def test_accepted_prefix() -> None:
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 9]) == 3
    assert accepted_prefix([1, 2, 3], [9]) == 0
    assert accepted_prefix([1, 2, 3], [1]) == 1  # only as far as the verifier saw
    assert accepted_prefix([], [1]) == 0
