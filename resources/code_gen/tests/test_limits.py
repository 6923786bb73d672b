"""Issue 26, programs under grading: limits the program cannot switch off, results that cannot stall the worker,
and the rest of the sandbox (memory outside the limit, exec from memory, kernel calls), through ``CodeGen.verify``.

Each test is an attack the red team ran; it asserts the attack earns nothing *and* that the worker is unharmed
(its event loop kept ticking, its memory did not grow, the next program is graded).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import anyio
import psutil
import pytest

from gym_runtime.jail import landlock_abi
from gym_runtime.resources.code_gen import CodeGen
from gym_runtime.resources.code_gen.calls import judge_call
from tests.helpers import cli, read_jsonl, write_jsonl

from .programs import ADD, FAST, SYSCALLS, fenced, session, stdio_task, still_works

pytestmark = pytest.mark.skipif(landlock_abi() < 1, reason="the sandbox needs Linux with Landlock")

ADD_CALL = {
    "verifier_metadata": {"unit_tests": {"inputs": ["1\n2", "10\n-3"], "outputs": ["3", "7"], "fn_name": "add"}}
}
ADD_CALL_OK = "class Solution:\n    def add(self, a, b):\n        return a + b"


def printed(out: Any) -> str:
    meta = out.fields["metadata"]
    assert meta is not None and "output" in meta, f"the program did not run to its report: {out.fields}"
    return meta["output"]


# ----------------------------------------------------------------------------- per-test time

# Each answers correctly, after 1.2 s per test against a 0.5 s limit, with the in-sandbox timer out of the way.
SLOW = "time.sleep(1.2)"
TIMER_OFF = {
    "setitimer-0": f"import signal, time\nsignal.setitimer(signal.ITIMER_REAL, 0)\n{SLOW}\n",
    "sig-ign": f"import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n{SLOW}\n",
    "caught": (
        "import time\nend = time.monotonic() + 1.2\nwhile time.monotonic() < end:\n"
        "    try:\n        time.sleep(max(0, end - time.monotonic()))\n    except BaseException:\n        pass\n"
    ),
}


@pytest.mark.parametrize("how", list(TIMER_OFF))
async def test_per_test_time_limit_cannot_be_switched_off(how: str) -> None:
    env = await session(**FAST)  # 0.5 s per test, 3 s for the whole run: 2 x 1.2 s fits the latter
    start = time.monotonic()
    out = await env.verify(ADD, fenced(TIMER_OFF[how] + "a, b = map(int, input().split())\nprint(a + b)"))
    assert out.reward == 0.0 and out.fields["result"] == [-3], out.fields
    meta = out.fields["metadata"]
    assert meta["error_code"] == -3 and meta["error_message"] == "Time Limit Exceeded"
    assert time.monotonic() - start < 2.5  # the first test was ended, not waited for
    await still_works(env)


async def test_per_test_time_limit_holds_for_calls_and_for_loading() -> None:
    env = await session(**FAST)
    body = TIMER_OFF["setitimer-0"].replace("\n", "\n        ")
    slow_call = f"class Solution:\n    def add(self, a, b):\n        {body}\n        return a + b"
    out = await env.verify(ADD_CALL, fenced(slow_call))
    assert out.reward == 0.0 and out.fields["result"] == [-3], out.fields
    # the work done at load time instead (module level of a call-based program): NeMo Gym's timed-out load, [-4]
    slow_load = TIMER_OFF["sig-ign"] + ADD_CALL_OK
    out = await env.verify(ADD_CALL, fenced(slow_load))
    assert out.reward == 0.0 and out.fields["result"] == [-4], out.fields
    assert out.fields["metadata"]["error_message"].startswith("Error during testing")


# ----------------------------------------------------------------------------- CPU

RAISE_CPU_LIMIT = """
import ctypes, signal, time
signal.signal(signal.SIGXCPU, signal.SIG_IGN)
signal.signal(signal.SIGALRM, signal.SIG_IGN)
class R(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
libc = ctypes.CDLL(None)
r = R()
libc.getrlimit(0, ctypes.byref(r))  # RLIMIT_CPU
r.cur = r.max
libc.setrlimit(0, ctypes.byref(r))
t = time.process_time()
while time.process_time() - t < 1.7:
    pass
a, b = map(int, input().split())
print(a + b)
"""

# Four processes of 0.9 s each (threads where no process may start: the fallback without a cgroup).
FOUR_BURNERS = """
import ctypes, os, signal, threading, time
signal.signal(signal.SIGALRM, signal.SIG_IGN)
def burn():
    clock = time.process_time if threading.current_thread() is threading.main_thread() else time.thread_time
    t = clock()
    while clock() - t < 0.9:
        pass
libc = ctypes.CDLL(None)
pids, threads = [], []
for _ in range(3):
    pid = libc.fork()
    if pid == 0:
        burn()
        os._exit(0)
    if pid > 0:
        pids.append(pid)
    else:
        threads.append(threading.Thread(target=burn))
        threads[-1].start()
burn()
for p in pids:
    os.waitpid(p, 0)
for t in threads:
    t.join()
a, b = map(int, input().split())
print(a + b)
"""


async def test_cpu_limit_cannot_be_raised_by_the_program() -> None:
    env = await session(**{**FAST, "wall_time_s": 30, "unit_test_timeout_secs": 25, "cpu_time_s": 1})
    out = await env.verify(stdio_task(["1 2\n"], ["3\n"]), fenced(RAISE_CPU_LIMIT))
    assert out.reward == 0.0 and out.fields["result"] == [-1], out.fields
    await still_works(env)


@pytest.mark.parametrize("use_cgroup", [True, False], ids=["cgroup-or-fallback", "fallback"])
async def test_cpu_limit_holds_for_the_sandbox_as_a_whole(use_cgroup: bool) -> None:
    opts = {"wall_time_s": 30, "unit_test_timeout_secs": 25, "cpu_time_s": 1, "use_cgroup": use_cgroup}
    env = await session(**{**FAST, **opts})
    out = await env.verify(stdio_task(["1 2\n"], ["3\n"]), fenced(FOUR_BURNERS))
    assert out.reward == 0.0 and out.fields["result"] == [-1], out.fields
    await still_works(env)


async def test_an_honest_program_under_the_cpu_limit_passes() -> None:
    env = await session(**{**FAST, "wall_time_s": 30, "unit_test_timeout_secs": 25, "cpu_time_s": 3})
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nprint(3)"
    out = await env.verify(stdio_task(["1 2\n"], ["3\n"]), fenced(code))
    assert out.reward == 1.0, out.fields


# ----------------------------------------------------------------------------- output caps


async def test_output_cap_is_not_measured_on_the_programs_objects() -> None:
    env = await session(**{**FAST, "max_output_mb": 1})
    size = 3 << 20
    code = (
        "import sys\n"
        "class Short(str):\n"
        "    def __len__(self):\n"
        "        return 0\n"
        f"sys.stdout.write(Short('x' * {size}))\n"
    )
    out = await env.verify(stdio_task(["\n"], ["x" * size]), fenced(code))
    assert out.reward == 0.0 and out.fields["result"] == [-2], out.fields["result"]
    assert "output over the limit" in out.fields["metadata"]["error_message"]
    # and an honest over-cap write the same
    out = await env.verify(stdio_task(["\n"], ["x" * size]), fenced(f"print('x' * {size})"))
    assert out.reward == 0.0 and out.fields["result"] == [-2]
    await still_works(env)


async def test_non_ascii_output_under_the_cap_in_bytes_passes() -> None:
    """The cap counts the UTF-8 bytes the program wrote, not their escaped form on the way."""
    env = await session(**{**FAST, "max_output_mb": 1, "unit_test_timeout_secs": 5, "wall_time_s": 20})
    unit = "\U0001f600é中\x01"  # 4 + 2 + 3 + 1 bytes; escaped in JSON: 12 + 6 + 6 + 6
    text = unit * int(0.9 * (1 << 20) / len(unit.encode()))
    code = f"import sys\nsys.stdout.write({text!r})"
    out = await env.verify(stdio_task(["\n"], [text]), fenced(code))
    assert out.reward == 1.0, out.fields["result"]
    over = unit * int(1.1 * (1 << 20) / len(unit.encode()))
    out = await env.verify(stdio_task(["\n"], [over]), fenced(f"import sys\nsys.stdout.write({over!r})"))
    assert out.fields["result"] == [-2]


# ----------------------------------------------------------------------------- the worker's event loop and memory


def _runqueue_wait_s() -> float | None:
    """Seconds this thread has waited for a CPU while runnable (the kernel's schedstat), None where unknown."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class LoopWatch:
    """Measures the longest stall of this event loop and the growth of this process's memory meanwhile.

    A stall is the time between two of the watcher's ticks less the time the loop's thread was runnable but
    waiting for a CPU (``/proc/self/task/TID/schedstat``): what the loop's own work (a result decoded or
    compared on it) or a block (a sleep, the GIL held elsewhere) costs, whatever the machine's load. The wall
    clock alone also counted the time a loaded machine did not run the process (0.7-0.9 s under ``pytest -n 4``
    on 2 cores, for a loop that never blocked). Without schedstat: the thread's CPU time between the ticks."""

    def __init__(self) -> None:
        self.gap = 0.0  # the longest stall (s)
        self.rss_growth = 0
        self._done = anyio.Event()

    @staticmethod
    def _clock() -> float:
        waited = _runqueue_wait_s()
        return time.thread_time() if waited is None else time.monotonic() - waited

    async def run(self) -> None:
        proc = psutil.Process()
        base = proc.memory_info().rss
        last = self._clock()
        while not self._done.is_set():
            await anyio.sleep(0.01)
            now = self._clock()
            self.gap = max(self.gap, now - last - 0.01)  # less the tick's own sleep
            self.rss_growth = max(self.rss_growth, proc.memory_info().rss - base)
            last = self._clock()  # psutil's own read is not the loop's stall

    def stop(self) -> None:
        self._done.set()


async def watched(env: CodeGen, task: dict[str, Any], code: str) -> tuple[Any, LoopWatch]:
    watch = LoopWatch()
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch.run)

        async def one() -> None:
            result.append(await env.verify(task, fenced(code)))
            watch.stop()

        tg.start_soon(one)
    return result[0], watch


# A result that is a set of 40,000 ints that all hash to 0 (995 KB of JSON): building it is quadratic.
# (Built in the sandbox it would cost the program the same; so the program writes the data itself.)
COLLIDING_SET = """
import gc, inspect, json, os
class Solution:
    def add(self, a, b):
        ch = [o for o in gc.get_objects() if type(o).__name__ == 'Channel'][0]
        data = {"$": "set", "items": [k * (2 ** 61 - 1) for k in range(1, 40001)]}
        if 'body' in inspect.signature(ch.send).parameters:
            ch.send({"kind": "output", "text": "x", "text_error": None}, json.dumps(data).encode())
        else:
            ch.send({"kind": "output", "value": data, "text": "x", "text_error": None})
        ch.recv()
        os._exit(0)
"""


async def test_hash_colliding_result_does_not_stall_the_worker() -> None:
    env = await session(**{**FAST, "wall_time_s": 20, "unit_test_timeout_secs": 10})
    out, watch = await watched(env, ADD_CALL, COLLIDING_SET)
    assert out.reward == 0.0 and out.fields["result"][0] is False, out.fields["result"]
    assert watch.gap < 0.5, f"the event loop stalled {watch.gap:.1f} s"
    await still_works(env)


async def test_a_result_of_millions_of_empty_lists_is_not_decoded_into_the_worker() -> None:
    # generous clocks: writing and comparing 16 MB took 21 s at load 10 on 2 cores (a timeout is -3, not False)
    env = await session(**{**FAST, "wall_time_s": 120, "unit_test_timeout_secs": 90, "max_output_mb": 16})
    code = "class Solution:\n    def add(self, a, b):\n        return [[]] * 4_000_000"  # 16 MB of '[], '
    out, watch = await watched(env, ADD_CALL, code)
    assert out.reward == 0.0 and out.fields["result"][0] is False, out.fields["result"]
    assert watch.gap < 0.5, f"the event loop stalled {watch.gap:.1f} s"
    assert watch.rss_growth < 120 << 20, f"the worker grew {watch.rss_growth >> 20} MiB"
    await still_works(env)


async def test_hostile_results_cost_no_neighbour_its_reward() -> None:
    """Two hostile rollouts beside four honest ones on one worker: the honest ones are graded, promptly."""
    env = await session(**{**FAST, "wall_time_s": 20, "unit_test_timeout_secs": 10, "max_parallel": 2})
    rewards: dict[str, list[float]] = {"honest": [], "hostile": []}
    took: list[float] = []

    async def one(kind: str) -> None:
        start = time.monotonic()
        code = ADD_CALL_OK if kind == "honest" else COLLIDING_SET
        rewards[kind].append((await env.verify(ADD_CALL, fenced(code))).reward)
        if kind == "honest":
            took.append(time.monotonic() - start)

    async with anyio.create_task_group() as tg:
        for kind in ["hostile", "hostile", "honest", "honest", "honest", "honest"]:
            tg.start_soon(one, kind)
    assert rewards == {"honest": [1.0] * 4, "hostile": [0.0, 0.0]}
    assert max(took) < 10, took


def test_comparison_has_no_quadratic_path() -> None:
    """Hash collisions, deep nesting and huge repeats: each compare is linear and bounded."""
    collide = json.dumps({"$": "set", "items": [k * (2**61 - 1) for k in range(1, 40001)]}).encode()
    keys = json.dumps({"$": "dict", "items": [[k * (2**61 - 1), 1] for k in range(1, 40001)]}).encode()
    tuple_set = json.dumps(
        {"$": "frozenset", "items": [{"$": "tuple", "items": [k * (2**61 - 1)]} for k in range(1, 40001)]}
    ).encode()
    deep = b'{"$": "tuple", "items": [' * 200 + b"1" + b"]}" * 200
    repeats = json.dumps([[]] * 2_000_000).encode()
    big = json.dumps(list(range(40000)))  # an expected output as large: no shortcut by counting values
    big_dict = json.dumps({str(k): 1 for k in range(40000)})
    for data, expected in [
        (collide, "[1]"),
        (collide, big),
        (keys, '{"1": 1}'),
        (keys, big_dict),
        (tuple_set, big),
        (deep, "[1]"),
        (repeats, "[]"),
    ]:
        start = time.monotonic()
        assert judge_call(data, expected) is False
        assert time.monotonic() - start < 5.0, data[:40]  # linear: < 0.3 s idle; the quadratic path took 17.6 s


# ----------------------------------------------------------------------------- the rest of the sandbox

SHARED_MEMORY = """
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.shmat.restype = ctypes.c_void_p
chunk = 64 << 20
memfds = shms = 0
keep = []
for i in range(16):
    fd = libc.syscall(319, b"x", 0)  # memfd_create
    if fd >= 0:
        try:
            os.ftruncate(fd, chunk)
            m = mmap.mmap(fd, chunk)
            for j in range(0, chunk, 4096):
                m[j] = 1
            m.close()
            keep.append(fd)
            memfds += 1
        except (OSError, ValueError):
            os.close(fd)
    sid = libc.shmget(0, ctypes.c_size_t(chunk), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if sid >= 0:
        addr = libc.shmat(sid, None, 0)
        if addr not in (None, ctypes.c_void_p(-1).value):
            ctypes.memset(addr, 1, chunk)
            libc.shmdt(ctypes.c_void_p(addr))
            shms += 1
print('memfd', memfds, 'sysv', shms)
"""


async def test_shared_memory_is_refused_without_a_cgroup() -> None:
    opts = {"wall_time_s": 30, "unit_test_timeout_secs": 25, "memory_mb": 256, "use_cgroup": False}
    env = await session(**{**FAST, **opts})
    out = await env.verify(stdio_task(["\n"], ["memfd 16 sysv 16\n"]), fenced(SHARED_MEMORY))
    assert out.reward == 0.0
    assert printed(out) == "memfd 0 sysv 0\n"
    await still_works(env)


async def test_shared_memory_counts_against_the_cgroup() -> None:
    opts = {"wall_time_s": 30, "unit_test_timeout_secs": 25, "memory_mb": 256}
    env = await session(**{**FAST, **opts})
    out = await env.verify(stdio_task(["\n"], ["memfd 16 sysv 16\n"]), fenced(SHARED_MEMORY))
    assert out.reward == 0.0
    meta = out.fields["metadata"]
    if meta is not None and "output" in meta:  # not killed: it held less than the limit
        words = meta["output"].split()
        assert (int(words[1]) + int(words[3])) * 64 < 256, meta["output"]
    await still_works(env)


EXEC_FROM_MEMORY = """
import ctypes, errno, os, shutil
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
image = open('/bin/true', 'rb').read()
res = []
def err():
    return errno.errorcode.get(ctypes.get_errno(), '?')
fd = libc.syscall(319, b"x", 0)  # memfd_create
if fd < 0:
    res.append('memfd=' + err())
else:
    os.write(fd, image)
    pid = libc.fork()
    if pid == 0:
        argv = (ctypes.c_char_p * 2)(b"true", None)
        libc.syscall(322, fd, b"", argv, argv, 0x1000)  # execveat(fd, "", AT_EMPTY_PATH)
        os._exit(99)
    st = os.waitpid(pid, 0)[1] if pid > 0 else -1
    res.append('memfd-exec=' + ('ran' if pid > 0 and os.waitstatus_to_exitcode(st) == 0 else 'refused'))
# a file only in memory: an unnamed file of the tmpfs working directory, run through /proc/self/fd
try:
    tfd = os.open('.', os.O_TMPFILE | os.O_RDWR, 0o700)
    os.write(tfd, image)
    os.fchmod(tfd, 0o700) if os.fchmod else None
    try:
        pid = os.posix_spawn(f'/proc/self/fd/{tfd}', ['true'], {})
        res.append('procfd-exec=' + ('ran' if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 else 'failed'))
    except OSError as e:
        res.append('procfd-exec=' + errno.errorcode.get(e.errno, '?'))
except OSError as e:
    res.append('tmpfile=' + errno.errorcode.get(e.errno, '?'))
with open('prog', 'wb') as f:
    f.write(image)
os.chmod('prog', 0o700) if os.chmod else None
try:
    pid = os.posix_spawn('./prog', ['prog'], {})
    res.append('file-exec=' + ('ran' if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 else 'failed'))
except OSError as e:
    res.append('file-exec=' + errno.errorcode.get(e.errno, '?'))
print(' '.join(res))
"""


async def test_no_exec_from_memory() -> None:
    env = await session(**{**FAST, "wall_time_s": 10, "unit_test_timeout_secs": 8})
    out = await env.verify(stdio_task(["\n"], ["ran\n"]), fenced(EXEC_FROM_MEMORY))
    got = printed(out).split()
    assert got[0] == "memfd=EPERM", got
    assert got[1] in ("procfd-exec=EACCES", "procfd-exec=EPERM"), got
    assert got[2] in ("file-exec=EACCES", "file-exec=EPERM"), got
    await still_works(env)


KERNEL_CALLS = f"""{SYSCALLS}allow = (ctypes.c_ulonglong * 1)(0x7FFF0000 << 0)  # one instruction: return ALLOW
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
ins = (ctypes.c_uint64 * 1)((0x7FFF0000 << 32) | 0x06)
prog = Prog(1, ctypes.cast(ins, ctypes.c_void_p))
buf = ctypes.create_string_buffer(64)
res = [
    tryit('personality', 135, 0x0040000),  # ADDR_NO_RANDOMIZE
    tryit('seccomp', 317, 1, 8, ctypes.byref(prog)),  # SET_MODE_FILTER with a NEW_LISTENER
    tryit('prctl-seccomp', 157, 22, 2, ctypes.byref(prog), 0, 0),
    tryit('pidfd_open', 434, os.getpid(), 0),
    tryit('modify_ldt', 154, 0, buf, 16),
    tryit('memfd_secret', 447, 0),
    tryit('prctl-dumpable', 157, 4, 1, 0, 0, 0),
    tryit('prctl-mm', 157, 35, 8, 0, 0, 0),
]
print(' '.join(res))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 system call numbers")
async def test_kernel_calls_outside_the_allow_list_are_refused() -> None:
    env = await session(**FAST)
    out = await env.verify(stdio_task(["\n"], ["ok\n"]), fenced(KERNEL_CALLS))
    got = printed(out).split()
    assert got == [
        "personality=EPERM",
        "seccomp=EPERM",
        "prctl-seccomp=EPERM",
        "pidfd_open=EPERM",
        "modify_ldt=EPERM",
        "memfd_secret=EPERM",
        "prctl-dumpable=EPERM",
        "prctl-mm=EPERM",
    ]
    # what programs do need still works: asking for the personality, threads, asyncio's socketpair
    code = (
        "import ctypes, threading, asyncio\n"
        "libc = ctypes.CDLL(None)\n"
        "assert libc.personality(0xFFFFFFFF) >= 0\n"
        "t = threading.Thread(target=print, args=()); t.start(); t.join()\n"
        "asyncio.run(asyncio.sleep(0))\n"
        "a, b = map(int, input().split())\nprint(a + b)"
    )
    assert (await env.verify(ADD, fenced(code))).reward == 1.0


# ----------------------------------------------------------------------------- a whole run


def _row(i: int, code: str) -> tuple[dict[str, Any], dict[str, Any]]:
    task = {
        "responses_create_params": {"input": [{"role": "user", "content": f"Task {i}: add two numbers."}]},
        **ADD_CALL,
    }
    text = f"Here you go.\n\n```python\n{code}\n```\n"
    message = {
        "id": f"msg_{i}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return task, {**task, "response": {"id": f"resp_{i}", "created_at": 0.0, "output": [message]}}


def test_hostile_rollouts_beside_honest_ones_in_a_whole_run(tmp_path: Any) -> None:
    """`gym-runtime run`, one code_gen worker: 3 hostile rollouts (hash-colliding results) among 8 honest ones.

    On main the hostile comparisons blocked the worker's event loop for seconds each and honest rollouts on
    the same worker became ``worker_lost`` failure rows. Every honest one must get its 1.0.
    """
    hostile = {1, 5, 9}
    pairs = [_row(i, COLLIDING_SET if i in hostile else ADD_CALL_OK) for i in range(11)]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [t for t, _ in pairs])
    recorded = write_jsonl(tmp_path / "recorded.jsonl", [r for _, r in pairs])
    out = tmp_path / "out.jsonl"
    res = cli(
        "run",
        "resources/code_gen/config.yaml",
        "-i",
        str(tasks),
        "-o",
        str(out),
        "-q",
        "--processes",
        "one",
        "--set",
        "models.policy.adapter=replay",
        "--set",
        f"models.policy.rollouts={recorded}",
        "--set",
        "resources.code_gen.options.max_parallel=4",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_jsonl(out)
    failures = tmp_path / "out_failures.jsonl"
    lost = [r for r in read_jsonl(failures)] if failures.exists() else []
    assert lost == [], [r.get("error") for r in lost][:3]
    by_task = {r["responses_create_params"]["input"][0]["content"]: r for r in rows}
    assert len(by_task) == 11
    for i in range(11):
        row = by_task[f"Task {i}: add two numbers."]
        assert row["reward"] == (0.0 if i in hostile else 1.0), (i, row.get("result"))
