"""Bad input, tried broadly: any text in any variable gives either valid settings or a
SettingsError whose every problem names the variable, the value and the rule."""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sm70ctl.settings import SettingsError, load_schema, load_settings
from sm70ctl.settings import values as V

SCHEMA = load_schema()
NAMES = [v.name for v in SCHEMA.variables]
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

texts = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=string.digits + ".-+eE kKmMgGiBsh,", max_size=12),
    st.sampled_from(["", " ", "-1", "0", "1e309", "nan", "inf", "9.9GiB", "30s", "true",
                     "1,2", ",", "1,,2", "GPU-", "0x10", "١٢", "~x", "~/m", "a\x00b"]),
)


def _check(problems, environ):
    for p in problems:
        assert p.variable and p.rule and p.allowed and p.source
        spec = SCHEMA.by_name.get(p.variable)
        if spec is not None and spec.secret:
            assert p.value == "***"
        if p.variable in environ and not (spec and spec.secret):
            assert p.value == environ[p.variable] or p.rule  # the text as given


@FAST
@given(name=st.sampled_from(NAMES), text=texts)
def test_any_text_in_any_variable_is_accepted_or_explained(name, text):
    environ = {name: text}
    try:
        s = load_settings(environ)
    except SettingsError as exc:
        assert exc.problems
        assert any(p.variable == name for p in exc.problems) or all(
            p.related for p in exc.problems)
        _check(exc.problems, environ)
    else:
        assert s.source_of(name) == "environment"


@FAST
@given(environ=st.dictionaries(st.sampled_from(NAMES), texts, max_size=8))
def test_many_bad_values_are_all_reported(environ):
    try:
        load_settings(environ)
    except SettingsError as exc:
        _check(exc.problems, environ)
        bad_alone = set()
        for name, text in environ.items():
            try:
                load_settings({name: text})
            except SettingsError as one:
                if any(p.variable == name and not p.related for p in one.problems):
                    bad_alone.add(name)
        reported = {p.variable for p in exc.problems}
        assert bad_alone <= reported


@FAST
@given(environ=st.dictionaries(st.sampled_from(NAMES), texts, max_size=6),
       secret=st.text(alphabet=string.printable, max_size=20),
       token_name=st.sampled_from(["SM70_API_KEY", "SM70_HF_TOKEN", "SM70_API_KEYS"]))
def test_secrets_never_appear_in_messages(environ, secret, token_name):
    environ = {**environ, token_name: "zqx" + secret, "SM70_HF_TOKEN": "zqx" + secret}
    try:
        s = load_settings(environ)
    except SettingsError as exc:
        assert "zqx" not in exc.message
        assert all("zqx" not in str(p.to_dict()) for p in exc.problems)
    else:
        assert "zqx" not in repr(s)


INT_SPECS = [v.name for v in SCHEMA.variables if v.type == "int" and v.max is not None]


@FAST
@given(name=st.sampled_from(INT_SPECS), data=st.data())
def test_out_of_range_integers_name_the_range(name, data):
    spec = SCHEMA.by_name[name]
    value = data.draw(st.one_of(st.integers(max_value=int(spec.min) - 1),
                                st.integers(min_value=int(spec.max) + 1)))
    with pytest.raises(SettingsError) as info:
        load_settings({spec.name: str(value)})
    (p,) = [p for p in info.value.problems if p.variable == spec.name]
    assert p.rule in ("out of range",) or p.rule.startswith("not one of")
    assert p.value == str(value)


@FAST
@given(suffix=st.text(alphabet=string.ascii_uppercase + "_", min_size=1, max_size=20))
def test_unknown_names_are_errors(suffix):
    name = "SM70_" + suffix
    assume(name not in SCHEMA.by_name and name != "SM70_PLUGIN_CONFIG")
    with pytest.raises(SettingsError) as info:
        load_settings({name: "1"})
    (p,) = info.value.problems
    assert p.variable == name and p.rule == "unknown SM70_ variable"
    assert p.allowed.startswith("did you mean SM70_") or "env list" in p.allowed


@given(n=st.integers(min_value=0, max_value=10**6),
       unit=st.sampled_from(sorted(V.BYTE_UNITS)))
def test_byte_sizes_with_units(n, unit):
    for spelled in (unit, unit.upper()):
        assert V.parse_bytes(f"{n}{spelled}") == n * V.BYTE_UNITS[unit]


@given(n=st.integers(min_value=0, max_value=2**50))
def test_byte_format_round_trips(n):
    assert V.parse_bytes(V.format_bytes(n)) == n


@given(seconds=st.integers(min_value=0, max_value=10**7))
def test_duration_format_round_trips(seconds):
    assert V.parse_duration(V.format_duration(float(seconds))) == seconds


@given(word=st.sampled_from(V.TRUE_WORDS + V.FALSE_WORDS), data=st.data())
def test_bool_words_any_case(word, data):
    spelled = "".join(data.draw(st.sampled_from([c.lower(), c.upper()])) for c in word)
    assert V.parse_bool(spelled) is (word in V.TRUE_WORDS)


@pytest.mark.parametrize("text", ["5 parsecs", "GiB", "1.5", "-1GiB", "1e3MiB", "10 QiB"])
def test_bad_byte_sizes(text):
    with pytest.raises(V.BadValue):
        V.parse_bytes(text)


def _valid_values(spec):
    values = [spec.default, spec.example]
    if spec.choices:
        values += list(spec.choices)
    return [v for v in values if v is not None]


@FAST
@given(data=st.data())
def test_combinations_of_valid_values_never_crash(data):
    picked = data.draw(st.lists(st.sampled_from(NAMES), max_size=10, unique=True))
    environ = {n: data.draw(st.sampled_from(_valid_values(SCHEMA.by_name[n]))) for n in picked}
    try:
        load_settings(environ)
    except SettingsError as exc:
        # Values valid on their own can only clash through cross-field rules.
        from sm70ctl.settings.rules import RULES  # noqa: F401

        for p in exc.problems:
            assert p.related, p.line()


@FAST
@given(lines=st.lists(st.one_of(
    st.text(max_size=40),
    st.builds(lambda n, v: f"{n}={v}", st.sampled_from(NAMES), texts),
    st.builds(lambda n, v: f"export {n}='{v}'", st.sampled_from(NAMES), st.text(
        alphabet=string.ascii_letters + string.digits + "., ", max_size=10)),
), max_size=12))
def test_any_env_file_is_accepted_or_explained(tmp_path_factory, lines):
    from sm70ctl.errors import Sm70Error

    path = tmp_path_factory.mktemp("envfile") / "x.env"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    # Without odd line breaks inside an item, item i is the file's line i + 1 whichever
    # splitting convention the parser uses, so a problem's line number can be checked.
    plain = not any(ch in item for item in lines for ch in _LINE_BREAKS)
    try:
        load_settings({}, env_file=path)
    except SettingsError as exc:
        for p in exc.problems:
            assert p.variable and p.rule and p.allowed
            # every problem is traced to the file: its own line, or the line of the
            # related variable the file set (a cross-field conflict with a default)
            numbers = [int(n) for n in re.findall(rf"file:{re.escape(str(path))}:(\d+)",
                                                  p.source)]
            assert numbers, p.line()
            for n in numbers if plain else ():
                assert 1 <= n <= len(lines), f"{p.line()} points past the file's end"
                named = (p.variable, *p.related)
                assert p.variable == f"{path}:{n}" or any(v in lines[n - 1] for v in named), (
                    f"{p.line()} points at line {n}: {lines[n - 1]!r}")
    except Sm70Error as exc:  # unreadable (e.g. not UTF-8): one clear message
        assert exc.message.startswith(f"env file {path}: ")


def test_binary_env_file_is_a_clear_error(tmp_path):
    from sm70ctl.errors import Sm70Error

    path = tmp_path / "bin.env"
    path.write_bytes(b"\xff\xfe\x00SM70_PORT=1")
    with pytest.raises(Sm70Error, match=r"env file .*: binary content"):
        load_settings({}, env_file=path)


@pytest.mark.parametrize(("name", "text", "rule"), [
    ("SM70_GPUS", "0,0", "repeated items"),
    ("SM70_GPUS", "0,", "empty list item"),
    ("SM70_GPUS", "gpu0,1", "does not match the expected format"),
    ("SM70_CUDAGRAPH_SIZES", "1,2,x", "not an integer"),
    ("SM70_CUDAGRAPH_SIZES", "0,1", "out of range"),
    ("SM70_BLOCK_SIZE", "24", "not a multiple of 16"),
    ("SM70_STARTUP_TIMEOUT", "5 fortnights", "unknown duration unit"),
    ("SM70_STARTUP_TIMEOUT", "25h", "out of range"),
    ("SM70_KV_CACHE_BYTES", "9.9 GiBs", "unknown size unit"),
    ("SM70_KV_CACHE_BYTES", "33GiB", "out of range"),
    # the name says MiB, but a bare number is bytes: the rule says so
    ("SM70_GPU_BUSY_MIB", "500", "out of range (500 B: a size without a unit is bytes)"),
    ("SM70_GPU_MEMORY_UTILIZATION", "96%", "not a number"),
    ("SM70_GPU_MEMORY_UTILIZATION", "nan", "not a finite number"),
    ("SM70_RESTART", "maybe", "not a boolean"),
    ("SM70_DTYPE", "bfloat16", "not one of the allowed choices"),
    ("SM70_DTYPE", "", "empty value"),
    ("SM70_CUDA_ARCH_LIST", "sm_70", "does not match the expected format"),
    ("SM70_PORT", "80.5", "not an integer"),
])
def test_bad_values_name_variable_value_and_rule(name, text, rule):
    with pytest.raises(SettingsError) as info:
        load_settings({name: text})
    (p,) = info.value.problems
    assert (p.variable, p.value, p.source) == (name, text, "environment")
    assert p.rule.startswith(rule) and p.allowed


@pytest.mark.parametrize("text", ["~nosuchuser_sm70/models", "/srv/a\x00b"])
def test_unusable_paths_are_explained(text):
    with pytest.raises(SettingsError) as info:
        load_settings({"SM70_MODEL_DIR": text})
    (p,) = info.value.problems
    assert p.variable == "SM70_MODEL_DIR" and ("~" in p.rule or "NUL" in p.rule)
