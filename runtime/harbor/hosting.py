"""Harbor tasks' images, built here from their ``environment/Dockerfile`` through the engine's build API.

Two builds, each skipped when the engine already holds its result (both named by content hash, so a task is
built once per engine): the task's own Dockerfile, its ``FROM`` images mapped to local ones (no registry can
be reached here: an unmapped base the engine lacks is one line naming it and the map to add); then a last
layer (``gym_runtime.harbor.last_layer``) that keeps the image's user and working directory for the
environment and runs the ``bake`` commands (the host's CA bundle given to them: pip behind a TLS-intercepting
proxy). ``gym-runtime run`` and ``start`` build what their pools lack first (``ensure_config_images``). Builds
get the host's network (``RUN apt-get ...`` needs Debian's mirror); the sandboxes that run the image never get
one. ``python -m gym_runtime.harbor.hosting TASKS
[--base-image NAME=LOCAL] [--bake CMD]`` builds a task or a dataset of them and prints each image.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import anyio
import msgspec

from gym_runtime.config import Config, ResourceConfig, SandboxConfig
from gym_runtime.errors import ConfigError, UserError
from gym_runtime.harbor.tasks import (
    ImageOptions,
    Task,
    fetches,
    find_tasks,
    host_ca,
    image_ref,
    last_layer,
    resolve_base,
    task_context,
)
from gym_runtime.sandboxes.engine_http import Engine, EngineError, engine_fix, engine_socket, socket_of
from gym_runtime.sandboxes.images import base_here, ensure_base

BASE = "base"
SERVER = "resources.harbor"  # the environment whose entries name Harbor tasks


def parse_map(pairs: list[str], flag: str = "--base-image", example: str = "python:3.12-slim=base") -> dict[str, str]:
    """``NAME=VALUE`` pairs (``--base-image python:3.12-slim=base``) as a map; a pair without ``=`` is one line."""
    out = {}
    for pair in pairs:
        name, eq, local = pair.partition("=")
        if not eq or not name or (not local and flag == "--base-image"):
            raise UserError(f"{flag} {pair!r}: give NAME=VALUE (e.g. {example})")
        out[name] = local
    return out


def image_options(args: argparse.Namespace) -> ImageOptions:
    """``--base-image``, ``--bake`` and ``--build-arg`` as image options."""
    build_args = parse_map(args.build_arg, "--build-arg", "BASE_IMAGE=debian:12")
    return ImageOptions(base_images=parse_map(args.base_image), bake=args.bake, build_args=build_args)


async def ensure_task_image(
    engine: Engine, task: Task, opts: ImageOptions, *, note: Callable[[str], None] | None = None
) -> str:
    """The task's image in ``engine`` (built first where missing); ``note`` hears what the task needs that a
    sandbox cannot give it (a ``test.sh`` that fetches at verify time with nothing baked)."""
    ref = image_ref(task, opts)
    needs = fetches(task)
    if needs and not opts.bake and note is not None:
        note(
            f"{task.name}: tests/test.sh fetches at verify time ({', '.join(needs)}), which cannot work under"
            " --network none: pre-install what it needs with bake (--bake CMD), or its reward will be wrong"
        )
    if await engine.image_exists(ref):
        return ref
    if any(v == BASE for v in opts.base_images.values()):
        await ensure_base(engine, note=note)
    prebuilt = task.config.environment.docker_image
    if prebuilt:  # a prebuilt image the task names: it must be here already (mapped or not)
        stage = resolve_base(opts.base_images.get(prebuilt, prebuilt))
        external = [stage]
    else:
        try:
            context, external = task_context(task, opts)
        except UserError as e:
            raise UserError(f"{task.name}: {e}") from None
        stage = f"{ref}-task"
    for image in external:
        if not await _image_exists(engine, task, image):
            raise UserError(
                f"{task.name}: base image {image!r} is not in the engine and cannot be pulled here: map it to a local"
                f" one (base_images: {{{image!r}: base}}, or --base-image {image}=base)"
            )
    started = time.monotonic()
    if note is not None:
        note(f"{task.name}: building its image {ref} from environment/Dockerfile (once per engine)")
    timeout = task.config.environment.build_timeout_sec
    # each step named as the engine starts it: a slow step (an apt-get, a compile) is not minutes of silence
    step = (lambda said: note(f"{task.name}: {said}")) if note is not None else None
    try:
        if not prebuilt:
            await engine.build(
                context, stage, network="host", timeout_s=timeout, build_args=opts.build_args, on_step=step
            )
        config = await engine.image_config(stage)
        user, workdir = str(config.get("User") or ""), str(config.get("WorkingDir") or "")
        layer = last_layer(stage, user, workdir, opts.bake, host_ca())
        await engine.build(layer, ref, network="host", timeout_s=timeout, on_step=step)
    except EngineError as e:
        raise UserError(f"{task.name}: building its image failed: {e}") from None
    if note is not None:
        note(f"{task.name}: built {ref} in {time.monotonic() - started:.1f} s")
    return ref


async def _image_exists(engine: Engine, task: Task, image: str) -> bool:
    """Whether the engine holds ``image``; a name it refuses (``Debian:12``) is the task's mistake, one line."""
    try:
        return await engine.image_exists(image)
    except EngineError as e:
        raise UserError(
            f"{task.name}: environment/Dockerfile: FROM {image}: not an image name the engine takes ({e})"
        ) from None


async def ensure_images(
    engine: Engine, tasks: list[Task], opts: ImageOptions, *, note: Callable[[str], None] | None = None
) -> dict[str, str]:
    """Each task's image by task name (built one after another: the engine's builds share its CPUs)."""
    return {t.name: await ensure_task_image(engine, t, opts, note=note) for t in tasks}


def _options(name: str, entry: ResourceConfig) -> tuple[list[Task], ImageOptions]:
    """A ``resources.harbor`` entry's tasks and image options (the environment's own ``Options`` keys)."""
    where = f"resources.{name}.options"
    tasks = entry.options.get("tasks")
    if not isinstance(tasks, str) or not tasks:
        raise ConfigError(f"{where}.tasks: name a Harbor task directory or a directory of them")
    keys = {k: entry.options[k] for k in ("base_images", "bake", "build_args") if k in entry.options}
    try:
        opts = msgspec.convert(keys, ImageOptions)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {e}") from None
    return find_tasks(tasks), opts


async def ensure_config_images(
    cfg: Config, pools: Collection[str] | None = None, *, note: Callable[[str], None] | None = None
) -> None:
    """Build the task images that the config's Harbor environments need and their pools' engines lack, before
    anything of a run starts (``gym-runtime run``, and ``start`` for the pools it serves: ``pools``, None for
    all): one build per image, named by content hash, so a second run builds nothing. A pool that is not an
    engine of this machine's (process, daytona) is left alone. The base image, the default of a pool's sandboxes,
    is built here too where missing, with ``note`` saying so: its build takes minutes, once per machine."""
    harbor = []  # every Harbor entry's options read first: a mistake there is said before any engine is asked
    for name, entry in cfg.resources.items():
        if entry.server not in (SERVER, f"gym_runtime.{SERVER}") or entry.sandbox not in cfg.sandboxes:
            continue
        pool = cfg.sandboxes[entry.sandbox]
        if (pools is not None and entry.sandbox not in pools) or pool.backend not in ("docker", "podman"):
            continue
        harbor.append((entry.sandbox, pool, *_options(name, entry)))
    for pool_name, pool in cfg.sandboxes.items():
        served = pools is None or pool_name in pools
        if pool.image != BASE or pool.backend not in ("docker", "podman") or not served:
            continue
        async with _engine(pool, f"sandboxes.{pool_name}") as engine:
            await base_here(engine, f"sandboxes.{pool_name}", pool.backend, note=note)
    for pool_name, pool, tasks, opts in harbor:
        async with _engine(pool, f"sandboxes.{pool_name}") as engine:
            await ensure_images(engine, tasks, opts, note=note)


@contextlib.asynccontextmanager
async def _engine(pool: SandboxConfig, where: str) -> AsyncIterator[Engine]:
    """The pool's engine, answering (else one line naming the pool)."""
    async with Engine(engine_socket(pool.backend, pool.engine, where)) as engine:
        try:
            await engine.ping()
        except EngineError as e:
            raise ConfigError(
                f"{where}: the {pool.backend} engine does not answer: {e}; {engine_fix(pool.backend, where)}"
            ) from None
        yield engine


async def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m gym_runtime.harbor.hosting", description=__doc__)
    p.add_argument("tasks", help="a Harbor task directory, or a directory of them")
    p.add_argument("--base-image", action="append", default=[], metavar="NAME=LOCAL")
    p.add_argument("--bake", action="append", default=[], metavar="CMD")
    p.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args(argv)
    host = os.environ.get("DOCKER_HOST")
    if not host:
        raise UserError('DOCKER_HOST is not set (eval "$(bash .ci/docker.sh start)")')
    opts = image_options(args)
    tasks = find_tasks(args.tasks)
    async with Engine(socket_of(host)) as engine:
        refs = await ensure_images(engine, tasks, opts, note=lambda line: print(line, file=sys.stderr))
    for name, ref in refs.items():
        print(f"{name}\t{ref}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(anyio.run(_main, sys.argv[1:]))
    except UserError as e:
        print(e, file=sys.stderr)
        raise SystemExit(2) from None


# ---------------------------------------------------------------------------------------------------- parity

POOL = "harbor"
FULL = 1.0  # Harbor's oracle check: the reference solution scores the full reward


def harbor_config(tasks: str, opts: ImageOptions, engine: str, timeout_s: float) -> dict[str, Any]:
    """A config that runs every task with its ``solve.sh`` as the policy (``agents.harbor_oracle``) on a pool of
    ``engine``: the task images' file systems writable (Harbor's tasks write ``/app``, ``/logs``, ``/tests``)."""
    return {
        "models": {"policy": {"adapter": "scripted"}},  # never called: the oracle is the policy
        "sandboxes": {
            POOL: {
                "backend": "docker",
                "engine": engine,
                "rootfs": "writable",
                "limits": {"memory_mb": 2048, "pids": 512, "timeout_s": timeout_s},
            }
        },
        "resources": {
            "harbor": {
                "server": SERVER,
                "sandbox": POOL,
                "options": {
                    "tasks": tasks,
                    "base_images": opts.base_images,
                    "bake": opts.bake,
                    "build_args": opts.build_args,
                },
            }
        },
        "agents": {
            "oracle": {
                "agent": "agents.harbor_oracle",
                "model": "policy",
                "resource": "harbor",
                "timeout_s": timeout_s * 2 + 120,
                "max_attempts": 1,
            }
        },
    }


def parity_lines(
    tasks: list[Task], rows: list[dict[str, Any]], failures: list[dict[str, Any]]
) -> tuple[bool, list[str]]:
    """Each task's oracle reward against the full reward; a failure row or a missing row is a mismatch."""
    by_task = {r.get("harbor_task"): r for r in rows}
    # a failure row names its task by index (the rows were published in ``tasks``' order)
    failed = {tasks[r["_ng_task_index"]].name: r for r in failures if 0 <= r.get("_ng_task_index", -1) < len(tasks)}
    ok, lines = True, []
    for t in tasks:
        row = by_task.get(t.name)
        if row is not None and row.get("reward") == FULL:
            lines.append(f"{t.name}: reward {row['reward']:g} (full) {row.get('harbor_rewards', {})}")
            continue
        ok = False
        needs = fetches(t)
        why = f" (its tests/test.sh fetches at verify time: {', '.join(needs)})" if needs else ""
        if row is not None:
            lines.append(f"{t.name}: reward {row.get('reward'):g} is not the full reward {FULL:g}: MISMATCH{why}")
        elif t.name in failed:
            f = failed[t.name]
            lines.append(f"{t.name}: failed ({f.get('error_class')}): {f.get('error')}: MISMATCH")
        else:
            lines.append(f"{t.name}: no row: MISMATCH")
    return ok, lines
