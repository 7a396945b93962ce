"""The server's environment, its masking, and the settings -> process mapping (pure)."""

from __future__ import annotations

from pathlib import Path

from sm70ctl.runtime.command_line import base_url, vllm_argv
from sm70ctl.runtime.cpu_profile import cpu_problems
from sm70ctl.runtime.environment import (
    MASK,
    child_env,
    is_secret_name,
    managed_env,
    mask_env,
    unmanaged,
)
from sm70ctl.runtime.secrets import secrets_file
from sm70ctl.settings import load_settings

REPO = Path(__file__).resolve().parents[1]


def test_secret_names() -> None:
    for name in ("HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                 "GITHUB_AUTH", "my_apikey"):
        assert is_secret_name(name), name
    for name in ("PATH", "HOME", "VLLM_USE_V1", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE"):
        assert not is_secret_name(name), name
    # The match errs towards masking: a harmless name that contains TOKEN is masked too (a
    # shown secret is worse than a hidden tokenizer flag).
    assert is_secret_name("TOKENIZERS_PARALLELISM")


def test_child_env_drops_our_settings_and_adds_managed() -> None:
    env = child_env({"PATH": "/bin", "SM70_HF_TOKEN": "hf_x", "SM70_PORT": "1", "X": "1"},
                    {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "X": "2"})
    assert env == {"PATH": "/bin", "X": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_unmanaged_lists_and_masks() -> None:
    rows = unmanaged({"PATH": "/bin", "HF_TOKEN": "hf_x", "VLLM_USE_V1": "1", "SM70_PORT": "1",
                      "CUDA_DEVICE_ORDER": "x"}, {"CUDA_DEVICE_ORDER"})
    assert rows == [("HF_TOKEN", MASK, True), ("PATH", "/bin", False),
                    ("VLLM_USE_V1", "1", True)]


def test_mask_env() -> None:
    assert mask_env({"A": "1", "MY_TOKEN": "t", "B": "has-sk-9"}, ["sk-9", ""]) == {
        "A": "1", "MY_TOKEN": MASK, "B": MASK}


def test_secrets_file_is_private_and_removed(tmp_path: Path) -> None:
    s = load_settings(environ={"SM70_API_KEY": "sk-abc", "SM70_LOCK_DIR": str(tmp_path)})
    with secrets_file(s) as path:
        assert path is not None and path.parent == tmp_path
        assert path.stat().st_mode & 0o777 == 0o600
        assert "sk-abc" in path.read_text()
        argv = vllm_argv(s, secrets_file=path)
        assert argv[argv.index("--config") + 1] == str(path)
        assert not any("sk-abc" in a for a in argv)
    assert not path.exists()
    with secrets_file(load_settings(environ={})) as none:
        assert none is None


def test_cpu_problems_name_settings() -> None:
    defaults = load_settings(environ={})
    problems = cpu_problems(defaults)
    text = " ".join(problems)
    for name in ("SM70_QUANTIZATION=gptq", "SM70_KV_CACHE_DTYPE=int8_per_token_head",
                 "SM70_SPEC_METHOD=mtp",
                 "SM70_TENSOR_PARALLEL_SIZE=2"):
        assert name in text
    cpu = load_settings(environ={}, env_file=REPO / "tests" / "e2e" / "cpu.env")
    assert cpu_problems(cpu) == []


def test_managed_env_points_caches_at_entry(tmp_path: Path) -> None:
    s = load_settings(environ={})
    env = managed_env(s, "cuda", tmp_path / "fp", gpu_indices=[3, 1])
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "fp" / "vllm")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "fp" / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "fp" / "inductor")
    assert env["SM70_KERNELS_BUILD_DIR"] == str(tmp_path / "fp" / "kernels")
    cpu = load_settings(environ={}, env_file=REPO / "tests" / "e2e" / "cpu.env")
    assert managed_env(cpu, "cpu", tmp_path)["CUDA_VISIBLE_DEVICES"] == ""
    assert managed_env(cpu, "cpu", tmp_path)["VLLM_USE_AOT_COMPILE"] == "0"
    uuids = load_settings(environ={"SM70_GPUS": "GPU-aaaa,GPU-bbbb"})
    shown = managed_env(uuids, "cuda", tmp_path)["CUDA_VISIBLE_DEVICES"]
    assert shown == "(unresolved: GPU-aaaa,GPU-bbbb)"
    assert managed_env(uuids, "cuda", tmp_path, [1, 0])["CUDA_VISIBLE_DEVICES"] == "1,0"


def test_base_url() -> None:
    assert base_url(load_settings(environ={"SM70_PORT": "8100"})) == "http://127.0.0.1:8100"
    s = load_settings(environ={"SM70_HOST": "0.0.0.0", "SM70_API_KEY": "k"})
    assert base_url(s) == "http://127.0.0.1:8000"
    s = load_settings(environ={"SM70_HOST": "::1"})
    assert base_url(s) == "http://[::1]:8000"
