"""The lock file: the shipped lock is valid and honest; malformed locks are refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sm70ctl.build.lock import LockError, load_lock, packaged_lock_path, parse_lock, tree_hash
from sm70ctl.errors import Sm70Error

ROOT = Path(__file__).resolve().parent.parent

MINIMAL = """schema = 1
[toolchain]
cuda = "12.8"
gcc_min = "11.4"
gcc_max_major = 14
python = "3.12"
cuda_arch_list = "7.0"
"""


def test_repo_root_lock_is_the_packaged_lock() -> None:
    root_lock = ROOT / "sm70.lock.toml"
    assert root_lock.resolve() == packaged_lock_path().resolve()


def test_shipped_lock_pins_the_chosen_vllm_and_toolchain() -> None:
    lock = load_lock()
    vllm = lock.archive("vllm")
    assert vllm.filename == "vllm-0.22.1.tar.gz" and vllm.patch and vllm.strip == "vllm-0.22.1"
    assert vllm.sha256 == "cd34902729f3767e3dfbb391956b2986bc638a54be9893e78bda9cc55669f15c"
    assert lock.toolchain.cuda == "12.8" and lock.toolchain.cuda_arch_list == "7.0"
    assert lock.toolchain.gcc_min == "11.4" and lock.toolchain.gcc_max_major == 14
    cutlass = next(g for g in lock.git if g.name == "cutlass")
    assert (cutlass.tag, cutlass.commit) == ("v4.4.2", "da5e086dab31d63815acafdac9a9c5893b1c69e2")
    torch = next(w for w in lock.wheels if w.name == "torch")
    assert torch.version == "2.11.0+cu126"
    assert not torch.sha256 and "unreachable" in torch.unverified  # said, not invented
    assert any(s.name == "csrc" and s.path == "csrc" for s in lock.local)


def test_shipped_lock_every_id_is_verified_or_explains_why_not() -> None:
    lock = load_lock()
    for g in lock.git:
        assert re.fullmatch(r"[0-9a-f]{40}", g.commit) or g.unverified, g.name
    for w in lock.wheels:
        assert re.fullmatch(r"[0-9a-f]{64}", w.sha256) or len(w.unverified) > 20, w.name
        assert w.filename.endswith(".whl")
    # The serving environment's key packages are pinned.
    names = {w.name.lower().replace("_", "-") for w in lock.wheels}
    for pkg in ("transformers", "tokenizers", "fastapi", "numba", "xgrammar", "torchvision"):
        assert pkg in names, pkg


def test_vllm_external_projects_are_pinned() -> None:
    from sm70ctl.build.plan import EXTERNAL_SRC_ENV

    names = {g.name for g in load_lock().git}
    assert set(EXTERNAL_SRC_ENV) <= names


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[[git]]\nname = "x"\nurl = "https://e/x.git"\ncommit = "abc"\n', "40 lower-case hex"),
        ('[[git]]\nname = "x"\nurl = "https://e/x.git"\ntag = "v1"\n', "pin by tag alone"),
        ('[[git]]\nname = "x"\nurl = "ftp://e/x"\ncommit = "' + "a" * 40 + '"\n', "url"),
        ('[[archive]]\nname = "v"\nurl = "https://e/v.tgz"\nfilename = "v.tgz"\n'
         'sha256 = "xyz"\n', "64 lower-case hex"),
        ('[[archive]]\nname = "v"\nurl = "https://e/v.tgz"\nfilename = "../v.tgz"\n'
         'sha256 = "' + "a" * 64 + '"\n', "plain file name"),
        ('[[wheel]]\nname = "w"\nversion = "1"\nfilename = "w.whl"\nurl = "https://e/w.whl"\n',
         "must say why"),
        ('[[local]]\nname = "c"\npath = "/abs"\nhash = "' + "a" * 64 + '"\n', "relative"),
        ('[[git]]\nname = "d"\nurl = "https://e/d"\ncommit = "' + "a" * 40 + '"\n'
         '[[archive]]\nname = "d"\nurl = "https://e/d.tgz"\nfilename = "d.tgz"\nsha256 = "'
         + "b" * 64 + '"\n', "appears twice"),
    ],
)
def test_malformed_entries_are_refused_by_name(extra: str, message: str) -> None:
    with pytest.raises(LockError, match=message):
        parse_lock(MINIMAL + extra)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # a table where an array of tables belongs
        ('[git]\nname = "x"\n', r"`git` must be an array of tables \(\[\[git\]\] entries\)"),
        # (top-level keys come before [toolchain], or TOML puts them in it)
        ('TOP git = ["x"]\n', r"`git` must be an array of tables"),
        ("TOP local = 3\n", r"`local` must be an array of tables"),
        # a stray key: a typo would be silently lost
        ('TOP comit = "' + "a" * 40 + '"\n', r"unknown top-level key\(s\) \['comit'\]"),
        ('cudaa = "12.8"\n', r"\[toolchain\]: unknown field\(s\) \['cudaa'\]"),
        ('[[git]]\nname = "x"\nurl = "https://e/x.git"\ntag = "v1"\nunverified = "why"\n'
         'comit = "' + "a" * 40 + '"\n', r"\[\[git\]\] #1: unknown field\(s\) \['comit'\]"),
        ('[[local]]\nname = "c"\npath = "c"\nhash = "' + "a" * 64 + '"\nglobs = [1]\n',
         "must be a list of non-empty patterns"),
        ("[notes]\nx = 1\n", r"\[notes\] must be a table of strings"),
        ("[" * 200 + "]" * 200 + "\n", "nested more than"),
    ],
)
def test_misshapen_locks_are_refused_by_name(extra: str, message: str) -> None:
    text = extra[4:] + MINIMAL if extra.startswith("TOP ") else MINIMAL + extra
    with pytest.raises(LockError, match=message):
        parse_lock(text)


def test_lock_files_that_are_not_text_are_refused(tmp_path: Path) -> None:
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"schema = 1\n\x00\xff\xfe")
    with pytest.raises(LockError, match="binary content"):
        load_lock(binary)
    with pytest.raises(LockError, match="lock file"):
        load_lock(tmp_path)  # a folder
    big = tmp_path / "big.toml"
    with big.open("wb") as f:
        f.truncate((8 << 20) + 1)
    with pytest.raises(LockError, match="over the limit"):
        load_lock(big)


def test_schema_and_toolchain_are_required() -> None:
    with pytest.raises(LockError, match="schema"):
        parse_lock(MINIMAL.replace("schema = 1", "schema = 9"))
    with pytest.raises(LockError, match="gcc_max_major"):
        parse_lock(MINIMAL.replace("gcc_max_major = 14", 'gcc_max_major = "14"'))
    with pytest.raises(LockError, match="not valid TOML"):
        parse_lock("schema = ")


def test_tree_hash_depends_on_content_and_names_only(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "k.cuh").write_text("x")
    (tmp_path / "b.cu").write_text("y")
    h1 = tree_hash(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "z.pyc").write_text("ignored")
    assert tree_hash(tmp_path) == h1
    (tmp_path / "b.cu").write_text("y2")
    assert tree_hash(tmp_path) != h1
    (tmp_path / "b.cu").write_text("y")
    (tmp_path / "b.cu").rename(tmp_path / "c.cu")
    assert tree_hash(tmp_path) != h1


def _lock_with_csrc(tmp_path: Path, extra: str = "") -> Path:
    lock = tmp_path / "l.toml"
    lock.write_text(MINIMAL + '[[local]]\nname = "csrc"\npath = "csrc"\nhash = "' + "0" * 64
                    + '"\n' + extra)
    return lock


def test_relock_updates_local_hash_atomically(tmp_path: Path) -> None:
    from sm70ctl.build.lock import relock_local

    csrc = tmp_path / "elsewhere" / "csrc"  # the kernel sources are where they are found
    (csrc / "torch_bindings").mkdir(parents=True)
    (csrc / "torch_bindings" / "k.cu").write_text("kernel")
    lock = _lock_with_csrc(tmp_path)
    changed = relock_local(lock, tmp_path, csrc)
    assert changed["csrc"][1] == tree_hash(csrc)
    assert load_lock(lock).local[0].hash == tree_hash(csrc)
    assert relock_local(lock, tmp_path, csrc) == {}


@pytest.mark.parametrize("state", ["missing", "empty", "only a cache"])
def test_relock_never_writes_the_hash_of_nothing(tmp_path: Path, state: str) -> None:
    # `pip install .` once left csrc/ behind; --relock then hashed the empty folder
    from sm70ctl.build.lock import relock_local

    csrc = tmp_path / "csrc"
    if state != "missing":
        csrc.mkdir()
    if state == "only a cache":
        (csrc / "__pycache__").mkdir()
        (csrc / "__pycache__" / "x.pyc").write_bytes(b"\0")
    lock = _lock_with_csrc(tmp_path)
    before = lock.read_text()
    with pytest.raises(Sm70Error, match=r"cannot hash the kernel sources: .*csrc is missing or "
                                        r"empty"):
        relock_local(lock, tmp_path, csrc)
    assert lock.read_text() == before


def test_relock_refuses_an_empty_other_local_tree(tmp_path: Path) -> None:
    from sm70ctl.build.lock import relock_local

    csrc = tmp_path / "csrc"
    (csrc / "torch_bindings").mkdir(parents=True)
    (csrc / "torch_bindings" / "k.cu").write_text("kernel")
    (tmp_path / "tools").mkdir()
    lock = _lock_with_csrc(tmp_path, '[[local]]\nname = "tools"\npath = "tools"\nhash = "'
                           + "1" * 64 + '"\n')
    before = lock.read_text()
    with pytest.raises(LockError, match=r"\[\[local\]\] tools: .*tools is missing or has no "
                                        r"files"):
        relock_local(lock, tmp_path, csrc)
    assert lock.read_text() == before  # csrc's new hash was not written either


def test_the_rule_is_the_ops_loaders() -> None:
    # one rule: the lock's hash of csrc/ is vllm_patch.ops.sources.source_hash
    from sm70ctl.build.local_sources import kernel_sources_dir, kernel_sources_hash
    from vllm_patch.ops.sources import source_hash

    assert kernel_sources_hash(kernel_sources_dir()) == source_hash()
    assert source_hash(ROOT / "csrc") == tree_hash(ROOT / "csrc")


def test_committed_lock_matches_the_tree() -> None:
    """The shipped lock's local hashes are the tree's: a change to csrc/ without
    `sm70ctl build --relock` fails here (23 csrc commits once went unnoticed)."""
    from sm70ctl.build.local_sources import kernel_sources_dir, local_state
    from sm70ctl.build.lock import project_root

    rows = local_state(load_lock(), project_root(), kernel_sources_dir())
    assert rows and {r["name"] for r in rows} >= {"csrc"}
    drift = [f"{r['name']}: locked {r['locked'][:12]}, tree {r['now'][:12]}" for r in rows
             if r["drift"]]
    assert not drift, f"the committed lock drifts ({drift}): run `sm70ctl build --relock`"


# Structured fuzzing (arbitrary bytes are tests/test_fuzz_readers.py's): valid TOML built
# from the lock's own tables and fields with values of any type; parse_lock either returns
# a Lock or raises LockError, never another exception.
_VALS = st.sampled_from(['"x"', "1", "true", "[]", '["a"]', "[1]", "{}", "{a = 1}",
                         '"' + "a" * 40 + '"', '"' + "b" * 64 + '"', '"https://e/x"',
                         '"../x"', "[{a = 1}]", '"**/*"'])
_SHA = '"' + "b" * 64 + '"'
_GOOD = {  # a valid entry of each kind
    "git": {"name": '"g"', "url": '"https://e/g"', "commit": '"' + "a" * 40 + '"'},
    "archive": {"name": '"a"', "url": '"https://e/a"', "filename": '"a.tgz"', "sha256": _SHA},
    "wheel": {"name": '"w"', "version": '"1"', "filename": '"w.whl"', "url": '"https://e/w"',
              "sha256": _SHA},
    "local": {"name": '"c"', "path": '"c"', "hash": _SHA},
}
_FIELDS = st.sampled_from(["name", "url", "commit", "tag", "unverified", "filename", "sha256",
                           "strip", "patch", "note", "version", "index", "path", "hash",
                           "globs", "x"])
_TOP = st.sampled_from(["git", "local", "notes", "models", "x"])
# each entry: a valid one of its kind with one or two fields set to any value (or added)
_ENTRY = st.builds(
    lambda kind, bad: "\n".join([f"[[{kind}]]", *(f"{k} = {v}" for k, v in
                                                  {**_GOOD[kind], **bad}.items())]),
    st.sampled_from(sorted(_GOOD)), st.dictionaries(_FIELDS, _VALS, max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_ENTRY, max_size=4), st.dictionaries(_TOP, _VALS, max_size=1))
def test_any_lock_shape_parses_or_is_refused_by_name(entries: list[str],
                                                     top: dict[str, str]) -> None:
    # a stray or misshapen top-level key (git = 1, notes = [], ...) goes before [toolchain]
    front = "".join(f"{k} = {v}\n" for k, v in top.items() if k != "schema")
    text = front + MINIMAL + "\n".join(entries) + "\n"
    try:
        parse_lock(text)
    except LockError as exc:
        assert "\n" not in exc.message


def test_relock_reads_the_lock_through_the_bounded_reader(tmp_path: Path) -> None:
    # --relock once read the lock with a bare read_text: a name the OS refuses was an
    # OSError traceback
    from sm70ctl.build.lock import relock_local

    with pytest.raises(LockError, match="a path component is 300 bytes long"):
        relock_local(tmp_path / ("a" * 300), tmp_path, tmp_path)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\x00")
    with pytest.raises(LockError, match="binary content"):
        relock_local(binary, tmp_path, tmp_path)
