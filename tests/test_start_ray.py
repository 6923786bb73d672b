"""``start --ray`` where Ray is not installed (the ``ray`` extra): one line naming the extra, exit 2, before any
config is read or any worker starts. Ray is hidden from the command (``sys.modules['ray'] = None``, what Python
reads as "not installed"), so this runs whether or not this venv has it."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO, WEATHER

HIDE_RAY = "import sys; sys.modules['ray'] = None; from gym_runtime.cli import main; sys.exit(main(sys.argv[1:]))"


def test_ray_without_the_extra_is_one_line_naming_it() -> None:
    p = subprocess.run(
        [sys.executable, "-c", HIDE_RAY, "start", str(WEATHER), "--nats", "nats://127.0.0.1:1", "--ray", "auto"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert lines == ["gym-runtime: error: --ray auto needs Ray: pip install 'gym-runtime[ray]' (the ray extra)"], (
        p.stderr
    )
