"""A planted secret never appears in any output or file of any command.

Secrets are planted every way a user can hold one: the schema's own variables, their
misspellings (in the environment and in an env file, also on malformed lines), well-known
variables vLLM and the hub read (VLLM_API_KEY, HF_TOKEN), a common secret name, and an
innocent-looking variable that happens to carry the API key. Then every command runs, and
its stdout, stderr and every file under the test's folder (records, logs, manifests,
caches) are searched for each planted value.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from serve_fakes import fake_env, free_port

REPO = Path(__file__).resolve().parents[1]
CPU_ENV = REPO / "tests" / "e2e" / "cpu.env"

PLANTED = {
    "SM70_API_KEY": "sk-plant-apikey-1111",
    "SM70_HF_TOKEN": "hf_plant_token_2222",
    "VLLM_API_KEY": "sk-plant-vllm-3333",
    "HF_TOKEN": "hf_plant_hub_4444",
    "MY_SERVICE_PASSWORD": "pw-plant-5555",
}
INNOCENT = {"INNOCENT_LOOKING": f"carries-{PLANTED['SM70_API_KEY']}"}
MISSPELT_ENV = {"SM70_HF_TOKNE": "hf_plant_typo_6666"}
MISSPELT_FILE = (
    "SM70_API_KYE=sk-plant-typo-7777\n"
    "SM70_API_KEY: sk-plant-colon-8888\n"
    "SM70_API_KEY='sk-plant-unclosed-9999\n"
    "SM70_API_KEY=sk-plant-dup-aaaa\n"
    "SM70_API_KEY=sk-plant-dup-bbbb\n"
)
ALL_VALUES = [*PLANTED.values(), "sk-plant-typo-7777", "sk-plant-colon-8888",
              "sk-plant-unclosed-9999", "sk-plant-dup-aaaa", "sk-plant-dup-bbbb",
              "hf_plant_typo_6666"]
# Every planted value holds "plant-" or "plant_": a secret cut short or quoted differently
# is still found, and no port number or timing can match by chance.
NEEDLES = sorted(set(ALL_VALUES) | {"plant-", "plant_"})


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> str:
    res = subprocess.run([sys.executable, "-m", "sm70ctl", *args], env=env,
                         capture_output=True, text=True, timeout=timeout, check=False)
    out = res.stdout + res.stderr
    assert "Traceback" not in out, f"{args}: {out[-2000:]}"
    return out


def _leaks(text: str) -> list[str]:
    return [n for n in NEEDLES if n in text]


def _file_leaks(root: Path) -> dict[str, list[str]]:
    found = {}
    for p in root.rglob("*"):
        try:
            if p.is_file():
                hits = _leaks(p.read_bytes().decode("utf-8", "replace"))
                if hits:
                    found[str(p.relative_to(root))] = hits
        except OSError:
            continue
    return found


COMMANDS = [
    ["env", "check"], ["env", "check", "--json"], ["env", "show"], ["env", "show", "--json"],
    ["env", "list", "--json"], ["env", "explain", "SM70_API_KEY", "--json"],
    ["plan"], ["plan", "--json"],
    ["serve", "--device", "cpu", "--env-file", str(CPU_ENV), "--dry-run"],
    ["serve", "--device", "cpu", "--env-file", str(CPU_ENV), "--dry-run", "--json"],
    ["warmup", "--device", "cpu", "--env-file", str(CPU_ENV), "--check", "--json"],
    ["warmup", "--device", "cpu", "--env-file", str(CPU_ENV), "--check"],
    ["weights", "verify", "--json"],
]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    # the stand-in server prints an inherited secret, as a chatty server would
    return fake_env(tmp_path, free_port(), SM70_WEIGHTS_DIR=str(tmp_path / "weights"),
                    SM70_BUILD_DIR=str(tmp_path / "build"), FAKE_PRINT_ENV="VLLM_API_KEY",
                    SM70_ENFORCE_EAGER="false", FAKE_COMPILE="once", **PLANTED, **INNOCENT)


def test_valid_secrets_never_shown(env: dict[str, str], tmp_path: Path) -> None:
    leaks = {}
    for args in COMMANDS:
        if hits := _leaks(_run(args, env)):
            leaks[" ".join(args)] = hits
    record = tmp_path / "doctor-record.json"
    out = _run(["doctor", "--json", "--record", str(record)], env)
    if hits := _leaks(out):
        leaks["doctor --json --record"] = hits
    # a full warmup (the stand-in server) writes the cache manifest
    out = _run(["warmup", "--device", "cpu", "--env-file", str(CPU_ENV), "--json"], env)
    if hits := _leaks(out):
        leaks["warmup --json"] = hits
    assert record.is_file()
    logs = list((tmp_path / "logs").glob("warmup-*.log"))
    assert logs and all("fake vllm: VLLM_API_KEY=***" in p.read_text() for p in logs)
    assert leaks == {}
    assert _file_leaks(tmp_path) == {}


def test_misspelt_secrets_never_shown(env: dict[str, str], tmp_path: Path) -> None:
    env_file = tmp_path / "typo.env"
    env_file.write_text(MISSPELT_FILE)
    env.update(MISSPELT_ENV)
    leaks = {}
    for args in (["env", "check"], ["env", "check", "--json"], ["env", "show"], ["plan"],
                 ["serve", "--device", "cpu", "--dry-run"], ["warmup", "--check", "--json"]):
        out = _run([*args, "--env-file", str(env_file)], env)
        assert "SM70_API_KYE" in out or "SM70_HF_TOKNE" in out or "problem" in out, out
        if hits := _leaks(out):
            leaks[" ".join(args)] = hits
    record = tmp_path / "doctor-record.json"
    out = _run(["doctor", "--json", "--env-file", str(env_file), "--record", str(record)], env)
    if hits := _leaks(out):
        leaks["doctor"] = hits
    assert leaks == {}
    files = _file_leaks(tmp_path)
    files.pop("typo.env", None)  # the user's own file
    assert files == {}
