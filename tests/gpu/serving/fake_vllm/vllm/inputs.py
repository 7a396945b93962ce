"""The fake's TokensPrompt (vLLM's is a TypedDict too)."""

from typing import TypedDict


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
