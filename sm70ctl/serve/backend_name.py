"""The --attention-backend name serve hands the serving vLLM for SM70_ATTENTION_BACKEND (pure).

SM70_PAGED is a name only vLLM trees with patch 0002 have (`sm70ctl build` applies it); a
stock vLLM 0.22.1 rejects it in argparse. The plugin registers the same backend class in
that name's slot when the enum has it and in vLLM's CUSTOM slot otherwise
(vllm_patch/plugin.py), so on a stock tree the same backend is reached as CUSTOM. Which
tree serves is sm70ctl.runtime.probes.probe_backend_name's answer; this module turns it
into the flag value and the pre-flight check that says which one was chosen and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from sm70ctl.runtime.command_line import CUSTOM_SLOT, attention_backend_flag
from sm70ctl.runtime.probes import PATCHED_BACKEND_NAME, BackendNameProbe
from sm70ctl.serve.preflight import PASS, SKIP, WARN, Check

CHECK_NAME = "attention backend name"


@dataclass(frozen=True)
class BackendFlag:
    value: str  # what follows --attention-backend
    check: Check


def decide_backend_flag(setting: str, probe: BackendNameProbe | None) -> BackendFlag:
    """The flag value for SM70_ATTENTION_BACKEND=`setting` on the serving vLLM `probe`
    describes (None: not probed, which only a setting other than SM70_PAGED may be)."""
    if setting != PATCHED_BACKEND_NAME:
        return BackendFlag(setting, Check(
            CHECK_NAME, SKIP, f"SM70_ATTENTION_BACKEND={setting} is vLLM's own name, passed "
                              "as set (not probed)"))
    if probe is None or probe.has_name is None:
        why = (probe.detail if probe is not None else "") or "the serving vLLM was not probed"
        return BackendFlag(setting, Check(
            CHECK_NAME, WARN, f"could not tell whether the serving vLLM has patch 0002's "
                              f"{setting} name ({why}); passing --attention-backend {setting} "
                              "as set"))
    where = probe.vllm_dir or "?"
    if probe.has_name:
        return BackendFlag(setting, Check(
            CHECK_NAME, PASS, f"{setting}: the serving vLLM at {where} has patch 0002's name"))
    return BackendFlag(attention_backend_flag(setting, False), Check(
        CHECK_NAME, WARN, f"the serving vLLM at {where} lacks patch 0002's {setting} name; the "
                          f"plugin's backend serves as {CUSTOM_SLOT} (--attention-backend "
                          f"{CUSTOM_SLOT})"))
