"""bench/bench_ngram.py's oracle stepping: a copied stream yields about k + 1 tokens per step,
random ids yield exactly 1 (no draft), and the counts add up."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_ngram as bn


def test_a_copied_stream_is_accepted_almost_in_full() -> None:
    rng = random.Random(3)
    block = [rng.randrange(10_000) for _ in range(600)]
    row = bn.step_through(block + block, len(block) + 4, 3)
    assert row["draft_rate"] == 1.0 and row["acceptance"] == 1.0
    # Every step but possibly the last (cut by the stream's end) yields 1 + k tokens.
    assert row["tokens"] == len(block) - 4
    assert row["steps"] == -(-row["tokens"] // 4)


def test_random_ids_never_get_a_draft() -> None:
    stream, prompt = bn.random_tokens()
    row = bn.step_through(stream, prompt, 3)
    assert row["tokens_per_step"] == 1.0 and row["draft_rate"] == 0.0
    assert row["acceptance"] is None


def test_a_wrong_draft_still_advances_one_token() -> None:
    # The 2-gram (1, 2) repeats but what follows it changes: drafts are wrong.
    stream = [1, 2, 5, 6, 7, 1, 2, 8, 9, 4, 1, 2, 3, 3, 3]
    row = bn.step_through(stream, 12, 1)
    assert row["steps"] == row["tokens"] == 3
    assert row["acceptance"] == 0.0


def test_every_case_builds_a_stream_longer_than_its_prompt() -> None:
    for name, build in bn.CASES.items():
        stream, prompt = build()
        assert len(stream) > prompt + 100, name
        assert name in bn.CONSTRUCTION
