"""The one error class of Clef's CPU-side pieces.

`vllm_patch` may not import `sm70ctl` (so not `Sm70Error`): a `ClefError` is a `ValueError`
whose message is one line naming the file, tensor or field, the value and the rule broken.
Callers on the sm70ctl side turn it into an `Sm70Error`; the API side turns the request
errors into an HTTP 400 body (`scoring.error_body`).
"""

from __future__ import annotations


class ClefError(ValueError):
    """A Clef directory, setting or request we refuse; the message says which rule."""
