"""The packages under each folder of pyproject.toml's ``[tool.setuptools.package-dir]``.

That table is the one declaration of the import root (``gym_runtime`` <- ``runtime/``,
``gym_runtime.agents`` <- ``agents/``, ...: DESIGN §11); setuptools reads it from there. Only the
package list is computed here, because pyproject's static ``packages.find`` cannot put several
folders under one root. Tests stay out of the wheel (and so out of the editable install's tree);
bundled configs and example data ship in it (``package-data`` in pyproject.toml).
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

TESTS = ["tests", "tests.*", "*.tests", "*.tests.*"]


def packages() -> list[str]:
    roots: dict[str, str] = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: list[str] = []
    for pkg, folder in roots.items():
        found.append(pkg)
        found += [f"{pkg}.{sub}" for sub in find_packages(folder, exclude=TESTS)]
    return found


setup(packages=packages())
