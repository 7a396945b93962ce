"""sm70ctl/runtime: Settings -> vLLM argv, env, plugin configuration and secrets file."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from sm70ctl.errors import Sm70Error
from sm70ctl.runtime.command_line import redact_argv, vllm_argv
from sm70ctl.runtime.compile_cache import compile_fingerprint
from sm70ctl.runtime.environment import vllm_env
from sm70ctl.runtime.plugin_config import PLUGIN_CONFIG_ENV, plugin_config
from sm70ctl.runtime.secrets import secrets_path, secrets_yaml
from sm70ctl.settings import load_settings
from vllm_patch.config import PluginConfig

FACTS = Path("/work/shared/reference/FACTS.md")
# The reference deployment line from FACTS.md ("The reference deployment"), verbatim.
REFERENCE = (
    "--quantization gptq --dtype float16 --tensor-parallel-size 2 --disable-custom-all-reduce "
    "--gpu-memory-utilization 0.96 --kv-cache-memory-bytes 10630627328 "
    "--kv-cache-dtype int8_per_token_head --enable-prefix-caching --max-model-len 262144 "
    "--max-num-seqs 16 --max-num-batched-tokens 2048 "
    "--limit-mm-per-prompt {\"image\":20,\"video\":2} --enable-auto-tool-choice "
    "--tool-call-parser qwen3_coder --reasoning-parser qwen3 "
    "--compilation-config {\"cudagraph_mode\":\"full_and_piecewise\","
    "\"cudagraph_capture_sizes\":[1,2,4,8]} --mamba-cache-mode all "
    "--speculative-config {\"method\":\"mtp\",\"num_speculative_tokens\":3}"
)
# What the defaults launch: the reference line with the two values vLLM 0.22.1 does not keep
# replaced (issue 24, tests/test_vllm_config_parity.py): it runs mamba cache mode `all` as
# `align` for Qwen3.5, and rounds capture sizes up to multiples of 1 + k tokens under MTP.
DEFAULT_LINE = REFERENCE.replace("--mamba-cache-mode all", "--mamba-cache-mode align").replace(
    "[1,2,4,8]", "[4,8,16,32,64]")
REFERENCE_ENV = {
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    "TORCH_CUDA_ARCH_LIST": "7.0",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NCCL_CUMEM_ENABLE": "0",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
}


def defaults():
    return load_settings({})


def test_reference_line_matches_facts_when_available():
    if not FACTS.exists():
        pytest.skip("FACTS.md is not on this machine")
    text = " ".join(FACTS.read_text().split())
    assert REFERENCE in text


def test_default_argv_reproduces_the_reference_command_exactly():
    s = defaults()
    argv = vllm_argv(s)
    assert argv[0] == str(s.serve_python)
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model_dir)]
    assert DEFAULT_LINE != REFERENCE
    reference = shlex.split(DEFAULT_LINE.replace('"', '\\"'))
    assert argv[5 : 5 + len(reference)] == reference
    additions = argv[5 + len(reference) :]
    assert additions == [
        "--host", "127.0.0.1", "--port", "8000", "--served-model-name", "qwen3.8-27b",
        "--attention-backend", "SM70_PAGED", "--pipeline-parallel-size", "1",
        "--long-prefill-token-threshold", "2048", "--max-logprobs", "20",
        "--generation-config", "auto", "--gdn-prefill-backend", "triton",
        "--no-async-scheduling",
    ]


def test_default_env_reproduces_the_reference_environment():
    s = defaults()
    env = vllm_env(s, p2p_available=True)
    for key, value in REFERENCE_ENV.items():
        assert env[key] == value, key
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["NCCL_P2P_DISABLE"] == "0"
    assert vllm_env(s, p2p_available=False)["NCCL_P2P_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in vllm_env(s)
    assert PluginConfig.from_json(env[PLUGIN_CONFIG_ENV]) == PluginConfig.from_dict(
        plugin_config(s)
    )
    assert all(isinstance(v, str) for v in env.values())


def test_defaults_launch_the_sm70_gptq_path():
    """What `serve` runs by default (issue 21 item 4): `--quantization gptq`, which the
    plugin's sm70_gptq claims; the plugin's attention backend by its patched name
    (SM70_PAGED, patch 0002); our plugin loaded by name whatever VLLM_PLUGINS the caller had;
    the GEMV/GEMM switches on."""
    import tomllib

    s = defaults()
    argv = vllm_argv(s)
    assert argv[argv.index("--quantization") + 1] == "gptq"
    assert argv[argv.index("--attention-backend") + 1] == "SM70_PAGED"
    env = vllm_env(s)
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (name,) = project["project"]["entry-points"]["vllm.general_plugins"]
    assert env["VLLM_PLUGINS"] == name == "sm70"
    from sm70ctl.runtime.environment import child_env

    assert child_env({"VLLM_PLUGINS": "", "PATH": "/bin"}, env)["VLLM_PLUGINS"] == "sm70"
    gemm = PluginConfig.from_json(env[PLUGIN_CONFIG_ENV]).gemm
    assert (gemm.int8_gemv, gemm.gemv_max_rows, gemm.int8_lm_head) == (True, 8, True)


@pytest.mark.parametrize(("mode", "available", "expected"), [
    ("on", False, "0"), ("on", None, "0"), ("off", True, "1"), ("off", None, "1"),
    ("auto", True, "0"), ("auto", False, "1"), ("auto", None, None),
])
def test_p2p_follows_setting_then_topology(mode, available, expected):
    env = vllm_env(load_settings({"SM70_P2P": mode}), p2p_available=available)
    assert env.get("NCCL_P2P_DISABLE") == expected


@pytest.mark.parametrize("environ", [
    {}, {"SM70_SPEC_METHOD": "ngram"}, {"SM70_SPEC_TOKENS": "1", "SM70_CUDAGRAPH_SIZES": "2,4"},
    # seven drafts take more verification rows than SM70_PAGED's decode kernel: vLLM's own
    # backend (the refusal under the default is test_settings' paged-decode-rows test)
    {"SM70_SPEC_TOKENS": "7", "SM70_CUDAGRAPH_SIZES": "16,8",
     "SM70_ATTENTION_BACKEND": "TRITON_ATTN"},
])
def test_speculative_config_appears_exactly_once(environ):
    argv = vllm_argv(load_settings(environ))
    assert argv.count("--speculative-config") == 1
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == load_settings(environ).spec_tokens


def test_no_speculation_means_no_speculative_flag():
    assert "--speculative-config" not in vllm_argv(load_settings({"SM70_SPEC_METHOD": "none"}))


def test_every_flag_appears_at_most_once():
    s = load_settings({"SM70_BLOCK_SIZE": "64", "SM70_ENFORCE_EAGER": "true",
                       "SM70_API_KEY": "k", "SM70_SPEC_METHOD": "ngram"})
    flags = [a for a in vllm_argv(s) if a.startswith("--")]
    assert len(flags) == len(set(flags))


def test_ngram_method_carries_lookup_bounds():
    s = load_settings({"SM70_SPEC_METHOD": "ngram", "SM70_NGRAM_MIN": "3", "SM70_NGRAM_MAX": "5"})
    argv = vllm_argv(s)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 3,
                    "prompt_lookup_min": 3, "prompt_lookup_max": 5}


def test_graph_sizes_are_sorted_on_output():
    s = load_settings({"SM70_CUDAGRAPH_SIZES": "8,4,16,12"})
    argv = vllm_argv(s)
    cfg = json.loads(argv[argv.index("--compilation-config") + 1])
    assert cfg["cudagraph_capture_sizes"] == [4, 8, 12, 16]


def test_api_key_goes_through_a_config_file_never_the_command_line(tmp_path):
    s = load_settings({"SM70_API_KEY": "sk-very-secret", "SM70_HOST": "0.0.0.0"})
    assert vllm_argv(s)[-2:] == ["--config", str(secrets_path(s))]
    argv = vllm_argv(s, secrets_file=tmp_path / "s.yaml")
    assert argv[argv.index("--config") + 1] == str(tmp_path / "s.yaml")
    assert "--api-key" not in argv and "sk-very-secret" not in " ".join(argv)
    assert "sk-very-secret" not in json.dumps(vllm_env(s))
    # what vLLM's --config loader reads back: one key, exactly the secret
    assert yaml.safe_load(secrets_yaml(s)) == {"api-key": "sk-very-secret"}
    assert secrets_yaml(load_settings({})) is None


def test_redact_argv_masks_secret_flags():
    shown = redact_argv(["py", "--api-key", "sk-1", "--port", "8000"])
    assert shown == ["py", "--api-key", "***", "--port", "8000"]
    # the `=` spelling was shown as given
    assert redact_argv(["py", "--api-key=sk-2", "--api-key"]) == ["py", "--api-key=***",
                                                                  "--api-key"]


def test_gpu_uuids_need_resolved_indices():
    s = load_settings({"SM70_GPUS": "GPU-aaaa-1111,GPU-bbbb-2222"})
    with pytest.raises(Sm70Error, match="not resolved"):
        vllm_env(s)
    assert vllm_env(s, gpu_indices=[3, 2])["CUDA_VISIBLE_DEVICES"] == "3,2"
    with pytest.raises(Sm70Error, match="resolved 1 GPU"):
        vllm_env(s, gpu_indices=[3])


def test_compile_cache_is_keyed_by_kernel_settings_only():
    base = defaults()
    same = load_settings({"SM70_PORT": "9000", "SM70_MAX_NUM_SEQS": "4"})
    changed = load_settings({"SM70_GDN_CHUNK_SIZE": "32"})
    assert compile_fingerprint(base) == compile_fingerprint(same)
    assert compile_fingerprint(base) != compile_fingerprint(changed)
    env_a, env_b = vllm_env(base), vllm_env(changed)
    assert env_a["VLLM_CACHE_ROOT"] != env_b["VLLM_CACHE_ROOT"]
    assert re.search(r"/[0-9a-f]{16}/vllm$", env_a["VLLM_CACHE_ROOT"])


def test_plugin_defaults_equal_settings_defaults():
    # A plugin started without SM70_PLUGIN_CONFIG behaves like the reference.
    cfg = PluginConfig.from_dict(plugin_config(defaults()))
    bare = PluginConfig()
    assert cfg.to_dict() | {"clef": None} == bare.to_dict() | {"clef": None}
    assert {k: v for k, v in cfg.clef.__dict__.items() if k != "dir"} == {
        k: v for k, v in bare.clef.__dict__.items() if k != "dir"}
    assert PluginConfig.from_env({}) == bare


@pytest.mark.parametrize(("text", "message"), [
    ("not json", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"gdn": {"chunk": 64}}', "unknown field"),
    ('{"gdn": {"chunk_size": "64"}}', "gdn.chunk_size must be int"),
    ('{"gemm": {"int8_gemv": 1}}', "gemm.int8_gemv must be bool"),
    ('{"gemm": 3}', "gemm must be an object"),
    ('{"version": 2}', "version 2"),
])
def test_plugin_config_is_strict(text, message):
    with pytest.raises(ValueError, match=message):
        PluginConfig.from_json(text)


def test_plugin_config_accepts_ints_for_floats():
    assert PluginConfig.from_json('{"sparse_prefill": {"mass": 1}}').sparse_prefill.mass == 1.0


def test_plugin_config_module_is_import_light():
    import subprocess
    import sys

    code = ("import sys, vllm_patch.config; "
            "bad = [m for m in ('torch', 'vllm', 'pydantic', 'yaml') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
