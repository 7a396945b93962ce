"""R6 of ../runtime_patches/README.md: the n-gram assist after vLLM 0.22.1's MTP proposer.

`install(spec)` wraps `GPUModelRunner.propose_draft_token_ids` (the v1 runner, which
hybrid models such as Qwen3.5 always get): the wrapper calls vLLM's method unchanged, then,
for a runner whose speculative method is MTP with the padded drafter batch and greedy
drafts, hands the [B, k] drafts to the runner's `AssistState` (assist.py), which returns
them with the rows that measured better on n-gram replaced. The MTP drafter's CUDA graphs
run inside vLLM's call, so nothing captured changes; the replacement is eager torch on
the drafts' device between the drafter and the verifier. Any other runner (no
speculation, n-gram, EAGLE, probabilistic drafts, padded batch disabled) gets vLLM's result
untouched.

The target is checked before rebinding (vLLM's version, the parameters, names the body
uses); anything else is refused with `AssistPatchError` naming what differs.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_patch import rebind
from vllm_patch.spec_decode.assist import AssistParams, AssistState

logger = logging.getLogger("vllm_patch")

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
TARGET = f"{RUNNER_MODULE}.GPUModelRunner.propose_draft_token_ids"
EXPECTED_VERSION = "0.22.1"
EXPECTED_PARAMS = ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata",
                   "hidden_states", "sample_hidden_states", "aux_hidden_states",
                   "spec_decode_metadata", "common_attn_metadata", "slot_mappings")
# Names the 0.22.1 body uses for the MTP path whose result the wrapper post-processes.
EXPECTED_NAMES = frozenset({
    "use_eagle", "disable_padded_drafter_batch", "prepare_next_token_ids_padded",
    "propose", "drafter", "input_batch", "discard_request_mask",
})
MARK = "__sm70_ngram_assist__"
REPLACES = "__sm70_replaces__"
_TARGET = rebind.Target(RUNNER_MODULE, "GPUModelRunner", "propose_draft_token_ids",
                        EXPECTED_VERSION, EXPECTED_PARAMS, EXPECTED_NAMES, MARK)
STATE_ATTR = "_sm70_assist"  # on the runner: an AssistState, or a str saying why none


class AssistPatchError(rebind.RebindError):
    """The rebinding's target is not the function it was written against."""


def check_target(func: Any, version: str) -> None:
    rebind.check(_TARGET, func, version, AssistPatchError, "set spec.ngram_assist false")


def why_inactive(runner: Any) -> str | None:
    """None when this runner's drafts get the assist, else why not (one line)."""
    spec = getattr(runner, "speculative_config", None)
    if spec is None:
        return "no speculative decoding"
    if getattr(spec, "method", None) != "mtp":
        return f"speculative method {getattr(spec, 'method', None)!r} is not mtp"
    if getattr(spec, "disable_padded_drafter_batch", False):
        return "disable_padded_drafter_batch is set (drafts come from CPU lists)"
    method = getattr(spec, "draft_sample_method", "greedy")
    if method != "greedy":
        # probabilistic drafts carry MTP's distribution per row; an n-gram row has none
        return f"draft_sample_method {method!r} (n-gram rows have no draft probabilities)"
    return None


def runner_state(runner: Any, spec_cfg: Any) -> AssistState | None:
    """The runner's AssistState, made on its first call (None, and the reason kept on the
    runner, when the runner is not one the assist applies to)."""
    got = runner.__dict__.get(STATE_ATTR)
    if isinstance(got, AssistState):
        return got
    if isinstance(got, str):
        return None
    why = why_inactive(runner)
    if why is not None:
        runner.__dict__[STATE_ATTR] = f"off: {why}"
        logger.info("sm70 n-gram assist off for this runner: %s", why)
        return None
    k = int(runner.speculative_config.num_speculative_tokens)
    params = AssistParams(k=k, n_min=spec_cfg.ngram_min, n_max=spec_cfg.ngram_max)
    state = AssistState(params, int(runner.max_num_reqs), int(runner.max_model_len),
                        runner.device)
    runner.__dict__[STATE_ATTR] = state
    logger.info("sm70 n-gram assist on: k=%d, n %d..%d, %d slots x %d tokens", k,
                params.n_min, params.n_max, runner.max_num_reqs, runner.max_model_len)
    return state


def apply(runner: Any, state: AssistState, scheduler_output: Any, sampled: Any,
          drafts: Any) -> Any:
    """One step of the assist on what vLLM's method produced (see the module doc)."""
    batch = runner.input_batch
    req_ids = list(batch.req_ids[: batch.num_reqs])
    if drafts.shape[0] != len(req_ids) or sampled.shape[0] != len(req_ids):
        state.skipped += 1  # not the padded MTP batch this was written for: leave it
        return drafts
    k = state.params.k
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    verified = [len(spec_tokens.get(r, ())) == k for r in req_ids]
    tokens_cpu, known_len = batch.token_ids_cpu, batch.num_tokens_no_spec

    def known(row: int) -> list[int]:
        return tokens_cpu[row, : int(known_len[row])].tolist()

    upper = max((runner.requests[r].num_tokens for r in req_ids), default=0)
    return state.step(req_ids, drafts, sampled, runner.discard_request_mask.gpu[: len(req_ids)],
                      verified, int(batch.vocab_size), known, upper + sampled.shape[1])


def assist_method(original: Any, spec_cfg: Any) -> Any:
    """The replacement: vLLM's `original` then the assist (for MTP runners only)."""
    import torch

    def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any,
                                *args: Any, **kwargs: Any) -> Any:
        drafts = original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        state = runner_state(self, spec_cfg)
        if (state is None or not isinstance(drafts, torch.Tensor)
                or not isinstance(sampled_token_ids, torch.Tensor)):
            return drafts
        try:
            return apply(self, state, scheduler_output, sampled_token_ids, drafts)
        except Exception as exc:  # vLLM's drafts are always correct to verify: keep serving
            self.__dict__[STATE_ATTR] = f"off: failed ({type(exc).__name__}: {exc})"
            logger.exception("sm70 n-gram assist failed; this runner keeps MTP drafts only")
            return drafts

    setattr(propose_draft_token_ids, MARK, True)
    setattr(propose_draft_token_ids, REPLACES, original)
    return propose_draft_token_ids


def install(spec_cfg: Any) -> str:
    """Rebind the target once per process (later calls are no-ops). Raises
    `AssistPatchError` when the target is not the expected function."""
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner.__dict__.get("propose_draft_token_ids")
    if getattr(current, MARK, False):
        return "wrapped (already installed)"
    check_target(current, vllm.__version__)
    GPUModelRunner.propose_draft_token_ids = assist_method(current, spec_cfg)
    return (f"wrapped (n {spec_cfg.ngram_min}..{spec_cfg.ngram_max}; active for MTP runners "
            "with greedy padded drafts)")


def install_or_refuse(spec_cfg: Any) -> str:
    try:
        return install(spec_cfg)
    except AssistPatchError as exc:
        logger.error("sm70 plugin: n-gram assist not installed: %s", exc)
        return f"refused ({exc})"
    except ImportError as exc:
        return f"absent ({TARGET} does not import: {exc})"


def stats(runner: Any) -> dict[str, Any]:
    """The runner's assist counters, or why it has none (for tests and device scripts)."""
    got = runner.__dict__.get(STATE_ATTR)
    if isinstance(got, AssistState):
        return {"active": True, **got.stats()}
    return {"active": False, "why": got if isinstance(got, str) else "not called yet"}


_outcome: list[str] = []


def outcome() -> str | None:
    """What the last install attempt in this process said (None: none has run yet)."""
    return _outcome[-1] if _outcome else None


def install_when_imported(spec_cfg: Any) -> str:
    """`install_or_refuse` now if vLLM's runner module is loaded, else right after it is
    imported (only engine workers import it), like R5."""
    import sys


    def run() -> None:
        _outcome.append(install_or_refuse(spec_cfg))

    if RUNNER_MODULE in sys.modules:
        run()
        return _outcome[-1]
    rebind.defer(RUNNER_MODULE, MARK, run)
    return (f"deferred (n {spec_cfg.ngram_min}..{spec_cfg.ngram_max}; installed when "
            f"{RUNNER_MODULE} is imported)")
