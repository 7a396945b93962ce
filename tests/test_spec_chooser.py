"""The per-request pick between MTP and n-gram drafts (vllm_patch/spec_decode/chooser.py).

The rule's cases one by one (cold start, no n-gram draft, ties, the margin), the EWMA, and
two simulated requests stepped through an oracle verifier: the n-gram drafts come from the
real proposer on the request's context, the verifier keeps each draft's common prefix with
the stream's true continuation, and MTP is a stand-in whose drafts are right token by token
with a fixed probability (seeded), the same on both streams. A block of code copied again
drives the request to n-gram; random text (n-gram drafts do occur, 2-grams repeat in a
small vocabulary, but their continuations are wrong) keeps MTP.
"""

from __future__ import annotations

import random

import pytest

from vllm_patch.spec_decode.chooser import (
    Acceptance,
    check_weights,
    choose,
    counterfactual,
    ewma,
    observe,
)
from vllm_patch.spec_decode.ngram import accepted_prefix, propose

K = 3


def test_cold_start_is_mtp() -> None:
    assert choose(Acceptance(), ngram_has_draft=True) == "mtp"
    assert choose(Acceptance(), ngram_has_draft=False) == "mtp"
    assert choose(Acceptance(mtp=2.0), ngram_has_draft=True) == "mtp"


def test_without_an_ngram_draft_it_is_mtp_whatever_was_measured() -> None:
    assert choose(Acceptance(mtp=0.0, ngram=3.0), ngram_has_draft=False) == "mtp"


def test_ngram_needs_more_than_the_margin() -> None:
    assert choose(Acceptance(mtp=1.0, ngram=1.26), ngram_has_draft=True, margin=0.25) == "ngram"
    assert choose(Acceptance(mtp=1.0, ngram=1.25), ngram_has_draft=True, margin=0.25) == "mtp"
    assert choose(Acceptance(mtp=2.0, ngram=1.0), ngram_has_draft=True) == "mtp"


def test_ties_keep_mtp() -> None:
    assert choose(Acceptance(mtp=2.0, ngram=2.0), ngram_has_draft=True, margin=0.0) == "mtp"
    assert choose(Acceptance(mtp=2.0, ngram=2.1), ngram_has_draft=True, margin=0.0) == "ngram"


def test_measured_ngram_beats_unmeasured_mtp() -> None:
    assert choose(Acceptance(ngram=0.5), ngram_has_draft=True) == "ngram"


def test_ewma() -> None:
    assert ewma(None, 3) == 3.0
    assert ewma(2.0, 3, alpha=0.25) == pytest.approx(2.25)
    assert ewma(2.0, 3, alpha=1.0) == 3.0
    s = observe(Acceptance(mtp=1.0, ngram=2.0), mtp=3, ngram=None, alpha=0.5)
    assert s == Acceptance(mtp=2.0, ngram=2.0)  # no n-gram draft: its value is kept
    s = observe(Acceptance(), mtp=None, ngram=1, alpha=0.5)
    assert s == Acceptance(mtp=None, ngram=1.0)


def test_weights_and_counts_are_checked() -> None:
    for alpha, margin, word in ((0.0, 0.1, "EWMA weight"), (1.5, 0.1, "EWMA weight"),
                                (0.5, -1.0, "margin")):
        with pytest.raises(ValueError, match=word):
            check_weights(alpha, margin)
    check_weights(1.0, 0.0)
    assert counterfactual(2, 1, K) == 2  # saw 2 tokens, matched both: at least 2
    assert counterfactual(4, 3, K) == 3  # the bonus position is not a draft token
    with pytest.raises(ValueError, match="produced only"):
        counterfactual(3, 1, K)
    with pytest.raises(ValueError, match="within"):
        counterfactual(0, 4, K)


def _simulate(stream: list[int], prompt_len: int, mtp_hit: float, seed: int,
              n_min: int = 2, n_max: int = 8) -> tuple[list[str], Acceptance]:
    """Steps a request through the oracle verifier; returns the method of every step."""
    rng = random.Random(seed)
    pos, state, methods = prompt_len, Acceptance(), []
    while pos + K + 1 <= len(stream):
        truth = stream[pos:pos + K + 1]  # what the target model would produce
        mtp_draft = []
        for t in truth[:K]:  # right token by token with probability mtp_hit
            mtp_draft.append(t if rng.random() < mtp_hit else -1)
        ngram_draft = propose(stream[:pos], K, n_min, n_max)
        method = choose(state, ngram_has_draft=bool(ngram_draft))
        chosen = ngram_draft if method == "ngram" else mtp_draft
        accepted = accepted_prefix(chosen, truth[:K])
        verified = truth[:accepted + 1]
        other = mtp_draft if method == "ngram" else ngram_draft
        other_acc = (counterfactual(accepted_prefix(other, verified), accepted, K)
                     if other else None)
        mtp_s, ngram_s = (other_acc, accepted) if method == "ngram" else (accepted, other_acc)
        state = observe(state, mtp=mtp_s, ngram=ngram_s)
        methods.append(method)
        pos += accepted + 1
    return methods, state


def test_a_copied_block_drives_the_request_to_ngram() -> None:
    rng = random.Random(7)
    block = [rng.randrange(5000) for _ in range(400)]  # a "file": distinct-ish tokens
    stream = block + block  # the prompt holds the file; the answer copies it
    methods, state = _simulate(stream, prompt_len=len(block) + 8, mtp_hit=0.6, seed=1)
    tail = methods[5:]
    assert tail.count("ngram") / len(tail) > 0.9
    assert state.ngram is not None and state.mtp is not None and state.ngram > state.mtp


def test_random_text_keeps_mtp() -> None:
    rng = random.Random(8)
    stream = [rng.randrange(40) for _ in range(3000)]  # 2-grams repeat, continuations do not
    methods, state = _simulate(stream, prompt_len=1000, mtp_hit=0.6, seed=2)
    assert state.ngram is not None  # n-gram drafts existed and were measured ...
    assert methods.count("ngram") / len(methods) < 0.1  # ... and lost
    assert methods[0] == "mtp"
