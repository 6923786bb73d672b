"""``FROM ${ARG}`` in a Harbor task's Dockerfile (issue 57): the image a ``FROM`` names is resolved as ``docker
build`` resolves it (global ``ARG`` defaults, build arguments over them), BuildKit's platform arguments as the
engine's classic builder treats them, and what cannot be resolved is one line naming the line and the fix.

The last test builds such tasks on the real engine through ``gym-runtime parity --harbor`` (exit 3 with an
``EngineError`` traceback before: the engine was asked for an image named ``${BASE_IMAGE}``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gym_runtime.errors import UserError
from gym_runtime.harbor import rewrite_from
from gym_runtime.harbor.dockerfile_from import resolve_from
from gym_runtime.sandboxes.engine_http import Engine
from tests.helpers import REPO


def froms(dockerfile: str, build_args: dict[str, str] | None = None) -> list[str]:
    return [ln for ln in resolve_from(dockerfile, build_args).splitlines() if ln.startswith("FROM")]


def test_arg_defaults_resolve_from_lines_and_build_args_override_them() -> None:
    df = 'ARG BASE_IMAGE=debian:12\nARG TAG="3.12"  PY=python\nFROM ${BASE_IMAGE}\nFROM $PY:${TAG}-slim AS b\n'
    assert froms(df) == ["FROM debian:12", "FROM python:3.12-slim AS b"]
    assert froms(df, {"BASE_IMAGE": "ubuntu:24.04", "TAG": "3.13"}) == [
        "FROM ubuntu:24.04",
        "FROM python:3.13-slim AS b",
    ]
    # a build argument that no global ARG declares does not reach FROM (as docker build)
    assert froms("FROM ${X:-debian:12}\n", {"X": "ubuntu"}) == ["FROM debian:12"]
    # an ARG declared after the first FROM is a stage's, not FROM's; defaults may use earlier ARGs
    assert froms("ARG V=12\nARG IMG=debian:$V\nFROM ${IMG}\nARG V=13\nFROM debian:$V\n") == [
        "FROM debian:12",
        "FROM debian:12",
    ]


def test_the_shell_forms_docker_supports() -> None:
    scope = "ARG SET=a\nARG EMPTY=\nARG UNSET\n"
    cases = {
        "${SET:-x}": "a",
        "${EMPTY:-x}": "x",
        "${EMPTY-x}x": "x",  # set but empty: '-' keeps it
        "${UNSET-x}": "x",
        "${SET:+b}": "b",
        "${EMPTY:+b}y": "y",
        "${EMPTY+b}": "b",
        "${NONE:-${SET}}": "a",
        '"$SET"': "a",  # double quotes expand, and go
        "'debian:12'": "debian:12",
    }
    for word, want in cases.items():
        assert froms(f"{scope}FROM {word}\n") == [f"FROM {want}"], word


def test_buildkit_platform_arguments_are_what_the_classic_builder_makes_of_them() -> None:
    """The classic builder does not define $BUILDPLATFORM: a ``--platform`` naming only BuildKit's automatic
    arguments is dropped (the engine builds for its own platform), one naming a declared ARG is kept."""
    df = "ARG BASE=debian:12\nFROM --platform=$BUILDPLATFORM ${BASE} AS build\nFROM --platform=${TARGETPLATFORM} b\n"
    assert froms(df) == ["FROM debian:12 AS build", "FROM b"]
    kept = "ARG BUILDPLATFORM=linux/amd64\nFROM --platform=$BUILDPLATFORM debian:12\n"
    assert froms(kept) == ["FROM --platform=$BUILDPLATFORM debian:12"]
    assert froms("FROM --platform=linux/arm64 debian:12\n") == ["FROM --platform=linux/arm64 debian:12"]
    # in the image itself an undeclared variable is empty, as in the classic builder: one line
    with pytest.raises(UserError, match=r"FROM \$\{TARGETOS\}-x resolves to '-x', not an image"):
        resolve_from("FROM ${TARGETOS}-x\n")
    with pytest.raises(UserError, match=r"FROM '\$SET' resolves to '\$SET', not an image"):
        resolve_from("ARG SET=a\nFROM '$SET'\n")  # single quotes keep the '$': no image has one


@pytest.mark.parametrize(
    ("dockerfile", "message"),
    [
        (
            "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\n",
            "environment/Dockerfile line 2: FROM ${BASE_IMAGE} resolves to '', not an image: declare it before the"
            " first FROM with a default (ARG BASE_IMAGE=IMAGE) or give it (--build-arg BASE_IMAGE=IMAGE)",
        ),
        (
            "FROM ${NOPE}\n",
            "environment/Dockerfile line 1: FROM ${NOPE} resolves to '', not an image: declare it before the first"
            " FROM with a default (ARG NOPE=IMAGE) or give it (--build-arg NOPE=IMAGE)",
        ),
        (
            "ARG B=debian:12\nFROM ${B%:*}\n",
            "environment/Dockerfile line 2: FROM ${B%:*}: ${B%:*}: an expansion the builder does not support",
        ),
        ("ARG B=debian:12\nFROM ${B\n", "environment/Dockerfile line 2: FROM ${B: missing '}'"),
    ],
    ids=["arg-without-default", "undeclared", "unsupported-expansion", "unclosed"],
)
def test_what_cannot_be_resolved_is_one_line(dockerfile: str, message: str) -> None:
    with pytest.raises(UserError) as e:
        resolve_from(dockerfile)
    assert str(e.value) == message


def test_the_resolved_image_is_what_the_base_map_and_the_external_list_see() -> None:
    df = "ARG BASE_IMAGE=debian:12\nFROM ${BASE_IMAGE} AS base\nRUN true\nFROM base\nFROM ${BASE_IMAGE:-x}\n"
    out, external = rewrite_from(df, {"debian:12": "gym-runtime/base:abc"})
    assert out.splitlines()[1] == "FROM gym-runtime/base:abc AS base"
    assert out.splitlines()[3] == "FROM base" and out.splitlines()[4] == "FROM gym-runtime/base:abc"
    assert external == []
    assert rewrite_from(df, {}, {"BASE_IMAGE": "ubuntu:24.04"})[1] == ["ubuntu:24.04"]


# ------------------------------------------------------------------------------------------ on the real engine

TASK = REPO / "tests" / "harbor_tasks" / "read-file"


def _task(root: Path, name: str, head: str) -> Path:
    """read-file with its Dockerfile's ``FROM debian:bookworm-slim`` line replaced by ``head``."""
    task = root / name
    shutil.copytree(TASK, task)
    df = task / "environment" / "Dockerfile"
    df.write_text(df.read_text().replace("FROM debian:bookworm-slim\n", head, 1))
    return task


def _parity(tasks: Path, engine: Engine, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gym_runtime.cli", "parity", str(tasks), "--harbor", "--timeout", "120", *args]
    env = {**os.environ, "DOCKER_HOST": f"unix://{engine.socket_path}"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tasks)


def test_parity_builds_from_arg_tasks_and_refuses_an_unresolvable_one_with_one_line(
    engine: Engine, base_image: str, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    _task(tasks, "arg-default", "ARG BASE_IMAGE=debian:bookworm-slim\nFROM ${BASE_IMAGE}\n")
    _task(tasks, "build-arg", "ARG BASE_IMAGE\nFROM --platform=$BUILDPLATFORM ${BASE_IMAGE}\n")
    mapped = ["--base-image", "debian:bookworm-slim=base"]
    ok = _parity(tasks, engine, *mapped, "--build-arg", "BASE_IMAGE=debian:bookworm-slim")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines() == [
        "arg-default: reward 1 (full) {'reward': 1.0}",
        "build-arg: reward 1 (full) {'reward': 1.0}",
    ]
    shutil.rmtree(tasks / "arg-default")  # (its image, built without --build-arg, would be noted first)
    bad = _parity(tasks, engine, *mapped)  # build-arg's BASE_IMAGE has no default and none is given
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "gym-runtime: error: build-arg: environment/Dockerfile line 2: FROM ${BASE_IMAGE} resolves to '', not an"
        " image: declare it before the first FROM with a default (ARG BASE_IMAGE=IMAGE) or give it (--build-arg"
        " BASE_IMAGE=IMAGE)"
    ]
