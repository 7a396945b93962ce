"""The worker methods the API process reaches through vLLM's `collective_rpc`
(`--worker-extension-cls vllm_patch.clef.worker_ext.ClefWorkerExtension`, which vLLM adds
to its Worker's bases)."""

from __future__ import annotations

from typing import Any


class ClefWorkerExtension:
    def sm70_clef_take(self, key: str) -> list[float] | None:
        """A scoring request's per-position logits (once; None if this worker has none)."""
        from vllm_patch.clef.runner_hook import SCORES, _lock

        with _lock:
            return SCORES.take(key)

    def sm70_clef_status(self) -> dict[str, Any]:
        """What this worker holds: the hook's state and the store's sizes (diagnostics)."""
        from vllm_patch.clef.runner_hook import SCORES
        from vllm_patch.quantization.clef_correction import ROWS, _hook, served_head

        return {"hook": list(_hook), "head": served_head() is not None,
                "partial": len(SCORES.partial), "done": len(SCORES.done),
                "mask_rows": 0 if ROWS.mask is None else int(ROWS.mask.numel())}
