"""What the tiny test checkpoint needs to be served like the real model (pure data + writers).

vLLM's parsers look their markers up as single tokens (qwen3_coder refuses to start without
`<tool_call>`/`</tool_call>`; the qwen3 reasoning parser finds the end of reasoning by the
`</think>` id), so these are added tokens at fixed ids, not special ones: special tokens are
dropped from the served text and the text-based parsers would never see them. The chat
template (tiny_chat_template.jinja, ours) renders tools, tool calls and <think> blocks in
the format those parsers read. The Qwen3-VL processor vLLM builds for
Qwen3_5ForConditionalGeneration reads preprocessor_config.json (images) and
video_preprocessor_config.json (videos); their pixel bounds are small so that vLLM's
start-up profiling with the largest image and video stays within a tiny context.

`make_checkpoint.py` calls `add_serving_tokens` and `write_serving_files`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE_PATH = HERE / "tiny_chat_template.jinja"

# Added (non-special) tokens, in id order from FIRST_SERVING_OFFSET below the vocab size.
SERVING_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>")
# make_checkpoint puts eos at vocab - 64 and its 7 special tokens at vocab - 63 .. - 57.
FIRST_SERVING_OFFSET = 56

PATCH = 16
MERGE = 2
TEMPORAL = 2
FACTOR = PATCH * MERGE  # image sides are rounded to multiples of this
MIN_PIXELS = 4 * FACTOR * FACTOR  # 64 x 64
MAX_PIXELS = 256 * 256
VIDEO_MAX_PIXELS = 8 * 128 * 128  # over all frames of one video
MEAN = [0.5, 0.5, 0.5]
STD = [0.5, 0.5, 0.5]


def serving_token_ids(vocab: int) -> dict[str, int]:
    if vocab < 256 + 64:
        raise ValueError(f"vocab {vocab} leaves no room for the serving tokens")
    return {tok: vocab - FIRST_SERVING_OFFSET + i for i, tok in enumerate(SERVING_TOKENS)}


def chat_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text()


def image_processor_config() -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True,
        "image_mean": MEAN, "image_std": STD,
        "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def video_processor_config() -> dict[str, Any]:
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True,
        "image_mean": MEAN, "image_std": STD,
        "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
        "do_sample_frames": False, "fps": 2, "min_frames": 2, "max_frames": 8,
    }


def image_tokens(height: int, width: int) -> int:
    """Placeholder tokens one image of these sides expands to, for sides that are
    multiples of FACTOR and within the pixel bounds (the processor leaves those as they
    are): one token per MERGE x MERGE block of PATCH x PATCH patches."""
    if height % FACTOR or width % FACTOR:
        raise ValueError(f"image {height}x{width}: sides must be multiples of {FACTOR}")
    if not MIN_PIXELS <= height * width <= MAX_PIXELS:
        raise ValueError(f"image {height}x{width}: pixels outside [{MIN_PIXELS}, {MAX_PIXELS}]")
    return (height // PATCH) * (width // PATCH) // (MERGE * MERGE)


def add_serving_tokens(table: dict[str, int], vocab: int) -> list[str]:
    """Put the serving tokens into a tokenizer vocab table at their ids (before fillers)."""
    ids = serving_token_ids(vocab)
    taken = {i: t for t, i in table.items()}
    for tok, i in ids.items():
        if i in taken and taken[i] != tok:
            raise ValueError(f"id {i} for {tok} is already {taken[i]!r}")
        table[tok] = i
    return list(ids)


def write_serving_files(out: Path) -> list[str]:
    """The processor configs beside the checkpoint; returns the file names written."""
    files = {"preprocessor_config.json": image_processor_config(),
             "video_preprocessor_config.json": video_processor_config()}
    for name, data in files.items():
        (Path(out) / name).write_text(json.dumps(data, indent=1))
    return sorted(files)
