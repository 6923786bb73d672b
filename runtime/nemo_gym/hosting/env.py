"""The environment a hosted NeMo Gym resources server runs in: built once, cached by content hash.

NeMo Gym builds one venv per server (``uv venv`` + its ``requirements.txt``, whose
first line installs the Gym repository itself). Here the environments are layered so
that 80 servers do not mean 80 copies of ray:

* **base** (``base-<hash>``): a venv on a Python >= 3.13 interpreter with nemo-gym
  (pinned version) and gym-runtime's own dependencies. Shared by every server. Key:
  the interpreter's version and path, the nemo-gym version, our dependency list.
* **server layer** (``env-<hash>``): a pip-less venv on the same interpreter whose
  ``site-packages`` adds the base's (a ``.pth`` line), holding only what the server
  needs beyond the base (requirements the base does not satisfy) and gym-runtime itself
  (editable, from this repository). Key: the base key, those extra requirements and the
  repository path, so servers whose requirements the base satisfies share one layer, and
  two servers with conflicting pins get separate layers.

A build is resumable (each step leaves a marker; an interrupted build continues where it
stopped), locked against concurrent builders, and logged (``build.log`` in the layer,
progress lines on stderr). Requirements that cannot be installed here (git sources,
options pip cannot take from a requirements file) are an ``EnvError``: one line naming them.

Everything here is standard library: the publisher side never needs the hosted packages.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gym_runtime.errors import UserError
from gym_runtime.observability.progress import STILL_EVERY_S, Heartbeat

NEMO_GYM_VERSION = "0.7.0"
MIN_PYTHON = (3, 13)
PYTHON_ENV = "GYM_NEMO_PYTHON"  # the interpreter to build on (else one is searched for)
CACHE_ENV = "GYM_ENV_CACHE"  # where environments are kept (default ~/.cache/gym-runtime/envs)
VERSION_ENV = "GYM_NEMO_GYM_VERSION"  # the nemo-gym version to install (default NEMO_GYM_VERSION)
HOSTED_ENV = "GYM_NEMO_ENV"  # set for a hosted worker child: the layer it runs in
VERIFIERS_VERSION = "0.4.0"  # the verifiers release of agents.verifiers_v1's layer (Taskset x Harness)
VERIFIERS_MIN_PYTHON = (3, 12)  # its layer's interpreter: any verifiers 0.4 runs on (>= 3.11) but not ours
VERIFIERS_PYTHON_ENV = "GYM_VERIFIERS_PYTHON"  # the interpreter to build the verifiers layer on
VERIFIERS_ENV = "GYM_VERIFIERS_ENV"  # set for a guest on the verifiers layer: the layer it runs in
_NEMO_LINE = re.compile(r"^-e\s+nemo-gym(\[[^\]]*\])?\s*@\s*\S+$|^nemo-gym(\[[^\]]*\])?\s*@\s*(\.\./|file:)")
_GIT = re.compile(r"git\+|\.git(@|$)|@\s*git")

Log = Callable[[str], None]


class EnvError(UserError):
    """An environment that cannot be built here; the message is one line naming what is missing."""


@dataclass(frozen=True)
class HostedEnv:
    """A built environment: its interpreter, the server's directory, the layers and their size."""

    server: str
    python: str  # the server layer's interpreter
    prefix: str  # the server layer (sys.prefix of a worker running in it)
    base: str
    server_dir: str
    extras: tuple[str, ...]  # requirements installed in the server layer beyond the base
    built_s: float  # time spent building now (0.0: everything was cached)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gym-runtime" / "envs")


def nemo_gym_version() -> str:
    return os.environ.get(VERSION_ENV) or NEMO_GYM_VERSION


def repo_root() -> Path:
    """This gym-runtime's source tree (the editable install's target); hosting needs one."""
    here = Path(__file__).resolve().parents[3]
    if not (here / "pyproject.toml").is_file() or not (here / "runtime").is_dir():
        raise EnvError(f"hosting NeMo Gym servers needs gym-runtime installed from its source tree; {here} is not one")
    return here


def runtime_dependencies(repo: Path) -> list[str]:
    """gym-runtime's core dependencies, as its pyproject.toml names them (the base installs these)."""
    data = tomllib.loads((repo / "pyproject.toml").read_text())
    return list(data["project"]["dependencies"])


def entry_points(repo: Path) -> dict[str, object]:
    """gym-runtime's entry points (NeMo Gym's sandbox provider among them): a layer built before one was added
    lacks it, so they are part of the layer's key."""
    return dict(tomllib.loads((repo / "pyproject.toml").read_text())["project"].get("entry-points", {}))


def _python_version(python: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return tuple(int(x) for x in out.split())


def find_python(
    configured: str | None = None,
    *,
    minimum: tuple[int, int] = MIN_PYTHON,
    what: str = "nemo-gym",
    var: str = PYTHON_ENV,
) -> str:
    """A Python >= ``minimum`` (3.13 for nemo-gym): ``configured`` / ``$var``, else one on PATH or under pyenv."""
    need = ".".join(map(str, minimum))
    want = configured or os.environ.get(var)
    if want:
        version = _python_version(want)
        if version is None:
            raise EnvError(f"{want}: not a Python interpreter (from --python or ${var})")
        if version < minimum:
            raise EnvError(f"{want} is Python {'.'.join(map(str, version))}; {what} needs Python >= {need}")
        return str(Path(want).absolute())
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    # not pyenv's shims: each run of one is ~70 bash processes (0.2 s of CPU), and one for a version pyenv
    # has but does not select fails; the versions it has are looked at directly below
    found = (shutil.which(f"python3.{minor}") for minor in range(20, minimum[1] - 1, -1))
    candidates = [c for c in found if c and Path(c).parent != root / "shims"]
    if (root / "versions").is_dir():
        candidates += [str(p / "bin" / "python") for p in sorted((root / "versions").iterdir(), reverse=True)]
    for c in candidates:
        if c and Path(c).is_file() and (v := _python_version(c)) is not None and v >= minimum:
            return c
    raise EnvError(f"no Python >= {need} found for {what} (it needs one); set ${var} or --python")


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per layer at a time (another process waits, then finds the layer built)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _site_packages(prefix: Path) -> Path:
    found = sorted((prefix / "lib").glob("python3.*/site-packages"))
    if not found:
        raise EnvError(f"{prefix}: no site-packages (a broken environment; delete it to rebuild)")
    return found[0]


def _pip(python: Path, args: list[str], log_path: Path, log: Log, label: str) -> None:
    """Run pip, its output in ``log_path``; a progress line every few packages; one-line error on failure."""
    cmd = [str(python), "-m", "pip", "install", "--progress-bar", "off", *args]
    collected = 0
    with open(log_path, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        last = ""
        for line in proc.stdout:
            out.write(line)
            if line.startswith("Collecting "):
                collected += 1
                if collected % 20 == 0:
                    log(f"{label}: {collected} packages resolved ...")
            elif line.startswith("Installing collected packages"):
                log(f"{label}: installing {collected} packages ...")
            if line.strip() and not line.startswith("WARNING: Location"):
                last = line.strip()
        code = proc.wait()
    if code != 0:
        raise EnvError(f"{label}: pip install failed ({last[:200]}); see {log_path}")


def _once(prefix: Path, name: str, step: Callable[[], object]) -> None:
    """A resumable build step: ``step`` runs unless its marker says an interrupted build already did it."""
    marker = prefix / f".step-{name}"
    if not marker.is_file():
        step()
        marker.touch()


def _venv(python: str | Path, prefix: Path, *flags: str) -> None:
    subprocess.run([str(python), "-m", "venv", *flags, str(prefix)], check=True, capture_output=True)


def _install_runtime(prefix: Path, repo: Path, log: Log) -> None:
    """gym-runtime from ``repo``, editable through an import hook (lenient), not the link tree under the checkout's
    build/ that the checkout's own editable install uses: rebuilding that tree here would pull files from under
    running workers."""
    editable = ["--config-settings", "editable_mode=lenient", "-e", str(repo)]
    _pip(prefix / "bin" / "python", ["--no-deps", *editable], prefix / "build.log", log, "gym-runtime")


def _build_layer(
    prefix: Path, what: str, detail: str, fill: Callable[[], None], record: Mapping[str, object], log: Log
) -> tuple[Path, float]:
    """The layer at ``prefix`` (its name the hash of what goes in it), built by ``fill()`` unless a complete
    one is there: one builder at a time, resumable, logged. Returns (path, build s; 0.0 when it was cached)."""
    if (prefix / ".complete").is_file():
        return prefix, 0.0
    t0 = time.monotonic()
    with _locked(prefix):
        if (prefix / ".complete").is_file():
            return prefix, 0.0
        log(f"env: building the {what} layer {prefix.name} ({detail})")
        # its steps (pip's install, uv's sync) print nothing for minutes: said every STILL_EVERY_S meanwhile
        still = f"env: still building the {what} layer (its log: {prefix / 'build.log'})"
        with Heartbeat(log, still, after_s=STILL_EVERY_S):
            fill()
        (prefix / ".complete").write_text(json.dumps(record))
    took = time.monotonic() - t0
    log(f"env: {what} layer built in {took:.0f}s ({disk_mb(prefix):.1f} MB)")
    return prefix, took


def build_base(python: str, version: str, repo: Path, log: Log) -> tuple[Path, float]:
    """The shared layer: nemo-gym and gym-runtime's dependencies (no gym-runtime code). Returns (path, build s)."""
    deps = sorted(runtime_dependencies(repo))
    prefix = cache_dir() / f"base-{_key(_python_version(python), os.path.realpath(python), version, deps)}"

    def fill() -> None:
        _once(prefix, "venv", lambda: _venv(python, prefix))
        # nemo-gym's metadata asks for Python >= 3.13.14; the 3.13 line runs it (measured)
        pins = ["--ignore-requires-python", f"nemo-gym=={version}", *deps]
        _once(prefix, "packages", lambda: _pip(prefix / "bin" / "python", pins, prefix / "build.log", log, "base"))

    detail = f"nemo-gym=={version} + gym-runtime's dependencies"
    return _build_layer(prefix, "base", detail, fill, {"nemo_gym": version, "python": python, "deps": deps}, log)


ServerKind = Literal["resources_servers", "responses_api_agents"]


def servers_root(base: Path, kind: ServerKind = "resources_servers") -> Path:
    """The installed catalogue: nemo-gym's ``resources_servers`` (or ``responses_api_agents``) directory."""
    root = _site_packages(base) / kind
    if not root.is_dir():
        raise EnvError(f"{base}: nemo-gym ships no {kind} directory")
    return root


def check_server(server: str, kind: ServerKind = "resources_servers") -> Path | None:
    """What can be said of ``server`` before anything is built: a server directory of a NeMo Gym checkout
    (its path), else a catalogue name (None: the catalogue, in the base layer, says whether it has it)."""
    what = "resources server" if kind == "resources_servers" else "agent server"
    path = Path(server)
    if path.is_dir() and (path / "app.py").is_file():
        return path.resolve()
    if not re.fullmatch(r"[A-Za-z0-9_]+", server):
        raise EnvError(f"{server}: not a NeMo Gym {what} (no app.py there)")
    return None


def server_dir(base: Path, server: str, kind: ServerKind = "resources_servers") -> Path:
    """A catalogue name (``mcqa``, ``simple_agent``) or a path to a server directory of a NeMo Gym checkout."""
    what = "resources server" if kind == "resources_servers" else "agent server"
    path = check_server(server, kind)
    if path is not None:
        return path
    root = servers_root(base, kind)
    found = root / server
    if not (found / "app.py").is_file():
        names = sorted(p.name for p in root.iterdir() if (p / "app.py").is_file()) if root.is_dir() else []
        near = difflib.get_close_matches(server, names, n=3)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise EnvError(
            f"{server}: no such {what} in nemo-gym {nemo_gym_version()} ({hint}{len(names)} there, e.g. "
            f"{', '.join(names[:5])}; or give the path of a server directory with its app.py)"
        )
    return found


def requirements(sdir: Path) -> list[str]:
    """The server's requirements beyond nemo-gym itself; ``EnvError`` for ones that cannot be installed here."""
    lines: list[str] = []
    req = sdir / "requirements.txt"
    if req.is_file():
        lines = [ln.split(" #")[0].strip() for ln in req.read_text().splitlines()]
    elif (sdir / "pyproject.toml").is_file():
        project = tomllib.loads((sdir / "pyproject.toml").read_text())
        lines = list(project.get("project", {}).get("dependencies", []))
        sources = project.get("tool", {}).get("uv", {}).get("sources", {})
        for name, src in sources.items():
            if isinstance(src, dict) and "git" in src:
                raise EnvError(f"{sdir.name}: needs {name} from git ({src['git']}), which cannot be installed here")
    out: list[str] = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        if _NEMO_LINE.match(line) or re.match(r"^nemo-gym(\[[^\]]*\])?$|^-e\s+(\.\./)+\.?\.?/?$", line):
            continue  # NeMo Gym installs its own repository here; the base has the installed version
        if _GIT.search(line):
            raise EnvError(f"{sdir.name}: needs {line!r} (a git source), which cannot be installed here")
        if line.startswith("-"):
            raise EnvError(f"{sdir.name}: requirements.txt line {line!r} cannot be installed here")
        out.append(line)
    return out


_CHECK = """
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
missing = []
for line in json.loads(sys.argv[1]):
    try:
        req = Requirement(line)
    except Exception:
        missing.append(line); continue
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(line); continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        missing.append(line)
print(json.dumps(missing))
"""


def unsatisfied(base: Path, reqs: list[str]) -> list[str]:
    """The requirements the base layer does not satisfy (so the server layer installs them)."""
    if not reqs:
        return []
    out = subprocess.run(
        [str(base / "bin" / "python"), "-c", _CHECK, json.dumps(reqs)], capture_output=True, text=True, check=True
    )
    return sorted(json.loads(out.stdout))


def build_server_layer(base: Path, python: str, extras: list[str], repo: Path, log: Log) -> tuple[Path, float]:
    # the entry points the editable install publishes (its metadata is written once, when the layer is built)
    prefix = cache_dir() / f"env-{_key(base.name, extras, str(repo), entry_points(repo))}"

    def venv() -> None:
        _venv(python, prefix, "--without-pip")
        # the base's packages (pip included) come after this layer's own on sys.path
        base_site = _site_packages(base)
        (_site_packages(prefix) / "_gym_base_layer.pth").write_text(
            f"import site; site.addsitedir({str(base_site)!r})\n"
        )

    def fill() -> None:
        _once(prefix, "venv", venv)
        py = prefix / "bin" / "python"
        if extras:
            pins = ["--ignore-requires-python", *extras]
            _once(prefix, "extras", lambda: _pip(py, pins, prefix / "build.log", log, "server layer"))
        _once(prefix, "runtime", lambda: _install_runtime(prefix, repo, log))

    detail = f"gym-runtime from {repo}" + (f" + {', '.join(extras)}" if extras else "")
    record = {"base": base.name, "extras": extras, "repo": str(repo)}
    return _build_layer(prefix, "server", detail, fill, record, log)


def disk_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total / 1e6


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def ensure(
    server: str, *, python: str | None = None, log: Log = _stderr, kind: ServerKind = "resources_servers"
) -> HostedEnv:
    """The environment of NeMo Gym server ``server`` (a resources server, or an agent server with
    ``kind="responses_api_agents"``), built now if it is not cached. ``EnvError``: one line."""
    check_server(server, kind)  # a mistyped path is said before the base layer is built (minutes)
    repo = repo_root()
    interp = find_python(python)
    version = nemo_gym_version()
    base, t_base = build_base(interp, version, repo, log)
    sdir = server_dir(base, server, kind)
    extras = unsatisfied(base, requirements(sdir))
    layer, t_layer = build_server_layer(base, interp, extras, repo, log)
    return HostedEnv(
        server=server,
        python=str(layer / "bin" / "python"),
        prefix=str(layer),
        base=str(base),
        server_dir=str(sdir),
        extras=tuple(extras),
        built_s=t_base + t_layer,
    )


# ----------------------------------------------------------------------------- verifiers 0.4


# The PEP 723 scripts verifiers 0.4 runs through ``uv sync --script`` for its tool-less and tool-calling chat
# harnesses (null, bash): their dependencies are what a rollout would download; the layer holds them as wheels.
_SCRIPT_DEPS = """
import json, re, tomllib
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
block = re.search(r"^# /// script\\n((?:#.*\\n)*?)# ///$", CHAT_PROGRAM_SOURCE, re.M).group(1)
meta = tomllib.loads("".join(line[2:] if line.startswith("# ") else line[1:] for line in block.splitlines(True)))
print(json.dumps({"dependencies": meta.get("dependencies", []), "source": CHAT_PROGRAM_SOURCE}))
"""


_VF_LAYOUT = 2  # how the layer is laid out (2: its wheelhouse is the index uv resolves from)


@dataclass(frozen=True)
class VerifiersEnv:
    """verifiers' own built environment: its interpreter, the layer, and the variables that keep its rollouts'
    ``uv sync --script`` on the layer's wheels (no index: a rollout never touches the network)."""

    version: str
    python: str
    prefix: str
    environ: dict[str, str]
    built_s: float


def uv_environ(prefix: Path) -> dict[str, str]:
    """What a process of the verifiers layer (and the programs its rollouts start) runs with: the layer's ``uv``
    first on PATH, its index the layer's wheelhouse (a local simple index; uv has no variable for ``--no-index``),
    on the layer's Python, never downloading one."""
    return {
        VERIFIERS_ENV: str(prefix),
        "PATH": f"{prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "UV_DEFAULT_INDEX": (prefix / "wheelhouse" / "simple").as_uri(),  # instead of PyPI: the layer's wheels
        "UV_CACHE_DIR": str(prefix / "uv-cache"),
        "UV_PYTHON": str(prefix / "bin" / "python"),
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_CONFIG": "1",
    }


def _run_logged(cmd: list[str], log_path: Path, label: str, env: dict[str, str] | None = None) -> str:
    """A build step's command, its output in ``log_path``; one-line ``EnvError`` on failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False)
    with open(log_path, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
        raise EnvError(f"{label} failed ({last[0][:200]}); see {log_path}")
    return proc.stdout


def _simple_index(wheels: Path) -> None:
    """A PEP 503 simple index over the wheels in ``wheels`` (``wheels/simple``), with ``file:`` links to them."""
    by_name: dict[str, list[Path]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        by_name.setdefault(re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower(), []).append(wheel)
    root = wheels / "simple"
    for name, files in by_name.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="{w.resolve().as_uri()}">{w.name}</a>\n' for w in files)
        (root / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    names = "".join(f'<a href="{n}/">{n}</a>\n' for n in by_name)
    (root / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{names}</body></html>\n")


# a release as pip pins it (PEP 440's public versions, normalized): what ``verifiers==VERSION`` can name
_RELEASE = re.compile(r"(\d+(?:\.\d+)*)(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?")
_VF_FIRST = (0, 4)  # the first release with the Taskset x Harness API (verifiers.v1) that agents.verifiers_v1 runs


def verifiers_release(version: str) -> str:
    """``version`` if it can be a verifiers release the layer can hold; ``EnvError`` (one line) before anything
    is built otherwise."""
    m = _RELEASE.fullmatch(version)
    if m is None:
        raise EnvError(f"verifiers {version!r}: not a release version (e.g. {VERIFIERS_VERSION})")
    release = tuple(int(x) for x in m.group(1).split("."))
    if release < _VF_FIRST:
        first = ".".join(map(str, _VF_FIRST))
        raise EnvError(f"verifiers {version}: the verifiers layer needs {first} or later (its Taskset x Harness API)")
    return version


def verifiers_prefix(python: str, version: str, repo: Path) -> Path:
    """The layer of verifiers ``version`` on ``python`` (its key: the interpreter, our dependencies, the repo)."""
    deps = sorted(runtime_dependencies(repo))
    parts = (_python_version(python), os.path.realpath(python), version, deps, str(repo), entry_points(repo))
    return cache_dir() / f"vf-{_key('verifiers', _VF_LAYOUT, *parts)}"


def check_on_index(python: str, version: str) -> None:
    """verifiers ``version`` is on the package index for ``python``: pip resolves it alone (a dry run, no
    dependencies), so a release that does not exist is one line naming it and where pip looked, not a
    half-built layer. Whatever pip says of it is kept in the error."""
    cmd = [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", f"verifiers=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return
    out = proc.stdout + proc.stderr
    looked = [
        ln.split(":", 1)[1].strip()
        for ln in out.splitlines()
        if ln.startswith(("Looking in indexes:", "Looking in links:"))
    ]
    where = f"pip looked in {', '.join(looked)}" if looked else "pip looked in PyPI"
    found = re.search(r"\(from versions: ([^)]*)\)", out)
    if found is None:  # not a missing release (no network, a broken pip): pip's own last line
        last = (
            [ln.strip() for ln in out.splitlines() if ln.strip() and not ln.startswith("WARNING: Location")] or [""]
        )[-1]
        raise EnvError(f"verifiers {version}: pip could not look it up ({last[:200]}; {where})")
    versions = [v.strip() for v in found.group(1).split(",") if v.strip() and v.strip() != "none"]
    releases = [v for v in versions if ".dev" not in v and not re.search(r"(a|b|rc)\d", v)]
    has = f"its latest: {', '.join(releases[-3:])}" if releases else "no verifiers release there at all"
    on = ".".join(map(str, _python_version(python) or ())) or python
    raise EnvError(f"verifiers {version}: no such release for Python {on} ({has}; {where})")


def build_verifiers_layer(python: str, version: str, repo: Path, log: Log) -> tuple[Path, float]:
    """verifiers ``version`` with gym-runtime's dependencies, gym-runtime itself (editable) and ``uv``, plus a
    wheelhouse with what its chat harnesses' scripts need, checked by running ``uv sync --script`` offline once."""
    deps = sorted(runtime_dependencies(repo))
    prefix = verifiers_prefix(python, version, repo)

    def fill() -> None:
        _once(prefix, "venv", lambda: _venv(python, prefix))
        py = prefix / "bin" / "python"
        pins = [f"verifiers=={version}", "uv", *deps]
        _once(prefix, "packages", lambda: _pip(py, pins, prefix / "build.log", log, "verifiers layer"))
        _once(prefix, "runtime", lambda: _install_runtime(prefix, repo, log))
        _once(prefix, "wheelhouse", lambda: _script_wheelhouse(prefix, log))

    detail = f"verifiers=={version} + gym-runtime's dependencies"
    record = {"verifiers": version, "python": python, "deps": deps}
    return _build_layer(prefix, "verifiers", detail, fill, record, log)


def _script_wheelhouse(prefix: Path, log: Log) -> None:
    """The wheels verifiers' chat harness scripts need, as a local index, checked by the ``uv sync --script`` a
    rollout makes (verifiers sets UV_OFFLINE=false for it) with every proxy a dead port: the script's environment
    resolves from the wheelhouse, or the build fails here."""
    py, build_log = prefix / "bin" / "python", prefix / "build.log"
    scripts = json.loads(_run_logged([str(py), "-c", _SCRIPT_DEPS], build_log, "reading verifiers' scripts"))
    log(f"env: fetching the chat harness's script dependencies ({', '.join(scripts['dependencies'])})")
    wheels = prefix / "wheelhouse"
    download = [str(py), "-m", "pip", "download", "--only-binary", ":all:", "-d", str(wheels), *scripts["dependencies"]]
    _run_logged(download, build_log, "downloading the scripts' dependencies")
    _simple_index(wheels)
    probe = prefix / "scripts" / "chat_program.py"
    probe.parent.mkdir(exist_ok=True)
    probe.write_text(scripts["source"])
    dead = {v: "http://127.0.0.1:9" for v in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "https_proxy")}
    env = {**uv_environ(prefix), **dead, "UV_OFFLINE": "false"}
    uv = str(prefix / "bin" / "uv")
    _run_logged([uv, "sync", "--script", str(probe), "-q", "--no-config"], build_log, "uv sync --script", env)


@dataclass(frozen=True)
class VerifiersPlan:
    """A verifiers layer checked before it is built (``check_verifiers``): the release, the interpreter."""

    version: str
    python: str
    repo: Path


def check_verifiers(version: str | None = None, *, python: str | None = None) -> VerifiersPlan:
    """What ``ensure_verifiers`` would build, checked before anything is: the version (a release, 0.4 or
    later), the interpreter, and (unless that layer is built already) the release on the package index."""
    want = verifiers_release(version or VERIFIERS_VERSION)
    repo = repo_root()
    interp = find_python(python, minimum=VERIFIERS_MIN_PYTHON, what="verifiers 0.4", var=VERIFIERS_PYTHON_ENV)
    if not (verifiers_prefix(interp, want, repo) / ".complete").is_file():
        check_on_index(interp, want)
    return VerifiersPlan(version=want, python=interp, repo=repo)


def build_verifiers(plan: VerifiersPlan, *, log: Log = _stderr) -> VerifiersEnv:
    """The layer ``plan`` names, built now if it is not cached."""
    layer, took = build_verifiers_layer(plan.python, plan.version, plan.repo, log)
    return VerifiersEnv(
        version=plan.version,
        python=str(layer / "bin" / "python"),
        prefix=str(layer),
        environ=uv_environ(layer),
        built_s=took,
    )


def ensure_verifiers(version: str | None = None, *, python: str | None = None, log: Log = _stderr) -> VerifiersEnv:
    """verifiers ``version``'s (default ``VERIFIERS_VERSION``) own environment, built now if it is not cached;
    a version that cannot be built is one ``EnvError`` before anything is (``check_verifiers``)."""
    return build_verifiers(check_verifiers(version, python=python), log=log)


def in_hosted_env() -> bool:
    """This process is a hosted worker child running in its built layer."""
    return bool(os.environ.get(HOSTED_ENV)) and os.path.realpath(os.environ[HOSTED_ENV]) == os.path.realpath(sys.prefix)
