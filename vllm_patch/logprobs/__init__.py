"""Bounded prompt logprobs (issue 24 item 5): full-vocabulary logits, log-softmax and the
top-k / target gather computed a slice of rows at a time. `plan` is pure bookkeeping,
`slices` the torch computation, `runner_patch` the checked rebinding of vLLM 0.22.1's
`GPUModelRunner._get_prompt_logprobs_dict` that the plugin installs (README.md)."""
