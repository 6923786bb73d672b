"""The one plugin loader: the names that configs and commands use for environments, agents and adapters.

The three kinds resolve names the same way (:func:`load_plugin`): what ships with gym-runtime by
its bare name (``weather``, ``simple``, ``openai``) or its folder path (``resources.weather``,
``agents.simple``, ``models.openai``), both resolving to ``gym_runtime.<folder>.<name>``; any other
importable module path (a user's own package) as written. A command's CONFIG may also be a
bundled environment's name (``weather``): its ``config.yaml`` in the installed package.

A module named by a config that is *not* importable as written is looked up
relative to the config, so an environment made by ``gym-runtime init`` runs from
anywhere without ``PYTHONPATH`` or an install (``use_config_dir``, called by
``load_config``). For ``server: NAME`` (or ``NAME.sub``) in ``DIR/config.yaml``:

1. ``DIR/NAME.py`` or ``DIR/NAME/``: a module beside the config → ``DIR`` joins ``sys.path``;
2. ``DIR``'s parent holds ``NAME/`` (the config sits inside its own package, as the
   scaffold writes it) → that parent joins ``sys.path``.

An installed module of the same name always wins (nothing is added then), and
directories are appended to ``sys.path``, never put in front of it.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.resources
import importlib.util
import pkgutil
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from gym_runtime.errors import UserError, nearest

BUNDLED_PREFIXES = ("resources.", "agents.", "models.")

# Each kind of plugin and the folder its bundled modules ship in.
FOLDERS = {"resource": "resources", "agent": "agents", "adapter": "models"}


def _candidates(path: str, kind: str | None = None) -> list[str]:
    if path.startswith(BUNDLED_PREFIXES):
        return [f"gym_runtime.{path}", path]
    if kind is not None and "." not in path:  # a bundled one by its bare name, else a top-level module
        return [f"gym_runtime.{FOLDERS[kind]}.{path}", path]
    return [path]


def bundled(kind: str) -> list[str]:
    """The bare names of the bundled plugins of one kind (``weather``, ``simple``, ``openai``, ...)."""
    root = importlib.resources.files(f"gym_runtime.{FOLDERS[kind]}")
    found = []
    for p in root.iterdir():
        module = p if p.name.endswith(".py") else p / "__init__.py"
        if p.name.startswith("_") or not module.is_file():
            continue
        if kind == "adapter" and not re.search(r"^(def create\(|create = )", module.read_text(), re.M):
            continue  # a helper module the adapters share, not an adapter
        found.append(p.name.removesuffix(".py"))
    return sorted(found)


def load_plugin(kind: str, name: str, where: str = "", *, hint: str = "") -> ModuleType:
    """The module ``name`` names as a ``kind`` ("resource", "agent" or "adapter"), by one rule for all three.

    A module that does not exist is a ``UserError`` that starts with ``where`` (the config key) and
    names the nearest bundled plugin; an import error raised *inside* an existing module (a missing
    optional package) says so, with the module's own words and ``hint`` (what to install).
    """
    at = f"{where}: " if where else ""
    try:
        return import_plugin(name, kind)
    except ModuleNotFoundError as e:
        if e.name == name:  # no such module, under any of the names tried
            names = bundled(kind)
            bare = name.removeprefix(f"{FOLDERS[kind]}.")
            near = difflib.get_close_matches(bare, names, n=1, cutoff=0.75)
            near_hint = f"; did you mean {near[0]!r}?" if near else f" (bundled: {', '.join(names)}; or a module path)"
            sibling = None if near else _sibling(name)
            if sibling:  # a typo in the last part of the user's own module path: its package is there
                near_hint = f"; did you mean {sibling!r}?"
            raise UserError(f"{at}no such {kind} module {name!r}{near_hint}") from None
        raise UserError(_import_failed(at, name, e, hint)) from None
    except ImportError as e:
        raise UserError(_import_failed(at, name, e, hint)) from None
    except SyntaxError as e:  # (IndentationError and TabError too): the user's file, not ours
        where_in = f"{e.filename}:{e.lineno}: " if e.filename else ""
        raise UserError(
            f"{at}{where_in}{type(e).__name__}: {e.msg} in the {kind} module {name!r}: fix the code there"
        ) from None
    except Exception as e:  # raised by the module's own code as it was imported
        raise UserError(
            f"{at}{_raised_at(e)}{type(e).__name__}: {e} (raised while importing the {kind} module {name!r}): "
            "fix the code there"
        ) from None


_OURS = Path(__file__).resolve().parent  # gym_runtime's own package folder


def _raised_at(e: BaseException) -> str:
    """``FILE:LINE: `` of the deepest frame of ``e``'s traceback that is a file (not the import machinery)."""
    found = ""
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith("<"):
            found = f"{code.co_filename}:{tb.tb_lineno}: "
        tb = tb.tb_next
    return found


def _import_failed(at: str, name: str, e: ImportError, hint: str) -> str:
    """An import that failed inside an existing module: where, in whose code, and what to do. ``hint`` (the
    extra to install) is for gym-runtime's own modules; a user's module is told to install or fix the import."""
    here = _raised_at(e)
    if not here or Path(here.rsplit(":", 2)[0]).resolve().is_relative_to(_OURS):
        return f"{at}cannot import {name!r}: {e}{hint}"
    missing = f"install {e.name!r}, or " if isinstance(e, ModuleNotFoundError) and e.name else ""
    return f"{at}{here}cannot import {name!r}: {e}: {missing}fix that import"


def _sibling(name: str) -> str | None:
    """For ``pkg.modul`` whose package ``pkg`` imports: the module of ``pkg`` nearest ``modul``
    (``my_agents.run_code`` for ``my_agents.run_cod``), if any."""
    parent, _, leaf = name.rpartition(".")
    if not parent:
        return None
    try:
        package = importlib.import_module(parent)
    except Exception:  # noqa: BLE001 - no such package (or a broken one): nothing to suggest from it
        return None
    where = getattr(package, "__path__", None)
    if where is None:
        return None
    near = nearest(leaf, [m.name for m in pkgutil.iter_modules(where)])
    return f"{parent}.{near}" if near else None


def import_plugin(path: str, kind: str | None = None) -> ModuleType:
    """Import the module a config names: the bundled one for a short name, else ``path`` itself.

    Raises ``ImportError`` naming ``path`` when neither exists; an import error
    raised *inside* an existing module (a missing optional dependency) is kept as is.
    """
    last: ImportError | None = None
    for name in _candidates(path, kind):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Only "this very module does not exist" moves on to the next candidate.
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                last = e
                continue
            raise
    raise ModuleNotFoundError(f"no module named {path!r}", name=path) from last


_NOT_CODE = frozenset({"__pycache__", "tests"})


def tree_hash(root: Path) -> str:
    """A short content hash of the Python code at ``root``: the file itself, or every ``*.py`` file under the
    package folder (paths and bytes, sorted; ``__pycache__``, ``tests`` and data files left out: only the code
    that runs counts)."""
    h = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*.py") if not _NOT_CODE & set(p.parts))
    for p in files:
        h.update(p.relative_to(root.parent if root.is_file() else root).as_posix().encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:12]


def code_identity(module: ModuleType) -> str:
    """A plugin's code identity (rows' ``provenance.env``): the content hash of its module tree, the package's
    folder when the module is a package or sits in one of ours (``resources.weather.tools``), else its file."""
    origin = getattr(module, "__file__", None)
    if origin is None:  # a namespace package or a module made at run time: its name is all there is
        return hashlib.sha256(module.__name__.encode()).hexdigest()[:12]
    path = Path(origin)
    return tree_hash(path.parent if path.name == "__init__.py" else path)


def bundled_environments() -> list[str]:
    """Names of the environments that ship with gym-runtime (each with its ``config.yaml``)."""
    root = importlib.resources.files("gym_runtime.resources")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "config.yaml").is_file())


def config_path(arg: str) -> Path:
    """What a command's CONFIG argument names: a file as given, else a bundled environment's
    ``config.yaml`` by NAME (``gym-runtime run weather``), so configs run without a repository."""
    path = Path(arg)
    names = ", ".join(bundled_environments())
    if not re.fullmatch(r"[A-Za-z0-9_]+", arg):
        if path.exists() or path.suffix not in (".yaml", ".yml"):  # another kind of file: its reader says why
            return path
        raise UserError(
            f"{arg}: config file not found; give a config YAML's path, or a bundled environment's name ({names})"
        )
    if path.exists():
        return path
    bundled = importlib.resources.files("gym_runtime.resources") / arg / "config.yaml"
    if bundled.is_file():
        return shown_path(Path(str(bundled)))
    near = difflib.get_close_matches(arg, bundled_environments(), n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise UserError(f"{arg}: no such config file, nor a bundled environment ({hint}bundled: {names})")


def shown_path(path: Path) -> Path:
    """A bundled file's path as its messages name it: the file itself (an editable install's copy under
    ``build/__editable__…`` is a link to it), relative to the working directory when it lies below it
    (``resources/weather/config.yaml`` in a clone)."""
    real = path.resolve()
    try:
        return real.relative_to(Path.cwd())
    except ValueError:
        return real


def example_input(config: Path) -> Path | None:
    """A bundled environment's example tasks (``data/example.jsonl`` beside its config), if any."""
    path = config.parent / "data" / "example.jsonl"
    return path if path.is_file() else None


def config_root(name: str, base_dir: str | Path) -> Path | None:
    """The directory that makes ``name`` importable relative to a config in ``base_dir``, if any."""
    top = name.split(".")[0]
    if not top.isidentifier():
        return None
    base = Path(base_dir).resolve()
    for root in (base, base.parent):
        if (root / top / "__init__.py").is_file() or (root / f"{top}.py").is_file():
            return root
    return None


def use_config_dir(names: Iterable[str], base_dir: str | Path) -> None:
    """Make modules a config names relative to its directory importable (see the module docstring)."""
    for name in names:
        if not isinstance(name, str) or name.startswith(BUNDLED_PREFIXES):
            continue
        try:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                continue  # installed (or already on the path): it wins
        except (ImportError, ValueError):
            continue
        root = config_root(name, base_dir)
        if root is not None and str(root) not in sys.path:
            sys.path.append(str(root))
            importlib.invalidate_caches()
