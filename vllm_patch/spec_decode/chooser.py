"""Per request, MTP or n-gram drafts for the next step, by measured acceptance (pure Python).

Each request keeps an exponentially weighted moving average (EWMA) of accepted draft tokens
per step for each method. Both are measured on every step where the method had a draft,
not only the chosen one: the MTP layer runs for every row anyway (n-gram rows replace its
drafts after it ran), and the verifier's output tells how many leading tokens of the draft
that was not used would have been kept (`counterfactual`). That count is exact when the
chosen draft was accepted in full (the verifier then produced k + 1 tokens) and a lower
bound otherwise (it saw only accepted + 1 positions); a method that is really better still
overtakes, because its lower bound then exceeds the other's exact count.

The rule (`choose`): no n-gram draft this step, or no n-gram measurement yet (cold start),
means MTP; n-gram needs an EWMA above MTP's by more than `margin`, so ties keep MTP. MTP is
the default because it is what the deployment is sized and tuned for (the reference's MTP
k=3); n-gram has to measure better before a row carries its drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Method = Literal["mtp", "ngram"]

# A request that turns from prose to copying a block should switch within a few steps: the
# last step weighs a quarter, older steps fade geometrically.
DEFAULT_ALPHA = 0.25
# One step's acceptance moves by whole tokens; a quarter token keeps noise in the lower
# bounds from flipping a request back and forth between equal methods.
DEFAULT_MARGIN = 0.25


@dataclass(frozen=True)
class Acceptance:
    """A request's EWMA of accepted draft tokens per step; None until measured."""

    mtp: float | None = None
    ngram: float | None = None


def check_weights(alpha: float, margin: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: the EWMA weight must be in (0, 1]")
    if margin < 0.0:
        raise ValueError(f"margin={margin}: the n-gram margin must be >= 0 tokens")


def ewma(previous: float | None, sample: float, alpha: float = DEFAULT_ALPHA) -> float:
    """The first sample is taken as is; later ones move the average by `alpha` of the gap."""
    if previous is None:
        return float(sample)
    return previous + alpha * (sample - previous)


def observe(state: Acceptance, *, mtp: float | None, ngram: float | None,
            alpha: float = DEFAULT_ALPHA) -> Acceptance:
    """The state after one step; a method with no draft this step (None) keeps its value."""
    return Acceptance(
        mtp=state.mtp if mtp is None else ewma(state.mtp, mtp, alpha),
        ngram=state.ngram if ngram is None else ewma(state.ngram, ngram, alpha),
    )


def choose(state: Acceptance, *, ngram_has_draft: bool,
           margin: float = DEFAULT_MARGIN) -> Method:
    """The method whose drafts this request's row carries next step (see the module doc)."""
    if not ngram_has_draft or state.ngram is None:
        return "mtp"
    if state.mtp is None:  # measured n-gram against an unmeasured MTP
        return "ngram"
    return "ngram" if state.ngram > state.mtp + margin else "mtp"


def counterfactual(unused_draft_match: int, chosen_accepted: int, k: int) -> int:
    """Accepted tokens the unused draft would have had: its common prefix with the tokens
    the verifier produced (`unused_draft_match`, at most chosen_accepted + 1 of them),
    capped at k. Exact when chosen_accepted == k, a lower bound otherwise."""
    if not 0 <= chosen_accepted <= k:
        raise ValueError(f"accepted={chosen_accepted}: must be within 0..k={k}")
    if not 0 <= unused_draft_match <= chosen_accepted + 1:
        raise ValueError(f"match={unused_draft_match}: the verifier produced only "
                         f"{chosen_accepted + 1} tokens to compare with")
    return min(unused_draft_match, k)
