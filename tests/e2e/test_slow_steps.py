"""A step that takes long names itself on stderr while it runs, instead of a silent wait: a worker whose start
(its environment's imports and setup) takes long, and the build of the sandboxes' base image. The slow start is
made deterministic (an agent whose setup waits for the test's word), the image build is started on a mirror that
does not answer (it fails at once after its line: nothing of the shared engine's images is touched)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.images import BaseImage, ensure_base
from tests.helpers import REPO, ROWS, read_jsonl, read_until, write_jsonl


def test_a_slow_worker_start_is_named_while_it_runs(tmp_path: Path) -> None:
    cfg = {
        "nats": "embedded",
        "models": {"policy": {"adapter": "scripted"}},
        "resources": {"weather": {"server": "resources.weather"}},
        "agents": {
            "slow": {
                "agent": "tests.envs.slow_start",
                "model": "policy",
                "resource": "weather",
                "options": {"dir": str(tmp_path)},
            }
        },
    }
    (tmp_path / "config.yaml").write_text(json.dumps(cfg))
    write_jsonl(tmp_path / "rows.jsonl", ROWS[:2])
    argv = [sys.executable, "-m", "gym_runtime.cli", "run", str(tmp_path / "config.yaml"), "--agent", "slow"]
    p = subprocess.Popen(
        [*argv, "-i", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--processes", "one"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stderr is not None
        seen, err = read_until(p.stderr, "still starting", 120)  # the setup is still waiting: it can only be now
        assert seen, err
        assert (tmp_path / "started").exists() and not (tmp_path / "go").exists()
        said = err.strip().splitlines()[-1]
        assert "agents.slow (loading tests.envs.slow_start and its environment): still starting (" in said, said
        (tmp_path / "go").touch()
        out, rest = p.communicate(timeout=120)
    finally:
        (tmp_path / "go").touch()
        if p.poll() is None:
            p.kill()
            p.wait(30)
    assert p.returncode == 0, err + rest
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 2, out


async def test_building_the_base_image_says_so_before_it_starts(engine: Engine, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no rootfs of this spec is cached: a build starts
    spec = BaseImage(mirror="http://127.0.0.1:9/debian")  # an image no engine has, from a mirror that is not there
    heard: list[str] = []
    with pytest.raises(subprocess.CalledProcessError):  # debootstrap ran, and found no mirror
        await ensure_base(engine, spec, note=heard.append)
    [line] = heard  # said before the build started
    assert line.startswith(f"building the sandboxes' base image {spec.ref} (Debian bookworm by debootstrap"), line
    assert "1-3 min, once per machine" in line
