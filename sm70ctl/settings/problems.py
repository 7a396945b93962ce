"""What a broken setting looks like: one `Problem` per rule broken, all raised together."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sm70ctl.errors import Sm70Error
from sm70ctl.secrets import MASK

__all__ = ["MASK", "Problem", "SettingsError"]


@dataclass(frozen=True)
class Problem:
    """One broken rule: which variable, its value (masked when secret), the rule, what fits."""

    variable: str
    value: str
    rule: str
    allowed: str
    source: str = "default"
    related: tuple[str, ...] = ()

    def line(self) -> str:
        where = f" [{self.source}]" if self.source else ""
        return f"{self.variable}={self.value!r}{where}: {self.rule} (allowed: {self.allowed})"

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["related"] = list(self.related)
        return data


class SettingsError(Sm70Error):
    """Every problem found in the SM70_* settings, collected before raising."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        count = len(self.problems)
        head = f"{count} problem{'s' if count != 1 else ''} in SM70_* settings"
        body = "\n".join(f"  - {p.line()}" for p in self.problems)
        super().__init__(
            f"{head}:\n{body}",
            hint="`sm70ctl env check` shows them as a table; `sm70ctl env explain NAME` "
            "describes a variable",
        )
