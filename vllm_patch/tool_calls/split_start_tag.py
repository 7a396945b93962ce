"""R9 of ../runtime_patches/README.md: a streamed qwen3_coder tool call whose `<tool_call>`
is spelled in several tokens.

The bug (vLLM 0.22.1, `Qwen3CoderToolParser.extract_tool_calls_streaming`): outside a call,
the parser starts one only when this delta's token ids hold the `<tool_call>` token or this
delta's text holds the whole tag. A decoder may spell the tag in pieces (one byte token per
character, `<tool` + `_call>`, ...): with `VLLM_ENFORCE_STRICT_TOOL_CALLING=1` a named or
required tool choice is a structural tag that xgrammar matches on text, so every spelling
of `<tool_call>` is allowed. Each piece is then streamed as content, the parser never
starts, and the stream ends with the call's XML as content and no tool call, while the
non-streamed answer (a regex over the whole text) has the call.

The fix: while no call is open, text that could be the start of `<tool_call>` (the longest
suffix of what arrived that is a proper prefix of the tag) is held back instead of streamed
as content. When the held text and the next deltas complete the tag, vLLM's method gets
them as one delta holding the whole tag, exactly as if the tag had come in one token; when
they stop matching, the held text goes out as content in front of the next delta. A
stream that ends with the held text unresolved: an empty final delta (the end-of-sequence
token) gives it out as content; a stream cut by max_tokens or a stop string right there
loses at most the tag's first ten characters of content. Inside a call vLLM's method runs
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_patch import rebind

TARGET = rebind.Target(
    module="vllm.tool_parsers.qwen3coder_tool_parser", owner="Qwen3CoderToolParser",
    attr="extract_tool_calls_streaming", version="0.22.1",
    params=("self", "previous_text", "current_text", "delta_text", "previous_token_ids",
            "current_token_ids", "delta_token_ids", "request"),
    # the state and markers of the 0.22.1 start detection this fix feeds
    names=frozenset({"_reset_streaming_state", "is_tool_call_started", "tool_call_start_token",
                     "tool_call_start_token_id"}),
    mark="__sm70_split_start_tag__")
HELD_ATTR = "_sm70_held_start"  # on the parser: text held back as a possible tag start


class SplitTagPatchError(rebind.RebindError):
    """The rebinding's target is not the function it was written against."""


def split_held(pending: str, tag: str) -> tuple[str, str]:
    """(text to stream now, text to hold) for `pending`, which does not contain `tag`: the
    held part is the longest suffix of `pending` that is a proper, non-empty prefix of
    `tag`; everything before it can no longer be part of the tag."""
    if not tag:
        raise ValueError("the tool-call start tag is empty")
    if tag in pending:
        raise ValueError(f"{pending!r} holds the whole tag {tag!r}: nothing to hold back")
    for n in range(min(len(pending), len(tag) - 1), 0, -1):
        if tag.startswith(pending[-n:]):
            return pending[:-n], pending[-n:]
    return pending, ""


def plan_delta(held: str, delta_text: str, delta_token_ids: Sequence[int], tag: str,
               tag_id: int | None) -> tuple[str, str]:
    """What one delta outside a call does: (delta text to hand vLLM's method, text held
    after it). Pure: the CPU tests' subject. A delta that completes the tag (or carries its
    token) goes on whole, with what was held in front of it.

    An empty delta text keeps what is held unless ids came with it (the end-of-sequence
    token, whose text is dropped): then the held text is handed on, as content."""
    if not delta_text:
        return (held, "") if held and delta_token_ids else ("", held)
    pending = held + delta_text
    if tag in pending or (tag_id is not None and tag_id in delta_token_ids):
        return pending, ""
    return split_held(pending, tag)


def wrap(original: Any) -> Any:
    def extract_tool_calls_streaming(self: Any, previous_text: str, current_text: str,
                                     delta_text: str, previous_token_ids: Sequence[int],
                                     current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> Any:
        if not previous_text:  # vLLM's method resets its state on a new message
            self.__dict__[HELD_ATTR] = ""
        started = self.is_tool_call_started and bool(previous_text)
        held = self.__dict__.get(HELD_ATTR, "")
        if started:
            return original(self, previous_text, current_text, delta_text, previous_token_ids,
                            current_token_ids, delta_token_ids, request)
        text, keep = plan_delta(held, delta_text, delta_token_ids, self.tool_call_start_token,
                                self.tool_call_start_token_id)
        self.__dict__[HELD_ATTR] = keep
        if delta_text and not text:
            return None  # all of it held
        if not delta_text and text:  # end of sequence: the held text was content after all
            from vllm.entrypoints.openai.engine.protocol import DeltaMessage

            return DeltaMessage(content=text)
        return original(self, previous_text, current_text, text, previous_token_ids,
                        current_token_ids, delta_token_ids, request)

    return extract_tool_calls_streaming


_INSTALLER = rebind.Installer(TARGET, wrap, "acts while no qwen3_coder call is open",
                              SplitTagPatchError)
install = _INSTALLER.install
install_or_refuse = _INSTALLER.install_or_refuse
outcome = _INSTALLER.outcome
install_when_imported = _INSTALLER.install_when_imported
