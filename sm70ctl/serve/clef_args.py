"""The vLLM API-server words that serve Clef beside chat (issue 25; docs/clef.md).

With SM70_CLEF on, the server gets Clef's ASGI middleware (the scoring route and the
refusals of `vllm_patch.clef.api`) and the worker extension the route takes its scores
from through vLLM's `collective_rpc`. With it off, nothing is added.
"""

from __future__ import annotations

from sm70ctl.settings.typed import SettingsView

MIDDLEWARE = "vllm_patch.clef.api.ClefMiddleware"
WORKER_EXTENSION = "vllm_patch.clef.worker_ext.ClefWorkerExtension"


def clef_argv(settings: SettingsView) -> list[str]:
    if not settings.clef:
        return []
    return ["--middleware", MIDDLEWARE, "--worker-extension-cls", WORKER_EXTENSION]
