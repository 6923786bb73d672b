"""Deferred imports in the CLI's processes (``gym_runtime.cli._lazy``): aiohttp runs only where it is used.

Each case runs in a fresh interpreter (a subprocess), since what it checks is what an import does once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, timeout=60
    )


def test_a_cli_command_does_not_run_aiohttp_that_nats_imports() -> None:
    """`validate` connects to nothing and uses no HTTP: nats-py's `import aiohttp` no longer runs aiohttp."""
    out = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "gym_runtime.cli",
            "validate",
            str(REPO / "resources/weather/config.yaml"),
            "-i",
            str(REPO / "resources/weather/data/example.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert "nats.aio.transport" in imported  # nats-py was imported, and with it its `import aiohttp`
    assert "aiohttp.client" not in imported and "aiohttp.connector" not in imported


def test_a_deferred_aiohttp_works_as_imported_when_used() -> None:
    out = python(
        """
        import sys
        from gym_runtime.cli._lazy import defer_imports
        defer_imports()
        import nats, aiohttp
        assert "aiohttp.client" not in sys.modules, "loaded by import"
        assert nats.aio.transport.aiohttp is aiohttp
        session_cls = aiohttp.ClientSession  # the first name read runs the package
        assert "aiohttp.client" in sys.modules and session_cls.__module__ == "aiohttp.client"
        from aiohttp import web  # a submodule, after
        assert web.Application and aiohttp.web is web
        print("ok")
        """
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_submodule_imported_first_runs_its_package_first() -> None:
    out = python(
        """
        import sys
        from gym_runtime.cli._lazy import defer_imports
        defer_imports()
        from aiohttp import web  # before any name of aiohttp itself was read
        import aiohttp
        assert aiohttp.ClientSession.__module__ == "aiohttp.client" and aiohttp.web is web
        print("ok")
        """
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_package_that_fails_to_load_raises_at_first_use_and_is_not_left_imported(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "__init__.py").write_text("raise ImportError('broken needs a library that is absent')\n")
    out = python(
        """
        import sys
        from gym_runtime.cli._lazy import defer_imports
        defer_imports(("broken",))
        import broken  # bound at once, nothing run
        try:
            broken.anything
        except ImportError as e:
            print("raised:", e)
        print("left:", "broken" in sys.modules)
        """,
        cwd=tmp_path,
    )
    assert "raised: broken needs a library that is absent" in out.stdout, out.stderr[-2000:]
    assert "left: False" in out.stdout


def test_a_package_reading_itself_while_it_loads_and_another_thread_waiting(tmp_path: Path) -> None:
    """Its own code reading a name it has not defined yet gets AttributeError, as during any import; a
    second thread reading a name while it loads waits for it and gets the value."""
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "__init__.py").write_text(
        textwrap.dedent(
            """
            import sys, time
            try:
                sys.modules[__name__].value
                EARLY = "seen"
            except AttributeError:
                EARLY = "not yet"
            time.sleep(0.3)
            value = 42
            """
        )
    )
    out = python(
        """
        import threading
        from gym_runtime.cli._lazy import defer_imports
        defer_imports(("slow",))
        import slow
        got = []
        threads = [threading.Thread(target=lambda: got.append(slow.value)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(got, slow.EARLY)
        """,
        cwd=tmp_path,
    )
    assert out.stdout.strip() == "[42, 42] not yet", out.stderr[-2000:]
