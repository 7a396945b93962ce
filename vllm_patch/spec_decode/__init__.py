"""Speculative decoding on sm_70: the n-gram assist next to MTP (docs/spec_decode.md).

`ngram` is the proposer's definition (pure Python, the reference), `batch` its vectorised
torch form, `chooser` the per-request pick between MTP and n-gram by measured acceptance,
`assist` the per-request state the model runner keeps, and `runner_hook` the wrapper around
vLLM 0.22.1's `GPUModelRunner.propose_draft_token_ids` that applies it (runtime patch
R-ASSIST; armed by the plugin when `spec.ngram_assist` is on).

Two fixes of vLLM 0.22.1's speculative decoding on a hybrid model, both found by the H200
matrix `tests/gpu/serving/device_spec_diag.py` in stock vLLM and ours alike:
`accepted_state` (R7: the GDN state of a decode step without drafts after accepted drafts)
and `prefix_state` (R8: prefix-cache hits with MTP that full attention does not cover).
"""
