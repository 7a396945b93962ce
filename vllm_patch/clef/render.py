"""How a scoring request becomes one prompt, and where the head reads it (pure).

The prompt is the input, then per question a question piece and one piece per option,
each tokenized on its own and joined, so every piece's last token is known exactly:

    input | "\\n\\nQuestion: " + text | "\\n- " + option | "\\n- " + option ...

(a score question's options are its range's values, written as integers). The head reads
the final hidden state at the last token of each question piece (role 0) and each option
piece (role 1), with the question's kind (its row in the head config's `kinds`). This
layout is ours, like the head's (docs/clef.md): the published Clef's rendering is not
known here; a converter or a new `architecture` name would pin it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.scoring import ScoreRequest

QUESTION_PREFIX = "\n\nQuestion: "
OPTION_PREFIX = "\n- "
QUESTION_ROLE, OPTION_ROLE = 0, 1

Tokenize = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    positions: list[int]  # prompt positions the head reads, questions' and options' alike
    roles: list[int]
    kinds: list[int]
    options: list[tuple[int, int]]  # per question: its options' range in `positions`


def render(req: ScoreRequest, tokenize: Tokenize, kinds: Sequence[str]) -> Rendered:
    """The prompt's tokens and the head's reading plan; ClefError if a piece is empty."""
    ids: list[int] = list(tokenize(req.input))
    pos: list[int] = []
    roles: list[int] = []
    kind_rows: list[int] = []
    groups: list[tuple[int, int]] = []

    def piece(text: str, role: int, kind: int, what: str) -> None:
        toks = list(tokenize(text))
        if not toks:
            raise ClefError(f"{what}: tokenizes to no tokens")
        ids.extend(toks)
        pos.append(len(ids) - 1)
        roles.append(role)
        kind_rows.append(kind)

    for i, q in enumerate(req.questions):
        if q.kind not in kinds:
            raise ClefError(f"questions[{i}].kind {q.kind!r}: the head scores {list(kinds)}")
        k = kinds.index(q.kind)
        piece(QUESTION_PREFIX + q.text, QUESTION_ROLE, k, f"questions[{i}].text")
        lo = len(pos)
        for j, o in enumerate(q.options):
            piece(OPTION_PREFIX + str(o), OPTION_ROLE, k, f"questions[{i}].options[{j}]")
        groups.append((lo, len(pos)))
    return Rendered(ids, pos, roles, kind_rows, groups)


def option_logits(r: Rendered, logits: Sequence[float]) -> list[list[float]]:
    """The head's per-position logits as one list per question, its options' only."""
    if len(logits) != len(r.positions):
        raise ClefError(f"the head gave {len(logits)} logits for {len(r.positions)} positions")
    return [list(logits[lo:hi]) for lo, hi in r.options]
