"""The rules the speculation drivers share (device_spec_prefix, device_spec_diag,
device_assist, device_draft_int8), pure: which engine's report decides the next plan, what a
comparison against the reference keeps, and the progress line of the summary. They read
the engines' result JSON (spec_engine.py's format) and nothing else; tests/test_spec_rules.py
runs them on made-up results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

Engines = Mapping[str, Mapping[str, Any]]
Compare = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


def progress(engines: Engines, names: Iterable[str], count_key: str = "phases_done"
             ) -> dict[str, dict[str, Any]]:
    """Per engine: its start-up error, start-up seconds and how many phases it has rows of
    (under `count_key`: the drivers' summaries predate this module and name it apart)."""
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        e = engines.get(n) or {}
        out[n] = {"error": e.get("error"), "startup_s": e.get("startup_s"),
                  count_key: len(e.get("phases") or {})}
    return out


def first_block_size(engines: Engines, order: Iterable[str]) -> tuple[str, int] | None:
    """(name, block size) of the first engine in `order` that has reported its facts."""
    for n in order:
        facts = (engines.get(n) or {}).get("engine")
        if facts:
            return n, facts["block_size"]
    return None


def seed_order(ref: str, names: Iterable[str], ref_running: bool) -> tuple[str, ...]:
    """Whose seed output may build stage 2: the reference's own while it runs, any engine's
    (the reference first if it is in `names`) once it has stopped without one."""
    return (ref,) if ref_running else tuple(names)


def seed_source(engines: Engines, order: Iterable[str]) -> tuple[str, list[int]] | None:
    """(name, tokens) of the first engine in `order` with rows for the `seed` phase."""
    for n in order:
        rows = ((engines.get(n) or {}).get("phases") or {}).get("seed")
        if rows:
            return n, rows[0]["tokens"]
    return None


def without_phases(comparison: Mapping[str, Any]) -> dict[str, Any]:
    """A comparison's verdict and counts without its per-row detail."""
    return {k: v for k, v in comparison.items() if k != "phases"}


def per_phase(comparison: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per phase of a comparison: equal requests of how many, and the largest log-prob gap."""
    return {ph: {"equal": sum(r["equal"] for r in rs), "requests": len(rs),
                 "max_abs_dlogprob": max((r["max_abs_dlogprob"] for r in rs), default=None)}
            for ph, rs in comparison["phases"].items()}


def vs_reference(engines: Engines, ref: str, names: Iterable[str], compare: Compare,
                 with_per_phase: bool = False) -> dict[str, dict[str, Any]]:
    """`<name>_vs_<ref>`: compare(reference, engine) without its rows, for every engine of
    `names` that wrote a result while the reference did too; with `with_per_phase`, each
    also gets its `per_phase` figures."""
    out: dict[str, dict[str, Any]] = {}
    base = engines.get(ref)
    if not base:
        return out
    for n in names:
        eng = engines.get(n)
        if not eng:
            continue
        c = compare(base, eng)
        out[f"{n}_vs_{ref}"] = without_phases(c)
        if with_per_phase:
            out[f"{n}_vs_{ref}"]["per_phase"] = per_phase(c)
    return out
