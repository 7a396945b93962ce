"""Pure bookkeeping of the prompt-logprobs path: which prompt positions one engine step
fills for a request, and how a run of rows splits into slices. No torch, no vLLM.

A prompt of P tokens has P - 1 prompt logprobs: position i scores token i + 1 given
tokens 0..i. A request whose prefill is chunked fills them chunk by chunk: with C tokens
already computed and N scheduled this step, the step's hidden rows 0..N-1 are positions
C..C+N-1, except that the last chunk has one row more than positions left (the final
prompt token predicts the first generated token, not a prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptStep:
    """What one engine step does for one request's prompt logprobs."""

    start: int  # first position filled (a row of the request's [P - 1, k + 1] CPU tensors)
    rows: int  # positions filled; 0 or less: nothing to compute this step
    last: bool  # after this step the request's prompt logprobs are complete

    @property
    def first_target(self) -> int:
        """Index in the prompt of the token position `start` scores."""
        return self.start + 1


def plan_step(prompt_len: int, num_computed: int, num_scheduled: int) -> PromptStep:
    """The step for a request of `prompt_len` prompt tokens with `num_computed` already
    computed and `num_scheduled` scheduled now.

    A chunk that ends exactly on the last prompt token (`rows` == positions left) is not
    the last step: vLLM hands the finished tensors back with the step that also has the
    first generated token, so the output processor sees prompt and sample together.
    """
    if prompt_len < 1 or num_computed < 0 or num_scheduled < 0:
        raise ValueError(f"prompt_len {prompt_len}, num_computed {num_computed}, "
                         f"num_scheduled {num_scheduled}: must be >= 1, >= 0, >= 0")
    left = prompt_len - 1 - num_computed
    if num_scheduled <= left:
        return PromptStep(start=num_computed, rows=num_scheduled, last=False)
    return PromptStep(start=num_computed, rows=left, last=True)


def slice_bounds(rows: int, per_slice: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive slices of at most `per_slice` rows covering `rows`."""
    if per_slice < 1:
        raise ValueError(f"logprobs.prompt_chunk is {per_slice}: a slice needs at least 1 row")
    if rows < 0:
        raise ValueError(f"rows is {rows}: must be >= 0")
    return [(a, min(a + per_slice, rows)) for a in range(0, rows, per_slice)]
