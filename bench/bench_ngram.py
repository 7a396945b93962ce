"""What the n-gram assist proposer alone would give, measured on the CPU on synthetic streams.

This is the proposer's acceptance against each stream's ground-truth continuation: an oracle
verifier keeps a draft's common prefix with the true next tokens and adds the one token the
target model always produces, so a step yields accepted + 1 tokens (1 without a draft). It
is NOT served tokens per second: no model runs, a step's cost is not modelled, and MTP
(whose acceptance needs real weights) is not part of it. It tells how often the n-gram
assist has a draft and how much of it a perfect verifier would keep, per kind of text.

The streams (a token is a word or a punctuation mark with the whitespace before it, the way
BPE vocabularies fold a leading space into the word, numbered in order of first appearance;
random tokens are drawn from the model's 248,320 ids):
- code-copied: a source file of this repository, then the same file again; the prompt is
  the first copy plus 8 tokens of the second, the continuation the rest of the second.
- code-edited: the same, but in the second copy every 7th line has its words reversed (a
  re-emitted file with edits).
- numbered-list: lines "N. <verb> the <noun> of <name> (<value>)" from small word lists,
  seeded; the prompt is the first 40 lines, the continuation the next lines (repeated
  structure, fresh content).
- docs-prose: this repository's docs/ARCHITECTURE.md in order; the prompt is its first
  1,500 tokens, the continuation what follows (ordinary technical prose).
- shuffled-corpus: the words of the repository's docs shuffled (seeded): natural word
  frequencies, no order.
- random-tokens: uniform random ids (seeded).

    python bench/bench_ngram.py [--json] [--out bench/results/cpu_ngram.json]
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sm70ctl.output import Output, make_table
from vllm_patch.spec_decode.ngram import accepted_prefix, propose

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_json

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 248_320
N_MIN, N_MAX = 2, 8  # SM70_NGRAM_MIN / SM70_NGRAM_MAX defaults
KS = (1, 3, 7)  # the draft lengths the settings allow
MAX_NEW = 1_200  # continuation tokens stepped through per case
CODE_FILE = ROOT / "sm70ctl" / "runtime" / "command_line.py"
PROSE_FILE = ROOT / "docs" / "ARCHITECTURE.md"
WORD = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


def tokenize(text: str, ids: dict[str, int]) -> list[int]:
    return [ids.setdefault(w, len(ids)) for w in WORD.findall(text)]


def code_copied() -> tuple[list[int], int]:
    ids: dict[str, int] = {}
    body = tokenize(CODE_FILE.read_text(), ids)
    return body + body, len(body) + 8


def code_edited() -> tuple[list[int], int]:
    ids: dict[str, int] = {}
    text = CODE_FILE.read_text()
    lines = text.splitlines(keepends=True)
    edited = [" ".join(reversed(line.split())) + "\n" if i % 7 == 3 else line
              for i, line in enumerate(lines)]
    first = tokenize(text, ids)
    return first + tokenize("".join(edited), ids), len(first) + 8


def numbered_list() -> tuple[list[int], int]:
    rng = random.Random(11)
    verbs = ["check", "count", "load", "pin", "sort", "trim", "keep", "drop", "copy", "read"]
    nouns = ["block", "graph", "cache", "row", "page", "token", "state", "head", "pool"]
    names = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    lines = [f"{i}. {rng.choice(verbs)} the {rng.choice(nouns)} of {rng.choice(names)} "
             f"({rng.randrange(1000)})\n" for i in range(1, 400)]
    ids: dict[str, int] = {}
    prompt = tokenize("".join(lines[:40]), ids)
    return prompt + tokenize("".join(lines[40:]), ids), len(prompt)


def docs_prose() -> tuple[list[int], int]:
    return tokenize(PROSE_FILE.read_text(), {}), 1_500


def shuffled_corpus() -> tuple[list[int], int]:
    words = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        words += path.read_text().split()
    random.Random(12).shuffle(words)
    return tokenize(" ".join(words), {}), 1_500


def random_tokens() -> tuple[list[int], int]:
    rng = random.Random(13)
    return [rng.randrange(VOCAB) for _ in range(1_500 + MAX_NEW + 8)], 1_500


CONSTRUCTION = {
    "tokens": "a word or punctuation mark with its leading whitespace, ids by first appearance",
    "code-copied": f"{CODE_FILE.relative_to(ROOT)} twice; prompt = first copy + 8 tokens",
    "code-edited": "as code-copied, every 7th line of the second copy has its words reversed",
    "numbered-list": "399 seeded lines 'N. <verb> the <noun> of <name> (<value>)'; prompt = "
                     "40 lines",
    "docs-prose": f"{PROSE_FILE.relative_to(ROOT)} in order; prompt = first 1,500 tokens",
    "shuffled-corpus": "the words of docs/*.md shuffled (seed 12); prompt = 1,500 tokens",
    "random-tokens": f"uniform ids below {VOCAB:,} (seed 13); prompt = 1,500 tokens",
}

CASES: dict[str, Callable[[], tuple[list[int], int]]] = {
    "code-copied": code_copied,
    "code-edited": code_edited,
    "numbered-list": numbered_list,
    "docs-prose": docs_prose,
    "shuffled-corpus": shuffled_corpus,
    "random-tokens": random_tokens,
}


def step_through(stream: list[int], prompt_len: int, k: int) -> dict[str, Any]:
    """Oracle verification of the proposer's drafts from `prompt_len` on (module doc)."""
    end = min(len(stream), prompt_len + MAX_NEW)
    pos = prompt_len
    steps = drafted = proposed = accepted_total = full = 0
    spent = 0.0
    while pos < end:
        t0 = time.perf_counter()
        draft = propose(stream[:pos], k, N_MIN, N_MAX)
        spent += time.perf_counter() - t0
        accepted = accepted_prefix(draft, stream[pos:pos + k]) if draft else 0
        steps += 1
        if draft:
            drafted += 1
            proposed += k
            accepted_total += accepted
            full += accepted == k
        pos += accepted + 1
    produced = pos - prompt_len
    return {
        "k": k,
        "prompt_tokens": prompt_len,
        "tokens": produced,
        "steps": steps,
        "tokens_per_step": round(produced / steps, 3),
        "draft_rate": round(drafted / steps, 3),
        "acceptance": round(accepted_total / proposed, 3) if proposed else None,
        "accepted_per_drafted_step": round(accepted_total / drafted, 3) if drafted else None,
        "full_accept_rate": round(full / drafted, 3) if drafted else None,
        "proposer_ms_per_call": round(spent / steps * 1000, 3),
    }


def main() -> None:
    rows = []
    for name, build in CASES.items():
        stream, prompt_len = build()
        for k in KS:
            rows.append({"case": name, **step_through(stream, prompt_len, k)})
    doc = {
        "what": ("n-gram proposer's acceptance against the ground-truth continuation, oracle "
                 "verifier, on the CPU; not served tokens per second, no model and no MTP"),
        "proposer": "vllm_patch.spec_decode.ngram.propose (pure-Python reference)",
        "n_min": N_MIN, "n_max": N_MAX, "max_new_tokens": MAX_NEW,
        "construction": CONSTRUCTION,
        "inputs_sha256": {str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest()
                          for f in [CODE_FILE, *sorted((ROOT / "docs").glob("*.md"))]},
        "rows": rows,
    }
    if "--out" in sys.argv:
        path = Path(sys.argv[sys.argv.index("--out") + 1])
        write_json(path, doc, newline=True)

    def fmt(v: object) -> str:
        return "-" if v is None else str(v)

    Output("--json" in sys.argv).emit(doc, lambda c: c.print(make_table(
        "n-gram proposer alone, oracle verifier (tokens per step = accepted + 1)",
        ["case", "k", "tokens/step", "draft rate", "acceptance", "accepted/drafted",
         "full accept", "ms/call"],
        [[r["case"], r["k"], r["tokens_per_step"], r["draft_rate"], fmt(r["acceptance"]),
          fmt(r["accepted_per_drafted_step"]), fmt(r["full_accept_rate"]),
          r["proposer_ms_per_call"]] for r in rows])))


if __name__ == "__main__":
    main()
