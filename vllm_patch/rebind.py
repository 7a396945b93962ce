"""One checked rebinding of a vLLM 0.22.1 method, installed when its module is imported.

The runtime patches R7-R10 (`runtime_patches/README.md`) each replace one function by a
wrapper around it. What they share lives here: the check that the method is still the
one the wrapper was written against (vLLM's version, its parameters, names its body uses),
the idempotent install, the refusal that leaves vLLM's method in place with one logged
line, and the import hook that defers the install until the module is imported (only the
processes that import it pay for it). R5, R-ASSIST and R6 keep installers of their own
(they record more) but use `check`, `base_version` and `AfterImport` from here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm_patch")


def base_version(version: str) -> str:
    """'0.22.1' of '0.22.1', '0.22.1+cu130' or '0.22.1.dev3+g0dec' (local/dev tags are
    builds of the same source)."""
    return version.split("+", 1)[0].split(".dev", 1)[0]


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` right after `name` has been imported (once), through the loader
    the other finders pick for it."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if loader is None or exec_module is None:
            return spec
        then = self.then

        def exec_then(module: ModuleType) -> None:
            exec_module(module)
            then()

        loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec



class RebindError(RuntimeError):
    """The rebinding's target is not the function it was written against."""


def defer(module: str, mark: str, run: Callable[[], None]) -> None:
    """Run `run()` right after `module` is imported, once: a second call with the same
    `mark` (another register() in the process) adds no second hook, while rebindings with
    other marks on the same module each keep theirs."""
    if not any(getattr(f, "_sm70_mark", None) == mark for f in sys.meta_path):
        hook = AfterImport(module, run)
        hook._sm70_mark = mark  # type: ignore[attr-defined]
        sys.meta_path.insert(0, hook)


@dataclass(frozen=True)
class Target:
    module: str
    owner: str  # the class in `module`; "" for a function of the module itself
    attr: str
    version: str
    params: tuple[str, ...]
    names: frozenset[str]  # names the target's body must still use
    mark: str  # attribute set on the wrapper: installed already

    @property
    def path(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.attr) if p)


def check(target: Target, func: Any, version: str,
          error: type[RebindError] = RebindError, off_switch: str = "") -> None:
    """Raise `error` (one line naming what differs) unless `func` is the expected target;
    `off_switch` (e.g. "set logprobs.prompt_chunk to 0") joins the version refusal."""
    if base_version(version) != target.version:
        how = f" ({off_switch} to silence, or port it)" if off_switch else ""
        raise error(f"{target.path}: vLLM is {version}, this rebinding is written for "
                    f"{target.version}; not installed{how}")
    code = getattr(func, "__code__", None)
    if not callable(func) or code is None:
        raise error(f"{target.path}: is {type(func).__name__}, not a function; not installed")
    params = tuple(inspect.signature(func).parameters)
    if params != target.params:
        raise error(f"{target.path}: parameters {params}, expected {target.params}; "
                    "not installed")
    missing = sorted(target.names - set(code.co_names))
    if missing:
        raise error(f"{target.path}: its code no longer uses {missing}; not installed")


@dataclass
class Installer:
    """Installs `wrap(original)` in place of the target, once per process."""

    target: Target
    wrap: Callable[[Any], Any]
    acts: str  # what the installed wrapper acts on, for the report line
    error: type[RebindError] = RebindError
    outcomes: list[str] = field(default_factory=list)

    def install(self) -> str:
        import vllm

        module = importlib.import_module(self.target.module)
        owner = getattr(module, self.target.owner) if self.target.owner else module
        current = owner.__dict__.get(self.target.attr)
        if getattr(current, self.target.mark, False):
            return "wrapped (already installed)"
        check(self.target, current, vllm.__version__, self.error)
        wrapper = self.wrap(current)
        setattr(wrapper, self.target.mark, True)
        wrapper.__wrapped__ = current
        setattr(owner, self.target.attr, wrapper)
        return f"wrapped ({self.acts})"

    def install_or_refuse(self) -> str:
        try:
            return self.install()
        except RebindError as exc:
            logger.error("sm70 plugin: %s not rebound: %s", self.target.path, exc)
            return f"refused ({exc})"
        except ImportError as exc:
            return f"absent ({self.target.path} does not import: {exc})"

    def outcome(self) -> str | None:
        return self.outcomes[-1] if self.outcomes else None

    def install_when_imported(self) -> str:
        """Now if the target's module is loaded, else right after it is imported."""
        def run() -> None:
            self.outcomes.append(self.install_or_refuse())

        if self.target.module in sys.modules:
            run()
            return self.outcomes[-1]
        defer(self.target.module, self.target.mark, run)
        return f"deferred (installed when {self.target.module} is imported)"
