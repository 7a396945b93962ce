"""Which command-line words vLLM 0.22.1 reads as `--speculative-config` (pure).

vLLM keeps the last of two `--speculative-config` flags and only logs "Found duplicate keys"
(its FlexibleArgumentParser counts them, then argparse stores the last), so a second copy
silently replaces ours: the reference once served at k=1 that way. Besides the plain flag,
vLLM's parser takes `--speculative_config` (underscores become dashes before the first
dot), `--speculative-config=VALUE`, the dotted form `--speculative-config.KEY VALUE` (merged
into one JSON flag that is put after all the others, so it replaces an earlier full
value), the short alias `-sc` (also dotted or with `=`), and any abbreviation argparse can
resolve (`--speculative`). `reads_as_speculative_config` over-approximates the last two
(any `--` prefix of the name, anything starting with `-sc`): a word that vLLM would instead
refuse as ambiguous is refused here too, which costs nothing. tests/test_spec_config_once.py
runs each spelling through vLLM 0.22.1's own parser.
"""

from __future__ import annotations

from collections.abc import Sequence

LONG_NAME = "speculative-config"
SHORT = "-sc"


def reads_as_speculative_config(word: str) -> bool:
    """True when vLLM's parser would take `word` as its --speculative-config flag."""
    if word.startswith("--"):
        name = word[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        return bool(name) and LONG_NAME.startswith(name)
    return word.startswith(SHORT)


def speculative_config_words(argv: Sequence[str]) -> list[str]:
    """Every word of `argv` (after argv[0], the interpreter) that vLLM reads as the flag."""
    return [w for w in argv[1:] if reads_as_speculative_config(w)]
