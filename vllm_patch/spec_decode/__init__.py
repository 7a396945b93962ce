"""Speculative decoding on sm_70: the n-gram assist next to MTP (docs/spec_decode.md).

`ngram` is the proposer's definition (pure Python, the reference), `ngram_batch` its
vectorised torch form for the model runner, `chooser` the per-request pick between MTP and
n-gram by measured acceptance. Nothing here is wired into vLLM yet.
"""
