"""Doctor records: forgiving about versions, strict about types, never holding a secret."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sm70ctl.doctor.records import MAX_DEPTH, RecordError, from_dict, to_dict
from sm70ctl.secrets import MASK


@dataclass
class Inner:
    name: str = ""
    count: int = 0


@dataclass
class Rec:
    label: str = ""
    maybe: str | None = None
    items: list[Inner] = field(default_factory=list)
    table: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    pair: tuple[int, str] = (0, "")


def test_round_trip_and_forgiving_keys() -> None:
    rec = Rec(label="x", items=[Inner("a", 2)], table={"k": 1}, pair=(3, "y"))
    data = to_dict(rec)
    data["from_a_newer_version"] = True
    del data["maybe"]
    assert from_dict(Rec, data) == rec


@pytest.mark.parametrize("data,where", [
    ({"label": None}, ".label: expected str, got null"),
    ({"items": [{"name": None}]}, ".items[0].name: expected str, got null"),
    ({"items": {"name": "a"}}, ".items: expected a list, got object"),
    ({"items": [{"count": True}]}, ".items[0].count: expected int, got bool"),
    ({"table": {"k": "v"}}, ".table.k: expected int, got str"),
    ({"pair": [1]}, ".pair: expected 2 items, got 1"),
    ({"maybe": 3}, ".maybe: expected str, got int"),
])
def test_wrong_types_are_record_errors(data: dict, where: str) -> None:
    with pytest.raises(RecordError, match=where.replace("[", r"\[").replace("]", r"\]")):
        from_dict(Rec, data)


def test_optional_accepts_null() -> None:
    assert from_dict(Rec, {"maybe": None}).maybe is None


@dataclass
class Nest:
    child: Nest | None = None


def test_depth_bounded() -> None:
    data: dict = {}
    for _ in range(MAX_DEPTH + 5):
        data = {"child": data}
    with pytest.raises(RecordError, match="levels deep"):
        from_dict(Nest, data)


def test_to_dict_masks_secrets() -> None:
    rec = Rec(label="key sk-abc in output", env={"SM70_API_KYE": "sk-zzz", "PATH": "/bin"})
    data = to_dict(rec, secrets=["sk-abc"])
    assert data["label"] == f"key {MASK} in output"
    assert data["env"] == {"SM70_API_KYE": MASK, "PATH": "/bin"}
