"""The package's shape: layers that run one way, no hidden imports, a light ``messages``, one error tree.

These are what keep the tree readable after this round: the import-linter contracts
(``.importlinter``), no ``gym_runtime`` import hidden inside a function outside the CLI,
a lazy package ``__init__`` (PEP 562), and one mapping of folders to ``gym_runtime`` that every
tool reads (pyproject.toml's ``[tool.setuptools.package-dir]``, through the editable install).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grimp
import pytest

import gym_runtime
from gym_runtime import errors, jail, moved
from gym_runtime.cli.scaffold import ScaffoldError
from gym_runtime.config.nemo_gym import NemoConfigError
from gym_runtime.data.prepare import InvalidRows
from gym_runtime.data.sources import PrepareError
from gym_runtime.ops.nats_server import ServerError
from gym_runtime.transport.connect import ServerUnreachable
from gym_runtime.transport.jetstream import JetStreamSetupError
from gym_runtime.transport.rpc import NoResponders
from tests.bench.import_graph import circles
from tests.helpers import REPO

# The one declaration of which folder imports as what: gym_runtime <- runtime/, gym_runtime.agents <- agents/, ...
PACKAGE_DIR: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = [REPO / folder for folder in PACKAGE_DIR.values()]


def test_the_editable_install_is_the_tree_the_declaration_makes() -> None:
    """``pip install -e .`` links every module of every declared folder into one ``gym_runtime/`` tree (strict
    mode, set in pyproject.toml): the tree import-linter and mypy read, as they read no import hook. A module
    added since the install (or an install made with setuptools' default import hook) would leave them blind to
    it, so ``.ci/checks`` runs this first."""
    unseen = []
    for pkg, folder in PACKAGE_DIR.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            if "tests" in rel.parts:  # not in the package (setup.py)
                continue
            parts = [*pkg.split("."), *rel.parts]
            name = ".".join(parts).removesuffix(".__init__")
            spec = importlib.util.find_spec(name)
            where = Path(spec.origin) if spec is not None and spec.origin else None
            # in the tree: .../gym_runtime/agents/swe.py, a link to agents/swe.py
            if where is None or where.parts[-len(parts) :] != (*parts[:-1], parts[-1] + ".py"):
                unseen.append(f"{name} ({path.relative_to(REPO)})")
            elif where.resolve() != path.resolve():
                unseen.append(f"{name} (from {where}, not {path.relative_to(REPO)})")
    tree = Path(gym_runtime.__file__).parent
    dangling = [str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_symlink() and not p.exists()]
    assert unseen == [] and dangling == [], (
        f"the editable install is not the tree pyproject.toml declares; run `pip install -e .` "
        f"(not linked: {unseen[:5]}{' ...' if len(unseen) > 5 else ''}; removed since: {dangling[:5]})"
    )


def test_the_import_linter_contracts_hold() -> None:
    """Layers (cli > client/gateway > ops > service > workers > data > author APIs > transport > ...), "only the
    transport imports nats", and the plugins (agents, models, resources): they use the author APIs, the runtime
    imports none of them, and they use each other only where ``.importlinter`` declares it; the config's three
    jobs (``resolved`` over ``loading`` and ``fingerprints``, over ``schema``) run one way too."""
    res = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert res.stdout.count("KEPT") == 6, res.stdout[-2000:]


def test_no_modules_import_each_other_round_a_circle() -> None:
    """No circle in the import graph, ``if TYPE_CHECKING:`` imports and a package's own ``__init__`` included
    (``config/__init__.py`` and ``config.fingerprints`` were one): a reader can start at any module and follow
    its imports without coming back to it. ``tests/bench/import_graph.py`` prints the graph's circles and
    arrows running back up."""
    graph = grimp.build_graph("gym_runtime")
    assert circles(graph, {m for m in graph.modules if m.startswith("gym_runtime")}) == []


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A file's tree, parsed once for every test here that reads it."""
    return ast.parse(path.read_text())


def _hidden_imports(path: Path) -> list[str]:
    found = []
    for fn in ast.walk(_parsed(path)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and ((node.module or "").startswith("gym_runtime") or node.level):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {fn.name}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("gym_runtime") for a in node.names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {fn.name}")
    return found


def _functions(body: list[ast.stmt]) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions defined in ``body``, nested ones included (statements only: an expression holds none)."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield stmt
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list):
                yield from _functions(inner)


LONG_FUNCTION = 100  # lines, ``def`` to its last line (issue 64 item 7: 110; issue 74 item 8: 100)


def test_no_function_is_100_lines_or_longer() -> None:
    """A function a reader takes in at once: none of ``LONG_FUNCTION`` lines or more (a nested function or class
    counts in the one around it) in the runtime, the agents, the adapters and the environments, their tests
    included; a longer one is cut into named steps (``AgentWorker._run_task`` 120 -> 40 lines)."""
    functions = [
        (f"{path.relative_to(REPO)}:{fn.lineno} {fn.name}", (fn.end_lineno or fn.lineno) - fn.lineno + 1)
        for folder in FOLDERS
        for path in sorted(folder.rglob("*.py"))
        for fn in _functions(_parsed(path).body)
    ]
    assert [f"{where} ({lines} lines)" for where, lines in functions if lines >= LONG_FUNCTION] == []


def test_no_gym_runtime_import_hides_inside_a_function_outside_the_cli() -> None:
    """A dependency the layering should show is never tucked into a function to dodge a cycle: in the
    runtime, the agents, the adapters and the environments (their tests included).

    The CLI's commands import what they run when they run (``gym-runtime --help`` stays fast);
    everything else imports at the top of the module.
    """
    hidden = [
        h
        for folder in FOLDERS
        for p in sorted(folder.rglob("*.py"))
        if p.relative_to(REPO).parts[:2] != ("runtime", "cli")
        for h in _hidden_imports(p)
    ]
    assert hidden == []


def test_workers_take_hosting_from_the_resolved_config() -> None:
    """The workers import nothing from ``gym_runtime.nemo_gym.hosting``: a hosted entry's code comes with the
    ``ResolvedConfig`` (loaded by name, as plugins are). The one exception is the guest process's entry
    (``guest_main``), which runs a hosted server's code itself, in its built environment."""
    importers = []
    for path in sorted((REPO / "runtime" / "workers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            modules += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(m.startswith("gym_runtime.nemo_gym.hosting") for m in modules):
                importers.append(path.name)
    assert sorted(set(importers)) == ["guest_main.py"]


@pytest.mark.parametrize("module", ["gym_runtime.messages", "gym_runtime.resource"])
def test_importing_messages_loads_no_transport_telemetry_or_http(module: str) -> None:
    """Nor the environment author's API: its sandboxes (``Resource.sandbox``) are typed there, the client
    that reaches the fleet is set by the worker."""
    code = (
        f"import sys, {module}\n"
        "heavy = [m for m in ('nats', 'aiohttp', 'opentelemetry', 'openai') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert res.stdout.strip() == "[]"


def test_the_commands_event_loop_loads_no_worker() -> None:
    """``run_async`` (every command, and ``ops``) comes from the batch service without importing a worker."""
    code = (
        "import sys, gym_runtime.service.loop\n"
        "print([m for m in sys.modules if m.startswith(('gym_runtime.workers', 'gym_runtime.transport', 'nats'))])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert res.stdout.strip() == "[]"


def test_every_public_name_resolves_and_is_listed() -> None:
    for name in gym_runtime.__all__:
        assert getattr(gym_runtime, name) is not None, name
    assert set(dir(gym_runtime)) >= set(gym_runtime.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = gym_runtime.nope  # type: ignore[attr-defined]  # the test asks for a name that is not there


def test_one_error_tree() -> None:
    """``GymError`` at the root; user mistakes (exit 2) one branch, typed failures another."""
    user = [
        errors.ConfigError,
        NemoConfigError,
        errors.InputError,
        errors.AuthError,
        PrepareError,
        InvalidRows,
        ScaffoldError,
        ServerError,
        ServerUnreachable,
        JetStreamSetupError,
    ]
    for cls in user:
        assert issubclass(cls, errors.UserError), cls
    assert issubclass(NoResponders, errors.Failure)
    for cls in (errors.Failure, errors.UserError, errors.ModelError, errors.ClientError, errors.RolloutFailed):
        assert issubclass(cls, errors.GymError), cls
    assert not issubclass(errors.Failure, errors.UserError)
    # the error classes users import are the ones the package exports
    assert gym_runtime.Failure is errors.Failure and gym_runtime.ConfigError is errors.ConfigError


def test_a_bug_that_raises_valueerror_is_an_internal_error_not_a_user_mistake() -> None:
    """Exit 2 is for the user's mistakes only: a stray ValueError is reported as a bug (exit 3)."""
    code = (
        "import sys\n"
        "from gym_runtime import cli\n"
        "from gym_runtime.cli import validate\n"
        "def boom(args):\n"
        "    raise ValueError('a bug')\n"
        "validate.main = boom\n"
        "sys.exit(cli.main(['validate', 'weather', '-i', 'x.jsonl']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stderr
    assert "internal error" in res.stderr and "ValueError: a bug" in res.stderr


def _old(path: str) -> Any:
    """What an old path (``module`` or ``module:name``) gives, its deprecation warning expected (or given before,
    in this process: each warns once)."""
    module, _, name = path.partition(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        found = importlib.import_module(module)
        return getattr(found, name) if name else found


def test_the_jails_old_path_still_serves_plugins() -> None:
    """``gym_runtime.sandbox`` was the graded-program jail's package (beside ``gym_runtime.sandboxes``, the
    container fleet); an environment that imports its names from there gets the jail's own."""
    old = _old("gym_runtime.sandbox")
    assert set(jail.__all__) <= set(old.__all__)
    assert all(getattr(old, name) is getattr(jail, name) for name in jail.__all__)


def test_the_jails_classes_keep_their_old_names_in_the_old_path() -> None:
    """The jail's classes are ``Jail*`` since issue 64; a plugin written against ``SandboxRunner``,
    ``SandboxError``, ... (and ``except SandboxError``) gets the same classes from ``gym_runtime.sandbox``."""
    classes = {**{name: getattr(jail, name) for name in jail.__all__}, "JailCgroup": jail.cgroups.JailCgroup}
    jails = [name for name in classes if name.startswith("Jail")]
    assert len(jails) == 7  # Runner, Session, Error, Exited, Timeout, BodyTooLarge, Cgroup
    assert all(_old("gym_runtime.sandbox:Sandbox" + name.removeprefix("Jail")) is classes[name] for name in jails)
    assert {"Sandbox" + name.removeprefix("Jail") for name in jails} <= set(_old("gym_runtime.sandbox").__all__)
    assert not [n for n in jail.__all__ if n.startswith("Sandbox")]


# Each old path a config, plugin or trainer may still name -> its new path (docs/changelog.md lists them)
OLD_PATHS = {
    **{f"gym_runtime.hosting.{m}": f"gym_runtime.nemo_gym.hosting.{m}" for m in ("agent", "asgi", "env", "host")},
    **{f"gym_runtime.hosting.{m}": f"gym_runtime.nemo_gym.hosting.{m}" for m in ("middleware", "resource")},
    "gym_runtime.hosting.server_client": "gym_runtime.nemo_gym.hosting.server_client",
    "gym_runtime.hosting.catalogue": "gym_runtime.nemo_gym.catalogue",
    "gym_runtime.hosting.parity": "gym_runtime.nemo_gym.parity",
    "gym_runtime.hosting.harbor": "gym_runtime.harbor.hosting",
    "gym_runtime.sync_client:SyncClient": "gym_runtime.client.sync:SyncClient",
    "gym_runtime.sandbox:JailRunner": "gym_runtime.jail:JailRunner",
    **{f"gym_runtime.sandbox:Sandbox{c}": f"gym_runtime.jail:Jail{c}" for c in ("Runner", "Session", "Error")},
    **{f"gym_runtime.sandbox:Sandbox{c}": f"gym_runtime.jail:Jail{c}" for c in ("Exited", "Timeout", "BodyTooLarge")},
    "gym_runtime.sandbox:SandboxCgroup": "gym_runtime.jail.cgroups:JailCgroup",
    "gym_runtime.trainers.tiny_policy": "gym_runtime.rigs.tiny_policy",
    "gym_runtime.trainers.trl_cpu": "gym_runtime.rigs.trl_cpu",
    "gym_runtime.checkpoint:Checkpointer": "gym_runtime.rollout.checkpoint:Checkpointer",
}


def test_moved_modules_keep_their_documented_import_paths() -> None:
    """Issue 64 gave NeMo Gym, Harbor and the trainer's client one home each; the paths plugins, configs and
    trainers wrote before still reach the same objects (docs/changelog.md lists them)."""

    def at(path: str) -> object:
        module, _, name = path.partition(":")
        return getattr(importlib.import_module(module), name) if name else importlib.import_module(module)

    current = {
        "gym_runtime.harbor:find_tasks": "gym_runtime.harbor.tasks:find_tasks",
        "gym_runtime.harbor:parse_rewards": "gym_runtime.harbor.tasks:parse_rewards",
        "gym_runtime:SyncClient": "gym_runtime.client.sync:SyncClient",
        "gym_runtime.client:BatchHandle": "gym_runtime.client.batch:BatchHandle",
    }
    assert [old for old, new in current.items() if at(old) is not at(new)] == []
    assert [old for old, new in OLD_PATHS.items() if _old(old) is not at(new)] == []


# In a fresh interpreter (each path warns once per process): every old path, used twice, says one
# DeprecationWarning naming its new path and the release that removes it; `python -m` of an old module path too.
_WARNS_ONCE = """
import importlib, json, sys, warnings
said = {}
for old in json.loads(sys.argv[1]):
    module, _, name = old.partition(":")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            found = importlib.import_module(module)
            if name:
                getattr(found, name)
    said[old] = [str(w.message) for w in caught if w.category is DeprecationWarning]
print(json.dumps(said))
"""


def test_each_old_path_warns_once_naming_its_new_path_and_its_end() -> None:
    """Issue 74: the kept paths have an end. A path's first use warns (``DeprecationWarning``, its new path and
    ``moved.REMOVED_IN`` named); its second is silent; ``python -m gym_runtime.hosting.harbor`` still runs."""
    olds = [o for o in OLD_PATHS if not o.startswith("gym_runtime.sandbox:Sandbox")]
    names = [o for o in OLD_PATHS if o.startswith("gym_runtime.sandbox:Sandbox")]
    res = subprocess.run(
        [sys.executable, "-c", _WARNS_ONCE, json.dumps(olds)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    said = json.loads(res.stdout)
    wrong = {}
    for old in olds:
        module = old.partition(":")[0]
        new = OLD_PATHS[old].partition(":")[0]
        if len(said[old]) != 1 or not (
            module in said[old][0] and new in said[old][0] and moved.REMOVED_IN in said[old][0]
        ):
            wrong[old] = said[old]
    # the old class names: after the module's own warning (above), each name warns once more, naming its new name
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", "import gym_runtime.sandbox\n" + _WARNS_ONCE, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    for old, messages in json.loads(res.stdout).items():
        new = OLD_PATHS[old].replace(":", ".")
        if len(messages) != 1 or not (new in messages[0] and moved.REMOVED_IN in messages[0]):
            wrong[old] = messages
    assert wrong == {}
    run = subprocess.run(
        [sys.executable, "-W", "always", "-m", "gym_runtime.hosting.harbor", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr
    assert "DeprecationWarning: gym_runtime.hosting.harbor is deprecated: use gym_runtime.harbor.hosting" in run.stderr
