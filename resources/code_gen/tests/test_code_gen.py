"""code_gen: NeMo Gym parity (recorded rollouts + differential cases) and the sandbox, with real processes."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import psutil
import pytest

from gym_runtime.config import load_config
from gym_runtime.errors import Failure
from gym_runtime.jail.runner import (
    JailError,
    JailRunner,
    Layers,
    Limits,
    landlock_abi,
)
from gym_runtime.plugins import import_plugin
from gym_runtime.resource import Verdict, find_resource_class
from gym_runtime.resources.code_gen import CodeGen, CodeGenOptions
from gym_runtime.resources.code_gen.grading import HARNESS, compare_stdout, extract_code
from tests.differential import (
    COMPAT,
    compat_dir,
    differential_cases,
    example_rollouts,
    recorded_response,
    text_response,
)

from .programs import ADD, ADD_OK, FAST, fenced, session, stdio_task, still_works

ENV_DIR = Path(__file__).resolve().parents[1]
REPO = ENV_DIR.parents[1]
# Run-dependent parts of the metadata, which the differential cases leave out.
VOLATILE_METADATA = ("execution time", "traceback")
SECRET = "gym-test-secret-7f3a9c"

pytestmark = pytest.mark.skipif(landlock_abi() < 1, reason="the sandbox needs Linux with Landlock")


def stable(fields: dict[str, Any]) -> dict[str, Any]:
    out = dict(fields)
    out.pop("unit_tests_time_taken", None)
    if isinstance(out.get("metadata"), dict):
        out["metadata"] = {k: v for k, v in out["metadata"].items() if k not in VOLATILE_METADATA}
    return out


def own_sandbox_dirs() -> set[str]:
    """This process's sandbox directories (named for its pid: other test workers' come and go beside them)."""
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(f"gym-sandbox-{os.getpid()}-")}


def no_sandbox_left(before: set[str]) -> None:
    assert psutil.Process().children(recursive=True) == []
    assert own_sandbox_dirs() <= before


@pytest.fixture
def sandbox_dirs() -> set[str]:
    return own_sandbox_dirs()


# ----------------------------------------------------------------------------- parity


async def test_recorded_rollouts_reproduce_reward_and_fields() -> None:
    pairs = example_rollouts(ENV_DIR, COMPAT / "nemo_gym" / "code_gen")
    assert len(pairs) == 5
    env = await session(max_parallel=2)
    checked = 0
    for task, rec in pairs:
        out = await env.verify(task, recorded_response(rec["response"]))
        assert isinstance(out, Verdict)
        assert out.reward == rec["reward"]
        got = stable(out.fields)
        # the recorded rows come from an older NeMo Gym that wrote only these fields
        for key in ("extracted_model_output", "extracted_model_code", "result", "metadata"):
            want = rec[key]
            if key == "metadata" and isinstance(want, dict):
                want = {k: v for k, v in want.items() if k not in VOLATILE_METADATA}
            assert got[key] == want, key
        checked += 1
    assert checked == 5


async def test_differential_cases() -> None:
    cases = differential_cases("code_gen")
    assert len(cases) >= 18
    env = await session(max_parallel=2)  # NeMo Gym's config: 10 s per test, penalty 0.0
    results: dict[int, tuple[float, dict[str, Any]]] = {}

    async def one(i: int, row: dict[str, Any]) -> None:
        task = {k: v for k, v in row.items() if k != "response"}
        out = await env.verify(task, recorded_response(row["response"]))
        results[i] = (out.reward, stable(out.fields))

    async with anyio.create_task_group() as tg:
        for i, (row, _) in enumerate(cases):
            tg.start_soon(one, i, row)
    for i, (_, case) in enumerate(cases):
        reward, fields = results[i]
        assert reward == case["expected_reward"], case["case"]
        assert fields == case["expected_fields"], case["case"]


async def test_example_data_is_nemo_gyms_file() -> None:
    src = compat_dir("nemo_gym", "code_gen", "example.jsonl")
    assert (ENV_DIR / "data" / "example.jsonl").read_bytes() == src.read_bytes()


# ----------------------------------------------------------------------------- grading rules


def test_extract_code_takes_the_last_fenced_block() -> None:
    text = "```python\nprint(1)\n```\nthen\n```\nprint(2)\n```"
    assert extract_code(text) == "print(2)"
    assert extract_code("print(1)") == ""
    assert extract_code("```cpp\nint main(){}\n```") == "int main(){}"


def test_compare_stdout_rules() -> None:
    assert compare_stdout("3  \n\n\n", "", "3\n") is None
    assert compare_stdout("3.0\n", "", "3\n") is None  # Decimal equality
    assert compare_stdout("1e3\n", "", "1000\n") is None
    wrong = compare_stdout("0.333333\n", "", "0.333333333\n")  # no tolerance
    assert wrong is not None and wrong["error_message"] == "Wrong answer at output_line_idx=0: 0.333333 != 0.333333333"
    assert compare_stdout("1\n2\n", "", "1\n")["error_message"] == "Wrong answer: mismatched output length"


async def test_no_code_and_empty_answers_are_not_run() -> None:
    env = await session(**FAST)
    empty = await env.verify(ADD, text_response("   "))
    assert empty.reward == 0.0 and empty.fields["extracted_model_output"] is None
    bare = await env.verify(ADD, text_response(ADD_OK))
    assert bare.reward == 0.0 and bare.fields["extracted_model_code"] is None and bare.fields["result"] is None


async def test_think_tag_violation_gets_the_penalty() -> None:
    env = await session(**FAST, reasoning_format_penalty=0.25)
    out = await env.verify(ADD, text_response(f"```python\n{ADD_OK}\n```", reasoning="<think>a</think><think>"))
    assert out.reward == 0.25 and out.fields["reasoning_format_violation_rate"] == 1.0
    assert out.fields["result"] == [True, True]


async def test_call_based_and_packed_tests() -> None:
    import base64
    import zlib

    env = await session(**FAST)
    packed = base64.b64encode(
        zlib.compress(json.dumps({"inputs": ["[1,2]", "[3]"], "outputs": ["[2, 1]", "[3]"]}).encode())
    )
    task = {"verifier_metadata": {"unit_tests": {"packed": packed.decode(), "fn_name": "rev"}, "difficulty": "easy"}}
    code = "class Solution:\n    def rev(self, xs):\n        return tuple(reversed(xs))"  # a tuple counts as a list
    out = await env.verify(task, fenced(code))
    assert out.reward == 1.0 and out.fields["result"] == [True, True] and out.fields["difficulty"] == "easy"
    close = {"verifier_metadata": {"unit_tests": {"inputs": ["1\n3"], "outputs": ["0.3333333333"], "fn_name": "div"}}}
    out = await env.verify(close, fenced("class Solution:\n    def div(self, a, b):\n        return a / b + 1e-9"))
    assert out.reward == 1.0


async def test_bad_task_rows_raise() -> None:
    env = await session(**FAST)
    with pytest.raises(Failure, match="invalid_task: task row: verifier_metadata.unit_tests is missing"):
        await env.verify({"verifier_metadata": {}}, fenced(ADD_OK))  # the row, not the program: not retried
    with pytest.raises(ValueError, match="unknown field"):
        await CodeGen.setup({"num_procs": 3})


# ----------------------------------------------------------------------------- the sandbox


async def test_infinite_loop_times_out(sandbox_dirs: set[str]) -> None:
    env = await session(**FAST)
    out = await env.verify(ADD, fenced("while True:\n    pass"))
    assert out.reward == 0.0
    assert out.fields["result"] == [-3] and out.fields["metadata"]["error"] == "TimeoutException()"
    await still_works(env)
    no_sandbox_left(sandbox_dirs)


async def test_program_that_ignores_the_timer_is_killed_at_the_wall_clock(sandbox_dirs: set[str]) -> None:
    env = await session(**{**FAST, "wall_time_s": 1.0, "unit_test_timeout_secs": 5})
    # sleeping uses no CPU: only the wall clock (shorter here than the worker's clock per test) can end this one
    code = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ntime.sleep(60)"
    start = time.monotonic()
    out = await env.verify(ADD, fenced(code))
    assert time.monotonic() - start < 10
    assert out.reward == 0.0 and out.fields["result"] == [-1, -1] and out.fields["metadata"] is None
    await still_works(env)
    no_sandbox_left(sandbox_dirs)


async def test_cpu_limit_kills_a_busy_program(sandbox_dirs: set[str]) -> None:
    env = await session(**{**FAST, "wall_time_s": 30, "unit_test_timeout_secs": 25, "cpu_time_s": 1})
    code = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass"
    start = time.monotonic()
    out = await env.verify(ADD, fenced(code))
    assert time.monotonic() - start < 25  # the CPU limit (1 s of CPU), not the 30 s wall clock
    assert out.reward == 0.0 and out.fields["result"] == [-1, -1]
    await still_works(env)
    no_sandbox_left(sandbox_dirs)


async def test_allocating_10_gb_fails() -> None:
    env = await session(**FAST)
    code = "x = bytearray(10 * 1024 ** 3)\nprint(3)"
    out = await env.verify(ADD, fenced(code))
    assert out.reward == 0.0
    assert out.fields["result"] == [-4] and out.fields["metadata"]["error"] == "MemoryError()"
    await still_works(env)


async def test_network_is_denied() -> None:
    env = await session(**FAST)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('denied', e)"
        )
        out = await env.verify(stdio_task(["\n"], ["connected\n"]), fenced(code))
        assert out.reward == 0.0, "the sandboxed program reached the test's socket"
        assert out.fields["metadata"]["output"].startswith("denied")
        server.settimeout(0.1)
        with pytest.raises(socket.timeout):
            server.accept()
    await still_works(env)


async def test_worker_environment_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYM_TEST_SECRET", SECRET)
    env = await session(**FAST)
    # Print every trace of the secret the program can find: the own environment,
    # and every /proc/*/environ it can read (the worker's among them, if visible).
    code = (
        "import os, glob\n"
        "found = [v for v in os.environ.values() if 'gym-test' in v]\n"
        "for p in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        data = open(p, 'rb').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if b'GYM_TEST_SECRET' in data:\n"
        "        found.append(p)\n"
        "print(' '.join(found) or 'nothing')\n"
        "print(sorted(os.environ))"
    )
    out = await env.verify(stdio_task(["\n"], [f"{SECRET}\n"]), fenced(code))
    assert out.reward == 0.0
    output = out.fields["metadata"]["output"]
    assert output.startswith("nothing") and SECRET not in output
    assert "GYM_TEST_SECRET" not in output
    await still_works(env)


async def test_huge_output_is_cut() -> None:
    env = await session(**{**FAST, "max_output_mb": 1})
    code = "import sys\nline = 'x' * 100000\nwhile True:\n    sys.stdout.write(line)"
    out = await env.verify(ADD, fenced(code))
    # stopped at the cap (-2), not by the 0.5 s timer (-3)
    assert out.reward == 0.0 and out.fields["result"] == [-2]
    assert "output over the limit" in out.fields["metadata"]["error_message"]
    await still_works(env)


async def test_files_and_processes_are_confined(tmp_path: Path, sandbox_dirs: set[str]) -> None:
    env = await session(**{**FAST, "max_processes": 16})
    outside = tmp_path / "outside.txt"
    code = (
        "import ctypes, os\n"
        "res = []\n"
        f"for p in [{str(REPO / 'pyproject.toml')!r}, '/etc/shadow']:\n"
        "    try:\n"
        "        open(p).read(1); res.append('read ' + p)\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        f"    open({str(outside)!r}, 'w').write('x'); res.append('wrote outside')\n"
        "except OSError:\n"
        "    pass\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "libc = ctypes.CDLL(None)\n"
        "n = 0\n"
        "while n < 1000:\n"
        "    pid = libc.fork()\n"
        "    if pid == 0:\n"
        "        import time; time.sleep(60); os._exit(0)\n"
        "    if pid < 0:\n"
        "        break\n"
        "    n += 1\n"
        "res.append('forked %d' % n)\n"
        "print(res)"
    )
    out = await env.verify(stdio_task(["\n"], ["x\n"]), fenced(code))
    assert out.reward == 0.0
    printed = out.fields["metadata"]["output"]
    assert "read" not in printed and "wrote outside" not in printed and not outside.exists()
    forked = int(printed.split("forked ")[1].split("'")[0])
    assert forked < 16  # RLIMIT_NPROC
    no_sandbox_left(sandbox_dirs)  # the sleeping children died with the sandbox
    await still_works(env)


async def test_sandbox_runs_do_not_block_the_event_loop_and_respect_max_parallel() -> None:
    env = await session(**{**FAST, "max_parallel": 1})
    runner = env._get_runner()
    ticks = 0
    peak = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks, peak
        while not done.is_set():
            ticks += 1
            peak = max(peak, runner.running)
            await anyio.sleep(0.01)

    slow = "import time\ntime.sleep(0.3)\na, b = map(int, input().split())\nprint(a + b)"
    rewards: list[float] = []

    async def one() -> None:
        rewards.append((await env.verify(stdio_task(["1 2\n"], ["3\n"]), fenced(slow))).reward)

    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with anyio.create_task_group() as inner:
            inner.start_soon(one)
            inner.start_soon(one)
        done.set()
    assert rewards == [1.0, 1.0]
    assert peak == 1  # max_parallel
    assert time.monotonic() - start >= 0.6  # the two runs waited for each other
    assert ticks >= 10  # the loop kept running meanwhile


async def test_sandbox_reports_its_layers() -> None:
    async with JailRunner(1).session(HARNESS, Limits(wall_s=10)) as s:
        layers = s.layers
    assert layers["landlock_fs"] and layers["caps_dropped"] and layers["rlimits"] and layers["seccomp"]
    assert layers["cgroup"] or layers["single_process"]
    assert layers["unprivileged_uid"] or not layers["root"]
    assert layers["missing"] == []


def test_missing_layers_fail_closed() -> None:
    full: dict = {"netns": True, "landlock_fs": True, "caps_dropped": True, "rlimits": True, "seccomp": True}
    full["cgroup"] = 1
    assert Layers(**full).check() == []
    assert Layers(**{**full, "cgroup": 0, "single_process": True}).check() == []
    assert Layers(**{**full, "seccomp": False}).check()  # no system call filter
    assert Layers(**{**full, "landlock_fs": False}).check()  # no Landlock
    assert Layers(**{**full, "cgroup": 0}).check()  # no limit on the sandbox as a whole
    assert Layers(**{**full, "root": True}).check()  # root that did not leave root
    assert Layers(**{**full, "root": True, "unprivileged_uid": True}).check() == []


async def test_setup_error_is_not_a_reward() -> None:
    runner = JailRunner(1, python="/bin/false")
    with pytest.raises(JailError):
        async with runner.session(HARNESS, Limits(wall_s=5)):
            pass


def test_config_loads() -> None:
    cfg = load_config(ENV_DIR / "config.yaml")
    res = cfg.resources["code_gen"]
    assert res.server == "resources.code_gen"
    msgspec.convert(res.options, CodeGenOptions)
    assert find_resource_class(import_plugin(res.server)) is CodeGen
