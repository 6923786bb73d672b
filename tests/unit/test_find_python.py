"""``find_python`` looks past pyenv's shims to the interpreters pyenv has: a shim is a bash script that runs ~70
processes per call, and fails outright for a version pyenv has but does not select."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gym_runtime.nemo_gym.hosting.env import find_python


def test_a_pyenv_shim_is_never_run_and_the_version_behind_it_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "pyenv"
    ran = tmp_path / "shim-ran"
    shim = root / "shims" / f"python3.{sys.version_info[1]}"
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/sh\ntouch {ran}\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    real = root / "versions" / "3.x" / "bin" / "python"
    real.parent.mkdir(parents=True)
    real.symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYENV_ROOT", str(root))
    monkeypatch.delenv("GYM_TEST_PYTHON", raising=False)
    found = find_python(minimum=sys.version_info[:2], var="GYM_TEST_PYTHON")
    assert not ran.exists()
    assert Path(found).resolve() == Path(sys.executable).resolve()
    assert Path(found).parent != shim.parent


def test_a_python_on_path_outside_pyenv_still_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mine = bin_dir / f"python3.{sys.version_info[1]}"
    mine.symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    monkeypatch.delenv("GYM_TEST_PYTHON", raising=False)
    assert find_python(minimum=sys.version_info[:2], var="GYM_TEST_PYTHON") == str(mine)
