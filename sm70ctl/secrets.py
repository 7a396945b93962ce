"""The one masking rule: which variable names hold secrets, and how their values are hidden.

Every place a value can be printed, logged, recorded or hashed asks this module. A name is
secret when it is one of the schema's secrets, a well-known secret variable (VLLM_API_KEY,
HF_TOKEN...), looks like one (`*_TOKEN`, `*_API_KEY`, `*SECRET*`, `*PASSWORD*`...), or is a
near-miss of one by edit distance (`SM70_API_KYE`): a typo must not turn a key into text
that `env check` echoes. Values of secret variables are also removed from free text (log
lines, error messages), since a key can leak through a variable with an innocent name.

The bottom layer: imports nothing from sm70ctl, so every package may use it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "KNOWN_SECRETS",
    "MASK",
    "SCHEMA_SECRETS",
    "fingerprint_env",
    "is_secret_name",
    "mask_argv",
    "mask_env",
    "mask_value",
    "redact",
    "scrub",
    "secret_values",
]

MASK = "***"

# The schema's `secret: true` variables (a test keeps this equal to env_schema.yaml; the
# schema is not loaded here so that the lowest layers can use the rule).
SCHEMA_SECRETS = frozenset({"SM70_API_KEY", "SM70_HF_TOKEN"})

KNOWN_SECRETS = SCHEMA_SECRETS | frozenset({
    "VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN",
    "OPENAI_API_KEY", "GITHUB_TOKEN", "GH_TOKEN", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "WANDB_API_KEY", "NGC_API_KEY", "HF_API_TOKEN",
})

# Whole words (between underscores) that mark a secret.
_SECRET_WORDS = frozenset({
    "TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "PWD",
    "CREDENTIAL", "CREDENTIALS", "AUTH", "COOKIE",
})
# Anywhere in the name (`*PASSWORD*`, `*SECRET*`), or a word ending so (`HFTOKEN`).
_SECRET_ANYWHERE = re.compile(r"PASSWORD|PASSWD|SECRET|CREDENTIAL|PRIVATE_?KEY")
_SECRET_WORD_END = re.compile(r"(?:TOKEN|APIKEY|ACCESSKEY|SECRETKEY|AUTHKEY)$")
# Close to a secret word by one edit (`TOKNE`, `SECERT`, `PASWORD`), or, for two adjacent
# words joined, to these pairs (`API_KYE` -> APIKYE ~ APIKEY).
_NEAR_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
_NEAR_PAIRS = ("APIKEY", "ACCESSKEY", "SECRETKEY", "PRIVATEKEY", "AUTHTOKEN", "HFTOKEN")
# Ordinary words one edit from a secret word; the shell's working-directory variables.
_PLAIN_WORDS = frozenset({"TOKENS", "TAKEN", "KEYS"})
_PLAIN_NAMES = frozenset({"PWD", "OLDPWD"})


def edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap of neighbours) turning `a` into `b`."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _near(word: str, targets: Iterable[str], limit: int) -> bool:
    return any(abs(len(word) - len(t)) <= limit and edit_distance(word, t) <= limit
               for t in targets)


def is_secret_name(name: str) -> bool:
    """Whether a variable of this name may hold a secret (and its value must be masked)."""
    upper = name.upper()
    if upper in _PLAIN_NAMES:
        return False
    if upper in KNOWN_SECRETS or _SECRET_ANYWHERE.search(upper):
        return True
    words = [w for w in re.split(r"[^A-Z0-9]+", upper) if w]
    for word in words:
        if word in _PLAIN_WORDS:
            continue
        # TOKEN* errs towards masking (TOKENIZERS_PARALLELISM): a hidden harmless flag
        # costs less than a shown secret; only the counting word TOKENS is plain.
        if word in _SECRET_WORDS or _SECRET_WORD_END.search(word) or word.startswith("TOKEN"):
            return True
        if len(word) >= 5 and _near(word, _NEAR_WORDS, 1):
            return True
    for a, b in itertools.pairwise(words):
        if _near(a + b, _NEAR_PAIRS, 1):
            return True
    # A misspelt known secret (SM70_APIKEY, SM70_HF_TOKN): two edits on the whole name.
    return len(upper) >= 6 and _near(upper, KNOWN_SECRETS, 2)


def mask_value(name: str, value: str) -> str:
    """The value as it may be shown: MASK for a set secret, else the value itself."""
    return MASK if value and is_secret_name(name) else value


def secret_values(environ: Mapping[str, str], extra: Iterable[str | None] = ()) -> list[str]:
    """The values to remove from free text: those of secret-named variables, plus `extra`
    (e.g. the settings' own secrets); longest first so a key containing another is whole."""
    found = {v for k, v in environ.items() if v and is_secret_name(k)}
    found.update(v for v in extra if v)
    return sorted(found, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret value replaced by MASK."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def mask_env(env: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    """A copy of an environment safe to show: secret names masked, and any value that
    carries a known secret value masked whole."""
    values = [s for s in secrets if s]
    out = {}
    for key, value in env.items():
        hidden = (value and is_secret_name(key)) or any(s in value for s in values)
        out[key] = MASK if hidden else value
    return out


def fingerprint_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment as it may enter a fingerprint or a manifest: a secret contributes
    only the fact that it is set, so the hash changes when a key appears or goes but
    neither the hash nor the stored inputs reveal (or let anyone test guesses of) it."""
    return {k: ("<set>" if v else "") if is_secret_name(k) else v for k, v in env.items()}


def mask_argv(argv: Iterable[str], flags: Iterable[str] = ("--api-key",),
              secrets: Iterable[str] = ()) -> list[str]:
    """A command line safe to print: values of secret flags (`--api-key X`, `--api-key=X`)
    masked, and any known secret value removed from the other arguments."""
    flags = tuple(flags)
    values = [s for s in secrets if s]
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in flags:
            if eq:
                out.append(f"{flag}={MASK}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact(arg, values))
    return out


def scrub(data: Any, secrets: Iterable[str] = (), _depth: int = 0) -> Any:
    """A JSON-like structure safe to write to a record: values under secret-named keys
    masked, and known secret values removed from every string."""
    values = [s for s in secrets if s]
    if _depth > 200:  # data the tool built itself; deeper means a cycle
        raise ValueError("scrub: structure nested too deeply")
    if isinstance(data, Mapping):
        out = {}
        for key, value in data.items():
            if isinstance(key, str) and is_secret_name(key) and isinstance(value, str) and value:
                out[key] = MASK
            else:
                out[redact(key, values) if isinstance(key, str) else key] = scrub(
                    value, values, _depth + 1)
        return out
    if isinstance(data, (list, tuple)):
        return [scrub(v, values, _depth + 1) for v in data]
    if isinstance(data, str):
        return redact(data, values)
    return data
