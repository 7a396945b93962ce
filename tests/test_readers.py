"""The bounded, typed readers: every malformed file is one Sm70Error line, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sm70ctl.errors import Sm70Error
from sm70ctl.readers import (
    MAX_DEPTH,
    View,
    check_path,
    nesting_depth,
    path_problem,
    read_json,
    read_text,
    read_toml,
    view_json,
    view_toml,
)


def _err(fn, *args, **kwargs) -> str:
    with pytest.raises(Sm70Error) as info:
        fn(*args, **kwargs)
    msg = info.value.message
    assert "\n" not in msg
    return msg


def test_json_ok(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text('{"a": [1, 2, {"b": "x"}]}')
    assert read_json(p, what="model config") == {"a": [1, 2, {"b": "x"}]}


def test_json_bom_accepted(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert read_json(p, what="model config") == {"a": 1}


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_json_deep_nesting_refused(tmp_path: Path, depth: int) -> None:
    p = tmp_path / "deep.json"
    p.write_text("[" * depth + "]" * depth)
    msg = _err(read_json, p, what="model config")
    assert "model config" in msg and str(p) in msg and f"{MAX_DEPTH} levels" in msg


def test_json_depth_at_limit_accepted(tmp_path: Path) -> None:
    p = tmp_path / "ok.json"
    p.write_text("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert read_json(p, what="x") is not None


def test_brackets_inside_strings_do_not_count() -> None:
    assert nesting_depth('{"a": "[[[[[[[[[[[[\\"[[["}') == 1


@pytest.mark.parametrize("content,rule", [
    (b"\x00\x01\x02binary", "binary content"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"a": 1', "not valid JSON"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON"),
])
def test_json_malformed(tmp_path: Path, content: bytes, rule: str) -> None:
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    assert rule in _err(read_json, p, what="manifest")


def test_directory_refused(tmp_path: Path) -> None:
    assert "is a folder" in _err(read_json, tmp_path, what="manifest")


def test_missing_file(tmp_path: Path) -> None:
    assert "cannot read" in _err(read_text, tmp_path / "nope", what="env file")


def test_fifo_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in _err(read_text, fifo, what="env file")


def test_size_limit(tmp_path: Path) -> None:
    p = tmp_path / "big.json"
    p.write_text("[" + "1," * 1000 + "1]")
    msg = _err(read_json, p, what="manifest", max_bytes=100)
    assert "over the limit of 100 bytes" in msg


def test_path_limits() -> None:
    assert path_problem("/a/" + "x" * 255) is None
    assert "256 bytes" in (path_problem("/a/" + "x" * 256) or "")
    assert "limit 4096" in (path_problem("/" + "/".join(["y" * 200] * 30)) or "")
    assert "NUL" in (path_problem("/a\x00b") or "")
    # bytes, not characters: 128 two-byte characters are 256 bytes
    assert path_problem("/" + "é" * 128) is not None
    msg = _err(check_path, "/" + "x" * 300, what="SM70_MODEL_DIR")
    assert msg.startswith("SM70_MODEL_DIR ") and len(msg) < 300


def test_toml_ok_and_malformed(tmp_path: Path) -> None:
    p = tmp_path / "l.toml"
    p.write_text('a = 1\n[[src]]\nname = "x"\n')
    assert read_toml(p, what="lock file") == {"a": 1, "src": [{"name": "x"}]}
    p.write_text("a = " + "[" * 200 + "]" * 200)
    assert "levels deep" in _err(read_toml, p, what="lock file")
    p.write_text("x." * 200 + "y = 1")
    assert "levels deep" in _err(read_toml, p, what="lock file")
    p.write_text("a = = 1")
    assert "not valid TOML" in _err(read_toml, p, what="lock file")
    p.write_text('s = "[[[[[[" # [[[[[[[[\n')
    assert read_toml(p, what="lock file", max_depth=2) == {"s": "[[[[[["}


def _view(data: object) -> View:
    return View(data, what="doctor record", name="r.json")


def test_view_types() -> None:
    v = _view({"s": "x", "n": None, "i": 3, "b": True, "t": {"k": "v"}, "l": [{"a": 1}],
               "f": 1.5, "sl": ["a", 2]})
    assert v.get_str("s") == "x"
    assert "r.json: n: expected a string, got null" in _err(v.get_str, "n")
    assert "missing" in _err(v.get_str, "zz")
    assert v.get_str("zz", None) is None
    assert v.get_int("i", min=1, max=3) == 3
    assert "above the maximum 2" in _err(v.get_int, "i", max=2)
    assert "expected an integer, got a boolean" in _err(v.get_int, "b")
    assert v.get_bool("b") is True
    assert v.get_float("f") == 1.5
    assert v.sub("t").get_str("k") == "v"
    assert "t.k: expected an integer" in _err(v.sub("t").get_int, "k")
    assert v.tables("l")[0].get_int("a") == 1
    assert "expected an array, got a table" in _err(v.tables, "t")
    assert "sl[1]: expected a string, got an integer" in _err(v.get_str_list, "sl")
    assert "stray: unknown key" in _err(_view({"stray": 1}).only, ["a"])


def test_table_where_array_of_tables_belongs(tmp_path: Path) -> None:
    p = tmp_path / "l.toml"
    p.write_text('[src]\nname = "x"\n')
    assert "src: expected an array, got a table" in _err(view_toml(p, what="lock").tables, "src")
    p.write_text('src = [1]\n')
    assert "src[0]: expected a table, got an integer" in _err(
        view_toml(p, what="lock").tables, "src")


def test_view_json_names_file(tmp_path: Path) -> None:
    p = tmp_path / "m.json"
    p.write_text("[]")
    msg = _err(view_json(p, what="warmup manifest").get_str, "x")
    assert msg.startswith(f"warmup manifest {p}: ")


def test_unterminated_strings_scan_in_one_pass(tmp_path: Path) -> None:
    # Each escaped quote after an open one used to restart the string scan: a file of
    # them took minutes. Now it is refused as soon as it is parsed.
    p = tmp_path / "quotes.json"
    p.write_text('"' + '\\"' * 200_000)
    assert "not valid JSON" in _err(read_json, p, what="manifest")
    p = tmp_path / "quotes.toml"
    p.write_text('"""' * 200_000)
    assert "not valid TOML" in _err(read_toml, p, what="lock file")


def test_long_keys_and_values_stay_one_short_line() -> None:
    msg = _err(View({"k\n" * 500_000: 1}, what="x", name="f").only, ["a"])
    assert len(msg) < 300 and "\\n" in msg
    assert len(_err(View({"a": 10**4000}, what="x", name="f").get_int, "a", max=3)) < 400


def test_pipe_allowed_only_when_asked(tmp_path: Path) -> None:
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write() -> None:
        try:
            with open(fifo, "w") as f:
                f.write("SM70_PORT=1\n" * 10)
        except BrokenPipeError:  # the reader stopped at its limit
            pass

    writer = threading.Thread(target=write)
    writer.start()
    assert read_text(fifo, what="env file", allow_pipe=True) == "SM70_PORT=1\n" * 10
    writer.join()
    writer = threading.Thread(target=write)
    writer.start()
    assert "over the limit of 20 bytes" in _err(read_text, fifo, what="env file",
                                                allow_pipe=True, max_bytes=20)
    writer.join()
