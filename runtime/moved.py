"""Old import paths with an end: each warns once (a ``DeprecationWarning`` naming its new path and the release
that removes it), and keeps working until then.

The paths kept for configs, plugins and trainers' code written before a move (docs/changelog.md lists them) all
say it the same way, from here: a moved module's old name (``MovedModules``: ``import OLD.X`` is the new module
itself, not a copy, so state and ``isinstance`` stay one), a renamed class (``moved_names``: a module's
``__getattr__``), or a whole old module (``warn`` at its top, run once per process).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import CodeType, ModuleType
from typing import Any

__all__ = ["REMOVED_IN", "MovedModules", "moved_names", "warn"]

REMOVED_IN = "0.2.0"  # the next minor release: the old paths below it are gone from there


def warn(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Say once that ``old`` is ``new`` now and when ``old`` goes. ``stacklevel``: counted from the caller
    (importlib's frames are skipped, so a module's top level names its importer)."""
    warnings.warn(
        f"{old} is deprecated: use {new} ({old} is removed in gym-runtime {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def moved_names(module: str, names: Mapping[str, tuple[object, str]]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` (PEP 562) serving its old names: ``names`` maps each to (the object, its new
    path); the first use of each warns, and the name is then bound in the module (no warning again)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value, new = names[name]
        warn(f"{module}.{name}", new)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import PACKAGE.X`` (and ``python -m PACKAGE.X``) for each X of ``moved`` (X -> its new module's path):
    the new module itself, bound under the old name too on first import, which warns."""

    def __init__(self, package: str, moved: dict[str, str]) -> None:
        self.package = package
        self.moved = moved

    def install(self) -> None:
        """Last on ``sys.meta_path``: asked only for names no file answers."""
        if self not in sys.meta_path:
            sys.meta_path.append(self)

    def new(self, fullname: str) -> str | None:
        parent, _, name = fullname.rpartition(".")
        return self.moved.get(name) if parent == self.package else None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if self.new(fullname) else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder, replaced in ``exec_module``

    def exec_module(self, module: ModuleType) -> None:
        # the import system returns what sys.modules holds under the name once this returns: the new module
        self._bind(module.__name__, stacklevel=3)

    def getattr(self, name: str) -> ModuleType:
        """The package's ``__getattr__``: ``PACKAGE.X`` as an attribute (``from PACKAGE import X`` too)."""
        if name not in self.moved:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        return sys.modules.get(f"{self.package}.{name}") or self._bind(f"{self.package}.{name}", stacklevel=3)

    def _bind(self, fullname: str, *, stacklevel: int) -> ModuleType:
        new = self.new(fullname)
        assert new is not None
        warn(fullname, new, stacklevel=stacklevel)
        module = sys.modules[fullname] = importlib.import_module(new)
        return module

    def get_code(self, fullname: str) -> CodeType | None:
        """``python -m PACKAGE.X`` (runpy): the new module's code, run as ``__main__``."""
        new = self.new(fullname)
        spec = importlib.util.find_spec(new) if new else None
        if new is None or spec is None or not isinstance(spec.loader, importlib.abc.InspectLoader):
            raise ImportError(f"no module named {fullname!r}")
        warn(fullname, new)
        return spec.loader.get_code(new)
