"""Packaging hook: ship the kernel sources (csrc/) inside the wheel as vllm_patch/_csrc/.

Everything else about the package is declared in pyproject.toml. csrc/ at the repository
root stays the one source of truth; a non-editable install (`pip install .`) has no checkout
beside it, so `vllm_patch.ops.sources.csrc_dir()` falls back to this copy. The copy holds
exactly the files of csrc/ (caches left out, as the source hash leaves them out), so the
hash of the installed copy equals the checkout's.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
PACKAGED = Path("vllm_patch") / "_csrc"


def csrc_files(root: Path) -> list[Path]:
    """The files of csrc/ that ship, relative to csrc/ (the source hash's rule: caches out)."""
    base = root / CSRC
    return sorted(p.relative_to(base) for p in base.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


class BuildPyWithCsrc(build_py):
    """build_py that also copies csrc/ into the built package as vllm_patch/_csrc/."""

    def run(self) -> None:
        super().run()
        files = csrc_files(ROOT)
        if not files:
            raise SystemExit(f"{ROOT / CSRC}: no kernel sources to ship; the wheel would "
                             "install a package that cannot build its ops")
        dest = Path(self.build_lib) / PACKAGED
        for rel in files:
            target = dest / rel
            self.mkpath(str(target.parent))
            self.copy_file(str(ROOT / CSRC / rel), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        dest = Path(self.build_lib) / PACKAGED
        return [*super().get_outputs(include_bytecode),
                *(str(dest / rel) for rel in csrc_files(ROOT))]


setup(cmdclass={"build_py": BuildPyWithCsrc})
