"""Deferred imports in the CLI's processes (``gym_runtime.cli._lazy``): aiohttp runs only where it is used;
and what each command imports: only its own module, and for ``--help`` not the stack it runs (issue 41).

Each case runs in a fresh interpreter (a subprocess), since what it checks is what an import does once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

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


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    modules: set[str]


def imported(*argv: str) -> Ran:
    """``gym-runtime ARGV`` (its ``main``) in a fresh interpreter, and the modules loaded when it ended (the
    commands are imported with ``importlib``, which ``-X importtime`` does not show)."""
    out = python(
        f"""
        import json, sys
        from gym_runtime.cli import main
        try:
            rc = main({list(argv)!r})
        except SystemExit as e:
            rc = e.code
        print("\\n" + json.dumps([rc, sorted(sys.modules)]))
        """,
        cwd=REPO,
    )
    text, _, last = out.stdout.rstrip("\n").rpartition("\n")
    rc, modules = json.loads(last)
    return Ran(rc, text, out.stderr, set(modules))


# What a command runs, not what parsing its arguments needs: NATS, the transport, telemetry, structured logs,
# the embedded server's provisioning, the hosted servers' machinery.
HEAVY = (
    "nats",
    "gym_runtime.transport.connect",
    "gym_runtime.transport.jetstream",
    "opentelemetry.trace",
    "structlog",
    "gym_runtime.observability.tracing",
    "gym_runtime.ops.nats_server",
    "gym_runtime.admission",
    "gym_runtime.nemo_gym.hosting.env",
)


@pytest.mark.parametrize("command", ["publish", "collect", "run", "view", "diff", "export"])
def test_a_commands_help_imports_neither_the_other_commands_nor_the_stack_it_runs(command: str) -> None:
    out = imported(command, "--help")
    assert out.returncode == 0 and f"usage: gym-runtime {command}" in out.stdout, out.stderr[-2000:]
    assert f"gym_runtime.cli.{command}" in out.modules
    others = {n for n in out.modules if n.startswith("gym_runtime.cli.") and not n.startswith("gym_runtime.cli._")}
    assert others == {f"gym_runtime.cli.{command}"}
    assert not out.modules & set(HEAVY), sorted(out.modules & set(HEAVY))


@pytest.mark.parametrize("argv", [["--help"], ["--help", "publish"], ["-h", "collect", "x"]])
def test_the_top_level_help_still_lists_every_command(argv: list[str]) -> None:
    from gym_runtime.cli import COMMAND_NAMES

    out = imported(*argv)
    assert out.returncode == 0 and out.stdout.startswith("usage: gym-runtime [-h]"), out.stderr[-2000:]
    listed = out.stdout.split("COMMAND", 1)[1]
    assert all(f"    {name} " in listed or f"    {name}\n" in listed for name in COMMAND_NAMES), out.stdout


def test_a_mistyped_command_is_one_usage_line_naming_the_commands() -> None:
    out = imported("publsh", "x.yaml")
    assert out.returncode == 2
    assert "invalid choice: 'publsh'" in out.stderr and "'publish'" in out.stderr and "Traceback" not in out.stderr


def test_a_usage_mistake_in_a_command_exits_2_before_loading_its_stack() -> None:
    out = imported("publish", "x.yaml", "-i", "in.jsonl", "--repeats", "0")
    assert out.returncode == 2 and "--repeats: must be at least 1" in out.stderr, out.stderr[-2000:]
    assert not out.modules & set(HEAVY), sorted(out.modules & set(HEAVY))


def test_loading_a_config_imports_no_transport() -> None:
    """The config's ``jetstream`` defaults live in ``gym_runtime.transport.limits``, plain values."""
    out = python(
        f"""
        import sys
        from gym_runtime.config import load_config
        cfg = load_config([{str(REPO / "resources/weather/config.yaml")!r}], [])
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        print(cfg.jetstream.duplicate_window_s, heavy)
        """
    )
    assert out.stdout.strip() == "120.0 []", out.stderr[-2000:]


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


def test_what_publish_and_collect_run_imports_no_worker() -> None:
    """``publish`` and ``collect`` start no worker: ``service.batches`` loads none (nor an environment's guest)."""
    out = python(
        """
        import sys
        import gym_runtime.service.batches
        workers = [m for m in sys.modules if m.startswith("gym_runtime.workers.")]
        print(sorted(set(workers) - {"gym_runtime.workers.control"}))
        """
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


LOG_AN_ERROR = """
    import sys
    {first}
    from gym_runtime.observability import logs
    loaded = "rich" in sys.modules
    logs.configure("info", json={json})
    try:
        1 / 0
    except ZeroDivisionError:
        logs.get("t").exception("boom", api_key="k", n=1)
    import rich.console  # importable as before
    print(loaded, rich.console.Console.__name__)
"""


@pytest.mark.parametrize("json_lines", [True, False])
def test_structured_logs_do_not_load_rich_and_render_an_error_as_they_did_with_it(json_lines: bool) -> None:
    """structlog imports rich, when installed, for tracebacks our processors render before it sees them."""
    without = python(LOG_AN_ERROR.format(first="", json=json_lines))
    with_rich = python(LOG_AN_ERROR.format(first="import rich.console", json=json_lines))
    assert without.stdout.split() == ["False", "Console"], without.stderr[-2000:]
    assert with_rich.stdout.split() == ["True", "Console"], with_rich.stderr[-2000:]

    def rendered(err: str) -> str:
        return re.sub(r"\d{4}-\d\d-\d\dT[\d:.]+Z", "T", err)

    assert "ZeroDivisionError: division by zero" in without.stderr and "***" in without.stderr
    assert rendered(without.stderr) == rendered(with_rich.stderr)


def test_checking_rows_of_a_nemo_gym_environment_does_not_import_pydantic() -> None:
    """``validate`` (as ``publish``) reads weather's tools to check its rows; the pydantic models that validate
    a ``nemo_gym`` tool's arguments are built where the tools run (~0.13 CPU-s of pydantic per process)."""
    ran = imported(
        "validate",
        str(REPO / "resources/weather/config.yaml"),
        "-i",
        str(REPO / "resources/weather/data/example.jsonl"),
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "gym_runtime.resources.weather" in ran.modules  # its class was loaded to check the rows
    assert "pydantic" not in ran.modules
