"""Harbor's task format (the Terminal-Bench team's), read as Harbor reads it: what the ``harbor`` environment
(``resources/harbor``), its oracle agent and the image builder (``harbor/hosting.py``) share.

A task is a directory: ``task.toml``, ``instruction.md``, ``environment/Dockerfile``, ``tests/test.sh`` (which
writes ``/logs/verifier/reward.txt`` or ``reward.json``) and optionally ``solution/solve.sh``; a dataset is a
directory of them. Only the ``task.toml`` keys a run on the fleet uses are read (``[verifier]``, ``[agent]``,
``[environment]``, ``[solution]``); the others are ignored, as they are by this reader's purpose, not refused.
Rewards are parsed by Harbor's rules (``harbor.verifier.verifier.Verifier``, 0.26): ``reward.json`` first (an
object of finite numbers), else ``reward.txt`` (one finite float); an empty or unparsable file is an error.
The task's image is named by the hash of what it is built from (``environment/``, the base image map, the baked
commands), so it is built once per engine and every worker names it without asking one.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shlex
import ssl
import stat
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.errors import UserError
from gym_runtime.harbor.dockerfile_from import FROM_LINE, resolve_from
from gym_runtime.sandboxes.images import BaseImage

__all__ = [
    "Agent",
    "CA_FILE",
    "Environment",
    "INFO",
    "ImageOptions",
    "LOGS",
    "REPO",
    "REWARD_JSON",
    "REWARD_TXT",
    "RewardError",
    "SOLUTION_DIR",
    "Solution",
    "TASK_FILES",
    "TESTS_DIR",
    "Task",
    "TaskConfig",
    "VERIFIER_DIR",
    "Verifier",
    "check_own",
    "fetches",
    "files_of",
    "find_tasks",
    "host_ca",
    "image_ref",
    "last_layer",
    "load_task",
    "parse_rewards",
    "resolve_base",
    "rewrite_from",
    "row_reward",
    "tar",
    "task_context",
    "task_row",
]

REPO = "gym-runtime/harbor"
_BUILDER = 1  # bump when the build below changes what an image holds
INFO = "/etc/gym-runtime/harbor.json"  # the task image's own user and working directory, written at build time
LOGS = "/logs"
VERIFIER_DIR = "/logs/verifier"
REWARD_TXT = "/logs/verifier/reward.txt"
REWARD_JSON = "/logs/verifier/reward.json"
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
# what a test.sh may fetch while it runs: nothing can, under --network none (bake it into the image instead)
_FETCHES = re.compile(
    r"\b(curl|wget|pip3? install|uv (?:pip|add|sync|run|tool)|uvx|apt-get install|apt install|npm (?:install|i)|"
    r"git clone)\b"
)


class Verifier(msgspec.Struct, kw_only=True):
    timeout_sec: float = 600.0
    user: str | int | None = None
    env: dict[str, str] = {}


class Agent(msgspec.Struct, kw_only=True):
    timeout_sec: float | None = None
    user: str | int | None = None


class Environment(msgspec.Struct, kw_only=True):
    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    workdir: str | None = None


class Solution(msgspec.Struct, kw_only=True):
    env: dict[str, str] = {}


class TaskConfig(msgspec.Struct, kw_only=True):
    """The keys of ``task.toml`` a fleet run reads (Harbor's ``TaskConfig``, the rest ignored)."""

    verifier: Verifier = msgspec.field(default_factory=Verifier)
    agent: Agent = msgspec.field(default_factory=Agent)
    environment: Environment = msgspec.field(default_factory=Environment)
    solution: Solution = msgspec.field(default_factory=Solution)


class Task(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    path: str
    instruction: str
    config: TaskConfig

    @property
    def dir(self) -> Path:
        return Path(self.path)


class ImageOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How task images are built here: ``base_images`` maps a ``FROM`` image the engine cannot pull to a local
    one (``base``: the fleet's Debian base); ``bake`` are commands run as root in a last layer (with the host's
    network, at build time), for what a ``test.sh`` would otherwise fetch while it runs; ``build_args`` are
    ``docker build --build-arg``'s (they also resolve ``FROM ${ARG}``)."""

    base_images: dict[str, str] = {}
    bake: list[str] = []
    build_args: dict[str, str] = {}


# what a task is read from: its prompt, its build context, its tests and its solution
TASK_FILES = ("task.toml", "instruction.md", "environment", "tests", "solution")


def _own(path: Path) -> os.stat_result:
    """``path``'s own status, refused unless it is a regular file or a directory: a link could name any file of
    the operator's (an SSH key), which would go into the sandbox, the row and the model provider's prompt."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UserError(f"{path}: a symbolic link in a Harbor task is refused (its files must be its own)")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise UserError(f"{path}: not a regular file or a directory (a Harbor task holds only files)")
    return st


def check_own(root: Path) -> None:
    """Every file the task is read from is its own: nothing under ``TASK_FILES`` is a link (so no path resolves
    outside the task) or a special file (a FIFO would hang the reader); refused in one line naming it."""
    for name in TASK_FILES:
        top = root / name
        if not os.path.lexists(top):
            continue
        if stat.S_ISDIR(_own(top).st_mode):
            for where, dirs, files in os.walk(top):  # links are refused before anything would follow them
                for entry in sorted(dirs + files):
                    _own(Path(where, entry))


TASK_LAYOUT = (
    "give a task folder (task.toml, instruction.md, environment/Dockerfile, tests/test.sh; solution/solve.sh for "
    "parity) or a folder of them"
)


def load_task(path: str | Path) -> Task:
    """One task directory; a missing or malformed file, a link or a special file is one line naming it
    (``UserError``), before anything of it is read."""
    root = Path(path).resolve()
    toml = root / "task.toml"
    if not toml.is_file():
        raise UserError(f"{root}: not a Harbor task (no task.toml)")
    check_own(root)
    try:
        config = msgspec.convert(tomllib.loads(toml.read_text()), TaskConfig)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise UserError(f"{toml}: {e}") from None
    for need in ("instruction.md", "environment/Dockerfile", "tests/test.sh"):
        if not (root / need).is_file() and not (need == "environment/Dockerfile" and config.environment.docker_image):
            raise UserError(f"{root}: a Harbor task needs {need}")
    return Task(name=root.name, path=str(root), instruction=(root / "instruction.md").read_text(), config=config)


def find_tasks(path: str | Path) -> list[Task]:
    """A task directory, or a dataset: a directory of task directories (by name)."""
    root = Path(path)
    if (root / "task.toml").is_file():
        return [load_task(root)]
    if not root.is_dir():
        raise UserError(f"{root}: no such directory; {TASK_LAYOUT}")
    found = [d for d in sorted(root.iterdir()) if (d / "task.toml").is_file()]
    for d in found:
        _own(d)  # a task of the dataset that is a link out of it is refused as its files are
    tasks = [load_task(d) for d in found]
    if not tasks:
        raise UserError(f"{root}: holds no Harbor task (no */task.toml): {TASK_LAYOUT}")
    return tasks


def task_row(task: Task, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A task as a row: the instruction is the prompt (as Harbor gives it to an agent), the task its name;
    ``tools``: the function tools the environment offers the model."""
    params: dict[str, Any] = {"input": [{"role": "user", "content": task.instruction}]}
    if tools:
        params["tools"] = tools
    return {"responses_create_params": params, "harbor_task": task.name}


# ---------------------------------------------------------------------------------------------------- images


def resolve_base(name: str) -> str:
    """``base`` is the fleet's Debian base image (``gym_runtime.sandboxes.images``); anything else as written."""
    return BaseImage().ref if name == "base" else name


def files_of(root: Path) -> list[tuple[str, bytes, int]]:
    """A task directory's files (relative name, bytes, mode), in name order: a build context's, or a tree to
    copy. Links are never followed: one found (made since the task was loaded) is refused as ``load_task`` does."""
    _own(root)
    found = []
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(where, name)
            st = _own(path)
            if stat.S_ISREG(st.st_mode):
                found.append((path.relative_to(root), path, st.st_mode & 0o777))
    return [(rel.as_posix(), path.read_bytes(), mode) for rel, path, mode in sorted(found)]


def image_ref(task: Task, opts: ImageOptions) -> str:
    """The task image's name: the hash of its ``environment/``, the base map it is built with, and the bake."""
    h = hashlib.sha256(json.dumps([_BUILDER, task.config.environment.docker_image, opts.bake]).encode())
    h.update(json.dumps(sorted((k, resolve_base(v)) for k, v in opts.base_images.items())).encode())
    if opts.build_args:  # (absent from the hash without them: images built before they existed keep their name)
        h.update(json.dumps(sorted(opts.build_args.items())).encode())
    env = task.dir / "environment"
    for rel, data, mode in files_of(env) if env.is_dir() else []:
        h.update(f"\0{rel}\0{mode}\0{len(data)}\0".encode())
        h.update(data)
    return f"{REPO}:{h.hexdigest()[:16]}"


def rewrite_from(
    dockerfile: str, base_images: dict[str, str], build_args: dict[str, str] | None = None
) -> tuple[str, list[str]]:
    """The Dockerfile with each ``FROM`` image resolved (``FROM ${ARG}``: ``dockerfile_from``) and, where
    ``base_images`` maps it, replaced by its local image; and the external images it still names (a stage's
    own alias is not one)."""
    stages: set[str] = set()
    external: list[str] = []
    out = []
    for line in resolve_from(dockerfile, build_args).splitlines():
        m = FROM_LINE.match(line)
        if m:
            image, rest = m.group(3), m.group(4)
            if image in base_images:
                image = resolve_base(base_images[image])
            elif image.lower() not in stages and image != "scratch" and image not in external:
                external.append(image)
            alias = re.match(r"\s+AS\s+(\S+)", rest, re.IGNORECASE)
            if alias:
                stages.add(alias.group(1).lower())
            line = f"{m.group(1)}{m.group(2)}{image}{rest}"
        out.append(line)
    return "\n".join(out) + "\n", external


def tar(files: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def task_context(task: Task, opts: ImageOptions) -> tuple[bytes, list[str]]:
    """The build context of the task's own image (``environment/``, its Dockerfile's bases mapped), and the
    external images it needs the engine to hold."""
    env = task.dir / "environment"
    files = [f for f in files_of(env) if f[0] != "Dockerfile"]
    dockerfile, external = rewrite_from((env / "Dockerfile").read_text(), opts.base_images, opts.build_args)
    return tar([("Dockerfile", dockerfile.encode(), 0o644), *files]), external


CA_FILE = "/tmp/.gym-host-ca.crt"  # the host's CA bundle while the bake runs (removed after it)
# what pip, requests, curl, uv and OpenSSL read for the CA bundle: only the baked commands' RUN sets them
_CA_ENV = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "CURL_CA_BUNDLE")


def host_ca() -> bytes | None:
    """The CA bundle this machine trusts (``$SSL_CERT_FILE``, else OpenSSL's default file): behind a
    TLS-intercepting proxy it holds the proxy's CA, which a bake's ``pip install`` needs (the engine's classic
    build API has no build secrets). None where there is none."""
    paths = ssl.get_default_verify_paths()
    for path in (os.environ.get("SSL_CERT_FILE"), paths.cafile, paths.openssl_cafile):
        if path and Path(path).is_file():
            return Path(path).read_bytes()
    return None


def last_layer(stage: str, user: str, workdir: str, bake: list[str], ca: bytes | None = None) -> bytes:
    """The layer on top of a task's image: root as the container's user (the runtime drops to the task's user
    per command, as Harbor's ``exec -u`` does), the image's own user and working directory kept in ``INFO``, and
    the baked commands. ``ca``: the host's CA bundle, given to the baked commands only (``_CA_ENV``) and removed
    before the image is done: nothing of TLS is weakened, and the running image does not hold it."""
    info = json.dumps({"user": user or "root", "workdir": workdir or "/"})
    lines = [
        f"FROM {stage}",
        "USER root",
        f"RUN mkdir -p {Path(INFO).parent} {VERIFIER_DIR} {LOGS}/agent && chmod 0777 {LOGS} {VERIFIER_DIR} {LOGS}/agent"
        f" && printf '%s' {shlex.quote(info)} > {INFO}",
    ]
    files = []
    if bake and ca:
        files.append((Path(CA_FILE).name, ca, 0o644))
        lines.append(f"COPY {Path(CA_FILE).name} {CA_FILE}")
        env = " ".join(f"{k}={CA_FILE}" for k in _CA_ENV)
        lines += [f"RUN export {env} && {cmd}" for cmd in bake]
        lines.append(f"RUN rm -f {CA_FILE}")
    else:
        lines += [f"RUN {cmd}" for cmd in bake]
    return tar([("Dockerfile", ("\n".join(lines) + "\n").encode(), 0o644), *files])


def fetches(task: Task) -> list[str]:
    """What ``tests/test.sh`` fetches while it runs (curl, pip install, uvx, ...): none of it can under
    ``--network none``, so it must be in the image (``bake``)."""
    text = (task.dir / "tests" / "test.sh").read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return sorted({m.group(1) for ln in lines for m in _FETCHES.finditer(ln)})


# ---------------------------------------------------------------------------------------------------- rewards


class RewardError(ValueError):
    """No reward Harbor would accept: missing, empty, or not finite numbers."""


def _finite(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)):  # a JSON true passes, as in Harbor (bool is an int)
        raise RewardError(f"non-numeric reward {value!r} in {where}")
    if not math.isfinite(value):
        raise RewardError(f"non-finite reward {value!r} in {where}")
    return float(value)


def parse_rewards(reward_json: bytes | None, reward_txt: bytes | None) -> dict[str, float]:
    """The verifier's rewards by Harbor's rules: ``reward.json`` when it exists (an object of finite numbers),
    else ``reward.txt`` (a finite float, as ``{"reward": x}``); ``None``: the file does not exist."""
    if reward_json is not None:
        if not reward_json:
            raise RewardError(f"reward file is empty: {REWARD_JSON}")
        try:
            raw = json.loads(reward_json)
        except ValueError:
            raise RewardError(f"cannot parse rewards from {REWARD_JSON}") from None
        if not isinstance(raw, dict):
            raise RewardError(f"{REWARD_JSON} must hold an object of rewards, not {type(raw).__name__}")
        return {str(k): _finite(v, REWARD_JSON) for k, v in raw.items()}
    if reward_txt is not None:
        if not reward_txt:
            raise RewardError(f"reward file is empty: {REWARD_TXT}")
        try:
            value = float(reward_txt.decode())
        except (ValueError, UnicodeDecodeError):
            raise RewardError(f"cannot parse a reward from {REWARD_TXT}: {reward_txt[:80]!r}") from None
        return {"reward": _finite(value, REWARD_TXT)}
    raise RewardError(f"no reward file: test.sh wrote neither {REWARD_TXT} nor {REWARD_JSON}")


def row_reward(rewards: dict[str, float]) -> float:
    """The row's reward: ``reward`` where the verifier names it, else its only value (Harbor's metrics read a
    one-key dict so); several keys and none named ``reward`` is an error naming them."""
    if "reward" in rewards:
        return rewards["reward"]
    if len(rewards) == 1:
        return next(iter(rewards.values()))
    raise RewardError(f"{REWARD_JSON} has several rewards and none named 'reward': {sorted(rewards)}")
