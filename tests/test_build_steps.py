"""The content-addressed step runner, with real (cheap) steps writing real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from sm70ctl.build.steps import (
    Step,
    StepContext,
    StepError,
    Store,
    diff_inputs,
    order_steps,
    plan_steps,
    run_steps,
    step_key,
)


class Counter:
    def __init__(self) -> None:
        self.runs: list[str] = []


def make_steps(counter: Counter, a_input: str = "1", b_input: str = "x", fail_b: bool = False):
    def run_a(ctx: StepContext) -> None:
        counter.runs.append("a")
        (ctx.out / "a.txt").write_text(a_input)

    def run_b(ctx: StepContext) -> None:
        counter.runs.append("b")
        (ctx.out / "partial").write_text("half")
        if fail_b:
            raise RuntimeError("boom")
        text = (ctx.deps["a"] / "a.txt").read_text()
        (ctx.out / "b.txt").write_text(text + b_input)

    def run_c(ctx: StepContext) -> None:
        counter.runs.append("c")
        (ctx.out / "c.txt").write_text("independent")

    return [
        Step("a", "fetch", "A", {"v": a_input}, run_a),
        Step("b", "patch", "B", {"v": b_input}, run_b, deps=("a",)),
        Step("c", "fetch", "C", {"v": "c"}, run_c),
    ]


def build(store: Store, steps: list[Step]):
    planned = plan_steps(steps, store)
    return planned, run_steps(planned, store, log=lambda m: None)


def test_second_run_is_a_noop(tmp_path: Path) -> None:
    store, c = Store(tmp_path), Counter()
    _, results = build(store, make_steps(c))
    assert c.runs == ["a", "b", "c"]
    assert (Path(results[1].output) / "b.txt").read_text() == "1x"
    c2 = Counter()
    planned, results = build(store, make_steps(c2))
    assert c2.runs == []
    assert {p.status for p in planned} == {"cached"}
    assert {r.status for r in results} == {"cached"}


def test_changed_input_rebuilds_it_and_dependents_only(tmp_path: Path) -> None:
    store = Store(tmp_path)
    build(store, make_steps(Counter()))
    c = Counter()
    planned, _ = build(store, make_steps(c, a_input="2"))
    assert c.runs == ["a", "b"]
    status = {p.step.name: (p.status, p.reason) for p in planned}
    assert status["a"] == ("stale", "changed: v")
    assert status["b"][0] == "stale" and "rebuilt upstream: a" in status["b"][1]
    assert status["c"][0] == "cached"
    # Superseded outputs are removed; exactly one result per step remains.
    assert len([p for p in (tmp_path / "a").iterdir() if p.is_dir()]) == 1


def test_failed_step_commits_nothing_and_earlier_steps_stay(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        build(store, make_steps(Counter(), fail_b=True))
    assert list((tmp_path / "a").glob("*.json"))
    assert not list((tmp_path / "b").glob("*.json"))
    assert not [p for p in (tmp_path / "b").iterdir()]  # the temp folder was removed
    c = Counter()
    build(store, make_steps(c))
    assert c.runs == ["b", "c"]  # "a" finished before the failure and is not redone


def test_leftover_from_a_killed_run_is_reported_and_redone(tmp_path: Path) -> None:
    store = Store(tmp_path)
    steps = make_steps(Counter())
    build(store, steps[:1])  # only "a" finished
    key_b = step_key(steps[1], {"a": step_key(steps[0], {})})
    left = tmp_path / "b" / f".tmp-{key_b[:16]}-99999"
    left.mkdir(parents=True)
    (left / "partial").write_text("half written by a killed process")
    planned = plan_steps(make_steps(Counter()), store)
    assert {p.step.name: p.status for p in planned} == {
        "a": "cached", "b": "interrupted", "c": "missing"}
    run_steps(planned, store, log=lambda m: None)
    assert not left.exists()
    assert (store.output("b", key_b) / "b.txt").read_text() == "1x"


def test_stamp_is_required_for_cached(tmp_path: Path) -> None:
    store = Store(tmp_path)
    steps = make_steps(Counter())
    build(store, steps)
    key_a = step_key(steps[0], {})
    store.stamp("a", key_a).unlink()  # output without a stamp: not trusted
    planned = plan_steps(make_steps(Counter()), store)
    assert planned[0].status != "cached"


def test_still_valid_hook_invalidates(tmp_path: Path) -> None:
    store = Store(tmp_path)
    flag = {"ok": True}
    steps = [Step("i", "install", "I", {}, lambda ctx: None,
                  still_valid=lambda out: flag["ok"])]
    build(store, steps)
    assert plan_steps(steps, store)[0].status == "cached"
    flag["ok"] = False
    assert plan_steps(steps, store)[0].status == "invalid"


def test_order_and_cycles() -> None:
    def noop(ctx: StepContext) -> None:
        return None

    s = [Step("b", "k", "", {}, noop, deps=("a",)), Step("a", "k", "", {}, noop)]
    assert [x.name for x in order_steps(s)] == ["a", "b"]
    with pytest.raises(StepError, match="depend on each other"):
        order_steps([Step("a", "k", "", {}, noop, deps=("b",)),
                     Step("b", "k", "", {}, noop, deps=("a",))])
    with pytest.raises(StepError, match="unknown step"):
        order_steps([Step("a", "k", "", {}, noop, deps=("zzz",))])


def test_key_covers_inputs_and_upstream_keys() -> None:
    def noop(ctx: StepContext) -> None:
        return None

    s = Step("x", "k", "", {"a": 1, "b": [1, 2]}, noop, deps=("d",))
    k = step_key(s, {"d": "1"})
    assert k == step_key(Step("x", "k", "other text", {"b": [1, 2], "a": 1}, noop, deps=("d",)),
                         {"d": "1"})
    assert k != step_key(s, {"d": "2"})
    assert k != step_key(Step("x", "k", "", {"a": 2, "b": [1, 2]}, noop, deps=("d",)), {"d": "1"})


def test_diff_inputs_names_nested_changes() -> None:
    assert diff_inputs({"a": 1, "t": {"nvcc": "12.8", "cc": "12"}},
                       {"a": 1, "t": {"nvcc": "12.9", "cc": "12"}, "n": 1}) == ["n", "t.nvcc"]
