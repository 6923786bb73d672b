"""The sandboxes' base image, built here: Debian 12 by ``debootstrap``, imported into the engine.

No registry is needed (Docker Hub is unreachable on these machines): the root file system is built once
per machine from Debian's mirror, kept as a tar under ``~/.cache/gym-runtime/images`` named by the hash
of what it is made of (suite, variant, packages, mirror), and imported into each engine that lacks it
as ``gym-runtime/base:<hash>``. CI and the tests share the cache, so the build (~1-2 min) happens once.
``python -m gym_runtime.sandboxes.images`` builds it and prints the image's name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import msgspec

from gym_runtime.errors import ConfigError
from gym_runtime.sandboxes.engine_http import Engine, EngineError, socket_of

REPO = "gym-runtime/base"
_BUILDER = 1  # bump when the steps below change what is built


class BaseImage(msgspec.Struct, frozen=True, kw_only=True):
    """What the base image is made of; its hash names it."""

    suite: str = "bookworm"
    variant: str = "minbase"
    # python3-venv too: the deploy image (deploy/Dockerfile's PYTHON_IMAGE) builds on this same base
    packages: tuple[str, ...] = ("python3", "python3-venv")
    mirror: str = "http://deb.debian.org/debian"

    @property
    def digest(self) -> str:
        return hashlib.sha256(msgspec.json.encode([_BUILDER, self])).hexdigest()[:16]

    @property
    def ref(self) -> str:
        return f"{REPO}:{self.digest}"


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "gym-runtime" / "images"


def build_rootfs(spec: BaseImage, out: Path) -> Path:
    """``debootstrap`` the root file system and tar it to ``out`` (atomically: a partial build is never cached)."""
    if shutil.which("debootstrap") is None:
        raise EngineError("debootstrap is not installed (apt-get install debootstrap; .ci/docker.sh does)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=out.parent) as tmp:
        root = Path(tmp) / "root"
        cmd = ["debootstrap", f"--variant={spec.variant}"]
        if spec.packages:
            cmd.append("--include=" + ",".join(spec.packages))
        subprocess.run([*cmd, spec.suite, str(root), spec.mirror], check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
        part = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], check=True)
        os.replace(part, out)
    return out


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    async with await anyio.open_file(path, "rb") as f:
        while chunk := await f.read(1 << 20):
            yield chunk


async def ensure_base(
    engine: Engine, spec: BaseImage | None = None, *, note: Callable[[str], None] | None = None
) -> str:
    """The base image's name in ``engine``, built and imported first where it is missing; ``note`` hears each
    step before it starts (the build takes minutes, once per machine: not a silent wait)."""
    spec = spec or BaseImage()
    if await engine.image_exists(spec.ref):
        return spec.ref
    tar = cache_dir() / f"debian-{spec.suite}-{spec.digest}.tar"
    if not tar.is_file():
        if note is not None:
            note(
                f"building the sandboxes' base image {spec.ref} (Debian {spec.suite} by debootstrap from "
                f"{spec.mirror}; 1-3 min, once per machine, kept in {tar.parent})"
            )
        await anyio.to_thread.run_sync(build_rootfs, spec, tar)
    if note is not None:
        note(f"importing the sandboxes' base image {spec.ref} into the engine (once per engine)")
    await engine.import_image(_chunks(tar), REPO, spec.digest)
    return spec.ref


async def base_here(engine: Engine, where: str, backend: str, *, note: Callable[[str], None] | None = None) -> str:
    """The base image in the engine, built here if missing; where it cannot be (no debootstrap, not root: a
    worker in a container, a node without it) one line saying where to build it instead (``start`` asks
    before any worker starts, a sandbox worker at its own start)."""
    try:
        return await ensure_base(engine, note=note)
    except (EngineError, OSError, subprocess.CalledProcessError) as e:
        raise ConfigError(
            f"{where}: the base image is not in the {backend} engine and cannot be built here ({e}): build it"
            " where debootstrap runs as root, `python -m gym_runtime.sandboxes.images` with DOCKER_HOST set to this"
            " engine's socket (docs/deployment.md)"
        ) from None


async def _main() -> None:
    host = os.environ.get("DOCKER_HOST")
    if not host:
        print('DOCKER_HOST is not set (eval "$(bash .ci/docker.sh start)")', file=sys.stderr)
        raise SystemExit(2)
    async with Engine(socket_of(host)) as engine:
        print(await ensure_base(engine))


if __name__ == "__main__":
    anyio.run(_main)
