"""SM70_CLEF_DIR's format: the 186 corrections and their shapes, and every refusal of the
folder validator (a malformed folder is named by file, tensor and rule).

Folders come from tests/clef_fixture.py (tiny widths, 64 layers, rank 8), mutated per case.
The known shapes of the real model are written out here from FACTS.md's widths (hidden
5120, intermediate 17408, 24 heads of 256 with an output gate, 4 KV heads, GDN 16 key and
48 value heads of 128), not computed by the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clef_fixture import REAL_CONFIG, TINY_CONFIG, TINY_HEAD, real_spec, write_clef_dir

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.head import MAX_HEAD_PARAMS, head_params, parse_head_config
from vllm_patch.clef.layout import corrections, fused_slices
from vllm_patch.clef.model_dims import model_dims
from vllm_patch.clef.safetensors_header import encode, parse_header, read_header
from vllm_patch.clef.validate import validate_clef_dir

ROOT = Path(__file__).resolve().parent.parent
SERVE_PY = ROOT / ".serve-venv" / "bin" / "python"
REAL = json.loads(REAL_CONFIG.read_text())


# ------------------------------------------------------------------ the 186 corrections
def test_real_model_has_186_corrections_in_layers_40_to_63() -> None:
    cs = corrections(model_dims(REAL))
    assert len(cs) == 186
    assert {c.layer for c in cs} == set(range(40, 64))
    per_layer = {i: [c.module.rsplit(".", 1)[-1] for c in cs if c.layer == i] for i in (40, 43)}
    assert per_layer[43] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"]
    assert per_layer[40] == ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                             "gate_proj", "up_proj", "down_proj"]


def test_fused_layers_carry_one_correction_per_slice() -> None:
    groups = fused_slices(corrections(model_dims(REAL)))
    want = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2, "linear_attn.in_proj_qkvz": 2,
            "linear_attn.in_proj_ba": 2, "self_attn.o_proj": 1, "linear_attn.out_proj": 1,
            "mlp.down_proj": 1}
    seen = {fused: len(g) for (_, fused), g in groups.items()}
    assert seen == want
    assert [c.module for c in groups[(43, "self_attn.qkv_proj")]] == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


@pytest.mark.parametrize(("name", "a", "b"), [
    ("layers.43.self_attn.q_proj", (256, 5120), (24 * 256 * 2, 256)),
    ("layers.43.self_attn.k_proj", (256, 5120), (4 * 256, 256)),
    ("layers.43.self_attn.o_proj", (256, 24 * 256), (5120, 256)),
    ("layers.40.linear_attn.in_proj_qkv", (256, 5120), (2 * 16 * 128 + 48 * 128, 256)),
    ("layers.40.linear_attn.in_proj_z", (256, 5120), (48 * 128, 256)),
    ("layers.40.linear_attn.in_proj_b", (256, 5120), (48, 256)),
    ("layers.40.linear_attn.out_proj", (256, 48 * 128), (5120, 256)),
    ("layers.63.mlp.up_proj", (256, 5120), (17408, 256)),
    ("layers.63.mlp.down_proj", (256, 17408), (5120, 256)),
])
def test_real_shapes(name: str, a: tuple[int, int], b: tuple[int, int]) -> None:
    spec = real_spec(REAL)["tensors"]
    assert tuple(spec[name + ".lora_A"]["shape"]) == a
    assert tuple(spec[name + ".lora_B"]["shape"]) == b


def test_real_spec_totals() -> None:
    spec = real_spec(REAL)
    files = spec["manifest"]["files"]
    # 186 x 256 x (K + N) x 2 bytes, K + N summed by hand from the widths above
    gdn = (15360 + 11264 + 5168 + 5168 + 11264 + 22528 * 3) * 18
    full = (17408 + 6144 + 6144 + 11264 + 22528 * 3) * 6
    assert files["correction.safetensors"]["tensor_bytes"] == 256 * (gdn + full) * 2
    head = parse_head_config(spec["manifest"]["head"], 5120)
    assert 65_000_000 <= head_params(head) <= MAX_HEAD_PARAMS
    assert files["head.safetensors"]["tensor_bytes"] == 2 * head_params(head)


def test_model_without_64_layers_is_refused() -> None:
    with pytest.raises(ClefError, match="48 decoder layers; Clef corrects layers 40-63"):
        corrections(model_dims({**TINY_CONFIG, "num_hidden_layers": 48,
                                "layer_types": TINY_CONFIG["layer_types"][:48]}))


# ------------------------------------------------------------------ the validator
def test_tiny_folder_is_valid(tmp_path: Path) -> None:
    d = validate_clef_dir(write_clef_dir(tmp_path), TINY_CONFIG, rank=8)
    assert len(d.corrections) == 186
    assert {lc.file for lc in d.corrections} == {"correction-00001-of-00002.safetensors",
                                                 "correction-00002-of-00002.safetensors"}
    assert d.manifest.rank == 8 and d.manifest.head.width == 64
    lc = next(x for x in d.corrections if x.correction.stem == "layers.43.self_attn.q_proj")
    assert lc.a.shape == (8, 32) and lc.b.shape == (2 * 16 * 2, 8)


def _drop(name: str):
    def mutate(m, corr, heads) -> None:
        corr[:] = [t for t in corr if t[0] != name]
    return mutate


def _reshape(name: str, shape: tuple[int, ...], dtype: str = "F16", elem: int = 2):
    def mutate(m, corr, heads) -> None:
        for lst in (corr, heads):
            for i, t in enumerate(lst):
                if t[0] == name:
                    n = 1
                    for s in shape:
                        n *= s
                    lst[i] = (name, dtype, shape, b"\0" * (n * elem))
    return mutate


def _manifest(**changes):
    def mutate(m, corr, heads) -> None:
        m.update(changes)
    return mutate


def _add(name: str, shape: tuple[int, ...]):
    def mutate(m, corr, heads) -> None:
        corr.append((name, "F16", shape, b"\0" * (2 * shape[0] * shape[1])))
    return mutate


CASES = [
    ("missing slice", _drop("layers.47.self_attn.k_proj.lora_B"),
     r"'layers\.47\.self_attn\.k_proj\.lora_B' is in none of correction_files "
     r"\(self_attn\.qkv_proj needs all 3 slices: q_proj, k_proj, v_proj\)"),
    ("missing unfused", _drop("layers.41.linear_attn.out_proj.lora_A"),
     r"'layers\.41\.linear_attn\.out_proj\.lora_A' is in none of correction_files"),
    ("wrong rank", _reshape("layers.40.mlp.gate_proj.lora_A", (16, 32)),
     r"correction-00001-of-00002\.safetensors: tensor 'layers\.40\.mlp\.gate_proj\.lora_A': "
     r"shape \(16, 32\) has rank 16, clef\.json says rank 8"),
    ("wrong rank in B", _reshape("layers.63.mlp.down_proj.lora_B", (32, 4)),
     r"'layers\.63\.mlp\.down_proj\.lora_B': shape \(32, 4\) has rank 4"),
    ("shape vs config", _reshape("layers.40.linear_attn.in_proj_qkv.lora_B", (40, 8)),
     r"'layers\.40\.linear_attn\.in_proj_qkv\.lora_B': shape \(40, 8\), the model config "
     r"needs \(64, 8\)"),
    ("dtype", _reshape("layers.40.mlp.up_proj.lora_B", (48, 8), "F32", 4),
     r"'layers\.40\.mlp\.up_proj\.lora_B': dtype F32; Clef's tensors are F16"),
    ("layer outside", _add("layers.39.mlp.up_proj.lora_A", (8, 32)),
     r"'layers\.39\.mlp\.up_proj\.lora_A' is in layer 39, outside the corrected layers 40-63"),
    ("unknown tensor", _add("layers.40.mlp.act.lora_A", (8, 32)),
     r"'layers\.40\.mlp\.act\.lora_A' is not a correction Clef defines"),
    ("head tensor shape", _reshape("head.in_proj.weight", (64, 31)),
     r"head\.safetensors: tensor 'head\.in_proj\.weight': shape \(64, 31\), the model config "
     r"needs \(64, 32\)"),
    ("manifest rank", _manifest(rank=12), r"clef\.json: rank = 12 is not a multiple of 8"),
    ("manifest layers", _manifest(layers=[32, 63]), r"layers = \[32, 63\]; Clef corrects"),
    ("manifest dtype", _manifest(dtype="bfloat16"), r"dtype = 'bfloat16'; the correction is"),
    ("manifest file name", _manifest(head_file="../head.safetensors"),
     r"head_file = '\.\./head\.safetensors' is not a plain"),
    ("unknown field", _manifest(extra=1), r"unknown fields \['extra'\]"),
    ("head kind", _manifest(head={**TINY_HEAD, "kinds": ["choice", "rank"]}),
     r"head\.kinds = \['choice', 'rank'\]"),
    ("head too big", _manifest(head={**TINY_HEAD, "input_size": 32, "width": 8192,
                                     "mlp_size": 16384, "blocks": 1}),
     r"more than the 128,000,000 the memory plan sets aside"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), CASES, ids=[c[0] for c in CASES])
def test_malformed_folder_is_refused(tmp_path: Path, case: str, mutate, message: str) -> None:
    folder = write_clef_dir(tmp_path, mutate=mutate)
    with pytest.raises(ClefError, match=message):
        validate_clef_dir(folder, TINY_CONFIG, rank=8)


def test_rank_must_match_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ClefError, match="rank = 8, but SM70_CLEF_RANK is 256"):
        validate_clef_dir(write_clef_dir(tmp_path), TINY_CONFIG, rank=256)


def test_base_model_mismatch(tmp_path: Path) -> None:
    folder = write_clef_dir(tmp_path)
    other = {**TINY_CONFIG, "intermediate_size": 64}
    with pytest.raises(ClefError, match=r"base_model\.intermediate_size = 48, the model config "
                                        r"has 64"):
        validate_clef_dir(folder, other, rank=8)


def test_tp_that_cannot_split_the_heads(tmp_path: Path) -> None:
    # 3 KV heads: neither divisible by 2 ranks nor dividing them (vLLM refuses it too)
    config = {**TINY_CONFIG, "num_key_value_heads": 3, "num_attention_heads": 6}
    folder = write_clef_dir(tmp_path, config=config)
    validate_clef_dir(folder, config, rank=8, tp_sizes=(1,))
    with pytest.raises(ClefError, match=r"layers\.43\.self_attn\.k_proj \(output features\): "
                                        r"3 heads cannot be split over TP=2"):
        validate_clef_dir(folder, config, rank=8, tp_sizes=(1, 2))


def test_hash_and_size_are_checked(tmp_path: Path) -> None:
    folder = write_clef_dir(tmp_path)
    f = folder / "head.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x40  # same size, one bit of a weight flipped
    f.write_bytes(bytes(raw))
    with pytest.raises(ClefError, match=r"head\.safetensors: sha256 differs from clef\.json"):
        validate_clef_dir(folder, TINY_CONFIG, rank=8)
    f.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ClefError, match=r"head\.safetensors: [\d,]+ bytes, clef\.json says"):
        validate_clef_dir(folder, TINY_CONFIG, rank=8)
    (folder / "correction-00002-of-00002.safetensors").unlink()
    with pytest.raises(ClefError, match=r"correction-00002-of-00002\.safetensors: listed in "
                                        r"clef\.json but not in"):
        validate_clef_dir(folder, TINY_CONFIG, rank=8)


def test_folder_without_manifest(tmp_path: Path) -> None:
    with pytest.raises(ClefError, match=r"has no clef\.json"):
        validate_clef_dir(tmp_path, TINY_CONFIG)
    (tmp_path / "clef.json").write_text("{not json")
    with pytest.raises(ClefError, match=r"clef\.json: cannot be read as JSON"):
        validate_clef_dir(tmp_path, TINY_CONFIG)


def test_duplicate_tensor_across_files(tmp_path: Path) -> None:
    def dup(m, corr, heads) -> None:
        corr.append(corr[0])  # the first file's first tensor again, in the second file
    with pytest.raises(ClefError, match=r"correction-00002-of-00002\.safetensors: tensor "
                                        r"'layers\.40\.linear_attn\.in_proj_qkv\.lora_A' is "
                                        r"also in correction-00001"):
        validate_clef_dir(write_clef_dir(tmp_path, mutate=dup), TINY_CONFIG, rank=8)


# ------------------------------------------------------------------ safetensors headers
def _one() -> bytes:
    return encode([("a", "F16", (2, 3), b"\1" * 12), ("b", "F16", (4,), b"\2" * 8)])


def test_header_roundtrip() -> None:
    blob = _one()
    tensors, meta = parse_header(blob, len(blob), "x.safetensors")
    assert tensors["a"].shape == (2, 3) and tensors["b"].end == len(blob)
    assert blob[tensors["b"].begin:tensors["b"].end] == b"\2" * 8
    assert meta == {}


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize(("blob", "message"), [
    (b"\1\0", "too short"),
    ((10**9).to_bytes(8, "little") + b"{}", "header length 1,000,000,000 does not fit"),
    (_with_header({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                   "b": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}, b"\0" * 6),
     "'b' overlaps the one before"),
    (_with_header({"a": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}, b"\0" * 6),
     "'a' leaves a gap before it"),
    (_with_header({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 5),
     "tensors end at byte"),
    (_with_header({"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4),
     r"holds 4 bytes, its shape \(3,\) of F16 needs 6"),
    (_with_header({"a": {"dtype": "F17", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
     "dtype 'F17' is not a safetensors dtype"),
    (_with_header({"a": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}}, b"\0" * 4),
     "is not a list of sizes"),
    (_with_header(["a"], b""), "header is not a JSON object"),
    (_with_header({"__metadata__": {"k": 1}}, b""), "__metadata__ must map strings"),
    (b"\4\0\0\0\0\0\0\0\xff\xfe{}", "header is not UTF-8 JSON"),
])
def test_damaged_header_is_refused(blob: bytes, message: str) -> None:
    with pytest.raises(ClefError, match=message):
        parse_header(blob, len(blob), "x.safetensors")


def test_read_header_reads_a_file(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(_one())
    assert set(read_header(p)[0]) == {"a", "b"}
    p.write_bytes(_one()[:-1])
    with pytest.raises(ClefError, match=r"x\.safetensors: tensors end at byte"):
        read_header(p)


PROBE = """
import json, sys, torch
from safetensors import safe_open
from safetensors.torch import save_file
folder, out = sys.argv[1], sys.argv[2]
with safe_open(folder + "/head.safetensors", "pt") as f:
    shapes = {k: list(f.get_tensor(k).shape) for k in f.keys()}
    dtypes = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})
save_file({"w": torch.arange(6, dtype=torch.float16).reshape(2, 3),
           "v": torch.ones(5, dtype=torch.float16)}, out, metadata={"k": "v"})
print(json.dumps({"shapes": shapes, "dtypes": dtypes}))
"""


def test_agrees_with_the_safetensors_library(tmp_path: Path) -> None:
    """Our writer's files open in the real library, and the library's files pass our
    reader: the two implementations of the format agree."""
    if not SERVE_PY.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{SERVE_PY} is missing (CI builds it)")
        pytest.skip("no serving environment with torch and safetensors")
    folder = write_clef_dir(tmp_path / "clef")
    out = tmp_path / "lib.safetensors"
    r = subprocess.run([str(SERVE_PY), "-c", PROBE, str(folder), str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    mine, _ = read_header(folder / "head.safetensors")
    assert got["dtypes"] == ["torch.float16"]
    assert got["shapes"] == {k: list(t.shape) for k, t in mine.items()}
    theirs, meta = read_header(out)
    assert {k: t.shape for k, t in theirs.items()} == {"w": (2, 3), "v": (5,)}
    assert meta == {"k": "v"}


def test_writer_command_line(tmp_path: Path) -> None:
    script = ROOT / "tests" / "clef_fixture.py"
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "c")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(validate_clef_dir(tmp_path / "c", TINY_CONFIG, rank=8).corrections) == 186
    r = subprocess.run([sys.executable, str(script), "--spec"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    assert spec == json.loads(json.dumps(real_spec(REAL)))
    assert len(spec["tensors"]) == 2 * 186 + len([n for n in spec["tensors"]
                                                  if n.startswith("head.")])
