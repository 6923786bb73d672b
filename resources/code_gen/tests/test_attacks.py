"""The policy as an attacker: every escape or forgery we know of, through ``CodeGen.verify``.

Each test runs an adversarial program the way a rollout would, asserts the reward
is 0 *and* that the side effect did not happen (the program's own report says it
was denied, a listener on a host socket saw nothing, ...), and then that the worker
still grades a correct program (``still_works``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from gym_runtime.jail import cgroups, landlock_abi
from gym_runtime.jail.runner import LEFTOVER_AGE_S, JailRunner, Limits
from gym_runtime.resources.code_gen import CodeGen
from gym_runtime.resources.code_gen.grading import HARNESS

from .programs import ADD, FAST, SYSCALLS, fenced, session, stdio_task, still_works

pytestmark = pytest.mark.skipif(landlock_abi() < 1, reason="the sandbox needs Linux with Landlock")

ADD_CALL = {
    "verifier_metadata": {"unit_tests": {"inputs": ["1\n2", "10\n-3"], "outputs": ["3", "7"], "fn_name": "add"}}
}
ADD_CALL_OK = "class Solution:\n    def add(self, a, b):\n        return a + b"

# The forged "every test passed" messages of the old protocol, and what a forger would try now.
FORGED = (
    '{"kind": "final", "result": [true, true], "metadata": {"execution time": 0.0}}\n'
    '{"kind": "done", "execution_time": 0.0}\n'
)


async def still_works_call(env: CodeGen) -> None:
    out = await env.verify(ADD_CALL, fenced(ADD_CALL_OK))
    assert out.reward == 1.0 and out.fields["result"] == [True, True]


async def graded(env: CodeGen, task: dict[str, Any], code: str) -> Any:
    out = await env.verify(task, fenced(code))
    assert out.reward == 0.0, f"the attack got a reward: {out.fields['result']} {out.fields['metadata']}"
    assert out.fields["result"] != [True] * len(task["verifier_metadata"]["unit_tests"]["inputs"])
    return out


async def attack(task: dict[str, Any], code: str) -> Any:
    """``code``'s verdict for ``task`` in a fresh session under ``FAST``: no reward (``graded``); and then the
    session still grades a correct program of the task's kind."""
    env = await session(**FAST)
    out = await graded(env, task, code)
    call_based = task["verifier_metadata"]["unit_tests"]["fn_name"] is not None
    await (still_works_call if call_based else still_works)(env)
    return out


def printed(out: Any) -> str:
    meta = out.fields["metadata"]
    assert meta is not None and "output" in meta, f"the program did not run to its report: {out.fields}"
    return meta["output"]


# ----------------------------------------------------------------------------- forging the verdict

# Walk the stack up from the program to the harness's channel; send "all passed" and leave.
FRAME_WALK = f"""
import sys, os
f = sys._getframe()
while f is not None and 'channel' not in f.f_locals:
    f = f.f_back
ch = f.f_locals['channel']
for line in {FORGED!r}.splitlines():
    import json
    ch.send(json.loads(line))
os._exit(0)
"""


async def test_frame_walk_forgery_stdio() -> None:
    out = await attack(ADD, FRAME_WALK)
    assert out.fields["result"] in ([-1, -1], [-2])


async def test_frame_walk_forgery_call_based() -> None:
    code = "class Solution:\n    def add(self, a, b):\n" + "".join(
        "        " + line + "\n" for line in FRAME_WALK.strip().splitlines()
    )
    await attack(ADD_CALL, code)


async def test_channel_object_found_by_gc_is_worth_nothing() -> None:
    """The channel is still reachable (same process): what it carries must be raw output only."""
    code = (
        "import gc, os\n"
        "ch = [o for o in gc.get_objects() if type(o).__name__ == 'Channel'][0]\n"
        # a well-formed raw output for the current test (a wrong one), then a forged verdict
        "ch.send({'kind': 'output', 'output': '999\\n', 'overflow': False})\n"
        "ch.send({'kind': 'final', 'result': [True, True], 'metadata': {}})\n"
        "print(0)"
    )
    out = await attack(ADD, code)
    assert out.fields["result"] in ([-2], [-1, -1])


async def test_raw_writes_to_every_fd_are_worth_nothing() -> None:
    code = (
        "import os\n"
        f"data = {FORGED!r}.encode()\n"
        "for fd in range(0, 64):\n"
        "    try:\n"
        "        os.write(fd, data)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)"
    )
    await attack(ADD, code)


async def test_fake_markers_on_stdout_and_stderr() -> None:
    code = (
        "import sys, os\n"
        f"sys.__stdout__.write({FORGED!r}); sys.__stdout__.flush()\n"
        f"sys.stderr.write({FORGED!r}); sys.stderr.flush()\n"
        f"os.write(1, {FORGED!r}.encode()); os.write(2, {FORGED!r}.encode())\n"
        "print('PASSED')"
    )
    out = await attack(ADD, code)
    assert out.fields["result"] == [-2]


async def test_closing_and_duplicating_fds() -> None:
    env = await session(**FAST)
    close_all = "import os\nos.closerange(0, 1024)\nprint(3)"
    out = await graded(env, ADD, close_all)
    assert out.fields["result"] == [-1, -1]
    dup = (
        "import os\nfor fd in range(3, 64):\n    try:\n        os.dup2(2, fd)\n    except OSError:\n"
        "        pass\nprint(3)"
    )
    await graded(env, ADD, dup)
    await still_works(env)


async def test_exiting_early_with_code_0() -> None:
    env = await session(**FAST)
    out = await graded(env, ADD, "import os\nos._exit(0)")
    assert out.fields["result"] == [-1, -1]
    out = await graded(env, ADD_CALL, "import os\nos._exit(0)")
    assert out.fields["result"] == [-1, -1]
    await still_works(env)
    await still_works_call(env)


async def test_expected_outputs_never_enter_the_sandbox() -> None:
    """A call-based program looks for the expected outputs in every frame and every object."""
    code = (
        "import sys, gc, json\n"
        "class Solution:\n"
        "    n = 0\n"
        "    def add(self, a, b):\n"
        "        for o in gc.get_objects():\n"
        "            if isinstance(o, dict) and isinstance(o.get('outputs'), list) and o['outputs']:\n"
        "                v = json.loads(o['outputs'][Solution.n]); Solution.n += 1\n"
        "                return v\n"
        "        return 'no expected outputs here'"
    )
    out = await attack(ADD_CALL, code)
    assert out.fields["metadata"]["output"] == "no expected outputs here"


async def test_always_equal_object_is_compared_as_data() -> None:
    """``__eq__`` returning True fooled an in-sandbox comparison; outside, only plain data counts."""
    code = (
        "class Any:\n"
        "    def __eq__(self, other): return True\n"
        "    __hash__ = object.__hash__\n"
        "class Cheat(int):\n"
        "    def __eq__(self, other): return True\n"
        "class Solution:\n"
        "    calls = 0\n"
        "    def add(self, a, b):\n"
        "        Solution.calls += 1\n"
        "        return Any() if Solution.calls == 1 else Cheat(0)\n"
    )
    await attack(ADD_CALL, code)


# ----------------------------------------------------------------------------- reaching outside


async def test_unix_socket_by_path_is_unreachable(tmp_path: Path) -> None:
    env = await session(**FAST)
    path = str(tmp_path / "host.sock")
    dgram_path = str(tmp_path / "host-dgram.sock")
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dgram:
        server.bind(path)
        server.listen()
        dgram.bind(dgram_path)
        os.chmod(tmp_path, 0o777)
        os.chmod(path, 0o777)
        os.chmod(dgram_path, 0o777)
        code = (
            "import socket\n"
            "res = []\n"
            "try:\n"
            f"    s = socket.socket(socket.AF_UNIX); s.connect({path!r}); s.send(b'hi'); res.append('connected')\n"
            "except OSError as e:\n"
            "    res.append('blocked')\n"
            "try:\n"
            "    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            f"    s.sendto(b'hi', {dgram_path!r}); res.append('sent')\n"
            "except OSError as e:\n"
            "    res.append('blocked')\n"
            "try:\n"
            "    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            f"    a.sendto(b'hi', {dgram_path!r}); res.append('sent via socketpair')\n"
            "except OSError as e:\n"
            "    res.append('blocked')\n"
            "print(' '.join(res))"
        )
        out = await graded(env, stdio_task(["\n"], ["connected sent sent via socketpair\n"]), code)
        assert printed(out) == "blocked blocked blocked\n"
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
        dgram.settimeout(0.2)
        with pytest.raises(socket.timeout):
            dgram.recv(16)
    await still_works(env)


async def test_abstract_unix_socket_is_unreachable() -> None:
    name = b"\0gym-test-abstract-" + os.urandom(4).hex().encode()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen()
        code = (
            "import socket\n"
            "res = []\n"
            "try:\n"
            f"    s = socket.socket(socket.AF_UNIX); s.connect({name!r}); res.append('connected')\n"
            "except OSError:\n"
            "    res.append('blocked')\n"
            "try:\n"
            f"    s = socket.socket(socket.AF_UNIX); s.bind(b'\\0gym-test-bind'); s.listen(); res.append('bound')\n"
            "except OSError:\n"
            "    res.append('blocked')\n"
            "print(' '.join(res))"
        )
        out = await attack(stdio_task(["\n"], ["connected bound\n"]), code)
        assert printed(out) == "blocked blocked\n"
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()


# Correct programs that use what the sandbox must still allow: (the session's options, the program).
ALLOWED = [
    pytest.param(
        FAST,
        (
            "import asyncio, socket\n"
            "a, b = socket.socketpair()\n"
            "a.send(b'x')\n"
            "assert b.recv(1) == b'x'\n"
            "async def main():\n"
            "    await asyncio.sleep(0)\n"
            "    x, y = map(int, input().split())\n"
            "    return x + y\n"
            "print(asyncio.run(main()))"
        ),
        id="socketpair_and_asyncio",
    ),
    pytest.param(
        {**FAST, "use_cgroup": False},
        (
            "import threading\n"
            "out = []\n"
            "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "a, b = map(int, input().split())\n"
            "print(a + b + len(out) - 8)"
        ),
        id="many_threads_under_the_fallback",
    ),
]


@pytest.mark.parametrize(("options", "code"), ALLOWED)
async def test_what_the_sandbox_must_allow_still_works(options: dict[str, Any], code: str) -> None:
    env = await session(**options)
    out = await env.verify(ADD, fenced(code))
    assert out.reward == 1.0, out.fields


# ----------------------------------------------------------------------------- privileges

NS_PROBE = f"""{SYSCALLS}res = [
    tryit('unshare', 272, 0x10000000),
    tryit('unshare-net', 272, 0x40000000),
    tryit('clone', 56, 0x10000000 | 17, 0, 0, 0, 0),
    tryit('setns', 308, 0, 0),
    tryit('mount', 165, b'none', b'/tmp', b'tmpfs', 0, 0),
    tryit('keyctl', 250, 0, -3, 0, 0, 0),
    tryit('bpf', 321, 0, 0, 0),
    tryit('perf_event_open', 298, 0, 0, -1, -1, 0),
    tryit('userfaultfd', 323, 0),
    tryit('ptrace', 101, 16, 1, 0, 0),
]
print(' '.join(res))
"""


async def test_no_new_namespaces_and_no_kernel_attack_surface() -> None:
    out = await attack(stdio_task(["\n"], ["escaped\n"]), NS_PROBE)
    got = printed(out).split()
    assert got == [
        "unshare=EPERM",
        "unshare-net=EPERM",
        "clone=EPERM",
        "setns=EPERM",
        "mount=EPERM",
        "keyctl=EPERM",
        "bpf=EPERM",
        "perf_event_open=EPERM",
        "userfaultfd=EPERM",
        "ptrace=EPERM",
    ]


async def test_cannot_signal_the_worker() -> None:
    env = await session(**FAST)
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"r1 = libc.kill({os.getpid()}, 9)\n"
        "r2 = libc.kill(-1, 9) if os.getpid() != 1 else -1\n"  # everything it may signal: only its own namespace
        "print('alive')"
    )
    out = await env.verify(stdio_task(["\n"], ["alive\n"]), fenced(code))
    assert out.fields["result"] in ([-1], [True])  # kill(-1) may take the program itself down
    await still_works(env)  # and this process (the worker) is still here


# Programs that print what they reached or gained: (program, what it would print were the attack to work, what
# it prints).
DENIED = [
    pytest.param(
        (
            "import socket\n"
            "res = []\n"
            "for fam, typ in [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_DGRAM),\n"
            "                 (socket.AF_NETLINK, socket.SOCK_RAW), (socket.AF_PACKET, socket.SOCK_RAW)]:\n"
            "    try:\n"
            "        socket.socket(fam, typ); res.append('open')\n"
            "    except OSError:\n"
            "        res.append('blocked')\n"
            "print(' '.join(res))"
        ),
        "open open open open\n",
        "blocked blocked blocked blocked\n",
        id="netlink_packet_and_inet_sockets_are_denied",
    ),
    pytest.param(
        (
            "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "r = libc.unshare(0x10000000)\n"
            "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
            "print('unshare', r, 'CapEff', caps)"
        ),
        "unshare 0 CapEff 000001ffffffffff\n",
        "unshare -1 CapEff 0000000000000000\n",
        id="user_namespace_gives_no_capabilities",
    ),
    pytest.param(
        (
            "import os\n"
            "st = {l.split(':')[0]: l.split()[1:] for l in open('/proc/self/status')}\n"
            "print('root' if 0 in os.getresuid() else 'user', st['CapEff'][0], st['CapPrm'][0], st['CapBnd'][0])"
        ),
        "root\n",
        "user 0000000000000000 0000000000000000 0000000000000000\n",
        id="not_root_inside",
    ),
]


@pytest.mark.parametrize(("code", "claims", "prints"), DENIED)
async def test_denied(code: str, claims: str, prints: str) -> None:
    out = await attack(stdio_task(["\n"], [claims]), code)
    assert printed(out) == prints


# A program's child processes (bash, then the project's Python) lose the sandbox process's
# file-system uid 0 at execve: the interpreter must still be reachable for them, through a
# read-only view of only what it needs, while the rest of a root-only directory stays out of reach.
CHILD_PYTHON = """
import os, sys
env = dict(os.environ, PATH=os.path.dirname(sys.executable) + ':' + os.environ['PATH'])
r, w = os.pipe()  # (the harness took subprocess.Popen and os.fork away; posix_spawn is left)
pid = os.posix_spawn('/bin/bash', ['bash', '-c', 'python3 -c "print(42)" 2>&1'], env,
                     file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)])
os.close(w)
got = b''
while chunk := os.read(r, 4096):
    got += chunk
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
secret = {secret!r}
try:
    with open(secret) as f:
        read = 'read:' + f.read()
except OSError:
    read = 'denied'
seen = 'seen' if os.path.lexists(secret) else 'hidden'
try:
    listed = sorted(os.listdir({top!r}))
except OSError:
    listed = []
leak = [n for n in listed if n in {names!r}]
print(got.decode().strip(), status, read, seen if {hideable!r} else 'hidden', 'leak' if leak else 'noleak')
"""


def _closed_dir_above_python() -> str | None:
    """The outermost directory above the interpreter that others may not search (``/root``), if any."""
    cur = ""
    for part in os.path.realpath(sys.base_prefix).strip("/").split("/")[:-1]:
        cur += "/" + part
        if not os.stat(cur).st_mode & 0o001:
            return cur
    return None


async def test_child_processes_reach_python_but_not_root_only_files() -> None:
    import shutil
    import tempfile

    top = _closed_dir_above_python() if os.geteuid() == 0 else None
    secret_dir = tempfile.mkdtemp(prefix="gym-sandbox-secret-", dir=top)  # mode 0700, root-only
    try:
        secret = os.path.join(secret_dir, "credentials")
        Path(secret).write_text("hunter2")
        listing_top = top or tempfile.gettempdir()
        # what else is in that directory (not the way to the interpreter): none of it may show
        prefix = os.path.realpath(sys.base_prefix)
        names = [
            n
            for n in os.listdir(listing_top)
            if not (prefix + os.sep).startswith(os.path.join(listing_top, n) + os.sep)
        ]
        env = await session(**{**FAST, "wall_time_s": 20, "unit_test_timeout_secs": 15})
        code = CHILD_PYTHON.format(secret=secret, top=listing_top, names=names, hideable=top is not None)
        out = await env.verify(stdio_task(["\n"], ["42 0 denied hidden noleak\n"]), fenced(code))
        assert out.reward == 1.0, out.fields
        await still_works(env)
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)


MASK_PROBE = """
import json, os, sys
from gym_runtime.jail import child as sb
closed, keep = sys.argv[1], sys.argv[2]
sb._unshare(sb.CLONE_NEWNS)
sb._mount(None, '/', None, sb.MS_REC | sb.MS_PRIVATE, None)
masked = sb._mask_closed_dirs([os.path.join(closed, 'inner', 'lib'), '/usr'], keep)
try:
    open(os.path.join(closed, 'inner', 'lib', 'x'), 'w')
    writable = True
except OSError:
    writable = False
print(json.dumps({
    'masked': masked,
    'entries': sorted(os.listdir(closed)),
    'mode': oct(os.stat(closed).st_mode & 0o777),
    'lib': os.listdir(os.path.join(closed, 'inner', 'lib')),
    'writable': writable,
}))
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="masking is for a root worker")
@pytest.mark.parametrize("keep_inside", [False, True], ids=["masked", "holds-workdir"])
def test_mask_closed_dirs_shows_only_what_is_needed(keep_inside: bool) -> None:
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="gym-mask-test-"))  # (pytest's own tmp_path is under a 0700 dir)
    tmp_path.chmod(0o755)
    try:
        _mask_probe(tmp_path, keep_inside)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _mask_probe(tmp_path: Path, keep_inside: bool) -> None:
    import json
    import subprocess

    closed = tmp_path / "closed"
    (closed / "inner" / "lib").mkdir(parents=True)
    (closed / "inner" / "lib" / "mod.py").write_text("")
    (closed / "secret").write_text("hunter2")
    closed.chmod(0o700)
    keep = closed / "work" if keep_inside else tmp_path / "work"
    keep.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", MASK_PROBE, str(closed), str(keep)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0 and "unshare" in proc.stderr:
        pytest.skip("no mount namespace here: " + proc.stderr[-200:])
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    if keep_inside:  # unmasked: the working directory must stay where it is
        assert got["masked"] == [] and "secret" in got["entries"] and got["mode"] == "0o700"
    else:
        assert got["masked"] == [str(closed)]
        assert got["entries"] == ["inner"] and got["mode"] == "0o755"  # the secret is not there at all
        assert got["lib"] == ["mod.py"] and got["writable"] is False  # the needed subtree, read-only
    assert (closed / "secret").read_text() == "hunter2"  # the worker's own view is untouched


# ----------------------------------------------------------------------------- whole-sandbox limits

# Six children of 1/4 of the sandbox each (scaled down from 6 x 1 GiB in 4 GiB: the same
# ratio, less pressure on a shared test machine). Each child touches its memory, then reports.
SIX_CHILDREN = """
import ctypes, os, select, time
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
size = {size}
pids = []
for i in range(6):
    pid = libc.fork()
    if pid == 0:
        try:
            buf = bytearray(size)
            for j in range(0, size, 4096):
                buf[j] = 1
            os.write(w, b'k')
            time.sleep(30)
        finally:
            os._exit(0)
    if pid < 0:
        break
    pids.append(pid)
os.close(w)
got = 0
while got < len(pids) and select.select([r], [], [], 5)[0]:  # a killed child never reports
    got += len(os.read(r, 16))
time.sleep(0.5)
alive = [p for p in pids if os.waitpid(p, os.WNOHANG)[0] == 0]  # (the OOM killer may strike late)
print('children holding memory:', min(got, len(alive)))
"""


@pytest.mark.parametrize(
    ("mb", "use_cgroup"),
    [
        (1024, True),
        (1024, False),
        pytest.param(4096, True, marks=pytest.mark.slow),  # the issue's own numbers: 6 x 1 GiB in 4 GiB
    ],
    ids=["cgroup-or-fallback", "fallback", "4GiB"],
)
async def test_memory_limit_holds_for_the_sandbox_as_a_whole(mb: int, use_cgroup: bool) -> None:
    opts = {"wall_time_s": 30, "unit_test_timeout_secs": 25, "memory_mb": mb, "use_cgroup": use_cgroup}
    env = await session(**{**FAST, **opts})
    code = SIX_CHILDREN.format(size=(mb // 4) << 20)
    out = await graded(env, stdio_task(["\n"], ["children holding memory: 6\n"]), code)
    meta = out.fields["metadata"]
    if meta is not None and "output" in meta:  # the parent survived: fewer children fit
        got = int(meta["output"].split(":")[1])
        assert got * (mb // 4) < mb
    await still_works(env)
    assert cgroups_left() == []  # every sandbox's cgroup was removed


async def test_cannot_leave_its_cgroup() -> None:
    """Moving itself to another cgroup (the root one has no limit) would undo the whole-sandbox limit."""
    code = (
        "import glob, os\n"
        "moved = []\n"
        "paths = glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True)\n"
        "for p in paths + ['/sys/fs/cgroup/memory/cgroup.procs']:\n"
        "    try:\n"
        "        with open(p, 'w') as f:\n"
        "            f.write(str(os.getpid()))\n"
        "        moved.append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('moved' if moved else 'stayed', [l.split(':')[2] for l in open('/proc/self/cgroup') if ':memory:' in l])"
    )
    out = await attack(stdio_task(["\n"], ["moved\n"]), code)
    text = printed(out)
    assert text.startswith("stayed")
    # in its own cgroup, or (no writable cgroup: the single-process mode) still in the worker's
    own = cgroups._own_paths().get("memory")
    assert "gym-sandbox-" in text or (own is not None and repr(own + "\n") in text) or own is None


def cgroups_left(pid: int | None = None) -> list[str]:
    """The sandbox cgroups of this worker (or of the worker ``pid`` beside it) still present, in every hierarchy."""
    pid = os.getpid() if pid is None else pid
    own = cgroups._own_paths()
    left = []
    for root, mount, fstype, opts in cgroups._mounts():
        keys = [""] if fstype == "cgroup2" else [c for c in opts.split(",") if c in own]
        for key in keys:
            if key not in own:
                continue
            parent = cgroups._join(mount, root, own[key])
            try:
                left += [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f"gym-sandbox-{pid}-")]
            except OSError:
                pass
    return left


KILLED_MID_RUN = """
import anyio
from gym_runtime.resources.code_gen.grading import HARNESS
from gym_runtime.jail.runner import LEFTOVER_AGE_S, Limits, JailRunner

async def main():
    async with JailRunner(1).session(HARNESS, Limits(wall_s=120)):
        print("started", flush=True)
        await anyio.sleep(120)

anyio.run(main)
"""


async def test_what_a_worker_killed_mid_run_left_is_removed_by_the_next_one() -> None:
    """A worker SIGKILLed while its sandbox runs cleans nothing up: its sandbox's working directory and cgroups
    (memory, pids, cpuacct: kernel memory, for the life of the machine) stay. The next runner beside it removes
    them before its first sandbox (a directory once it is an hour old), with anything still inside them."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_RUN], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n"
    tmp = tempfile.gettempdir()
    workdirs = [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith(f"gym-sandbox-{proc.pid}-")]
    groups = cgroups_left(proc.pid)
    inside = [pid for g in groups for pid in Path(g, "cgroup.procs").read_text().split()]
    proc.kill()
    proc.wait()
    assert len(workdirs) == 1 and all(os.path.isdir(d) for d in workdirs)  # left behind by the kill
    assert cgroups_left(proc.pid) == groups and (groups or cgroups._own_paths().get("memory") is None)

    # a directory touched within the hour stays (its PID may be a live worker's in another PID namespace
    # that shares this /tmp); the cgroups beside this worker's own go at once
    async with JailRunner(1).session(HARNESS, Limits(wall_s=10)):
        pass
    assert all(os.path.isdir(d) for d in workdirs)
    assert cgroups_left(proc.pid) == []
    assert not [pid for pid in inside if running(int(pid))]  # the dead worker's sandbox is gone too

    then = time.time() - LEFTOVER_AGE_S - 60
    for d in workdirs:
        os.utime(d, (then, then))
    async with JailRunner(1).session(HARNESS, Limits(wall_s=10)):
        pass
    assert not any(os.path.exists(d) for d in workdirs)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_deeply_nested_message_on_the_channel() -> None:
    """JSON nested past the parser's depth is a broken run (-1), not a crash of the worker's verify.

    Limits generous for a loaded machine: the nested result's str() alone is 0.34 s of CPU before its
    RecursionError, and FAST's 0.5 s wall-clock timer turned that -4 into a -3 at load 8+."""
    env = await session(**{**FAST, "unit_test_timeout_secs": 10, "wall_time_s": 60})
    code = (
        "import gc\n"
        "ch = [o for o in gc.get_objects() if type(o).__name__ == 'Channel'][0]\n"
        "import os\n"
        "os.write(ch._wfd, b'[' * 100000 + b']' * 100000 + b'\\n')\n"
        "os._exit(0)"
    )
    out = await graded(env, ADD, code)
    assert out.fields["result"] == [-1, -1]
    nested = (
        "class Solution:\n    def add(self, a, b):\n        x = []\n"
        "        for _ in range(100000):\n            x = [x]\n        return x"
    )
    out = await graded(env, ADD_CALL, nested)
    # encoded up to a depth and compared as data (wrong); its str() overflows the stack: NeMo Gym's -4
    assert out.fields["result"] == [False, -4]
    await still_works_call(env)


async def test_big_outputs_are_compared_off_the_event_loop() -> None:
    """Over 1 MiB of output is compared in a worker process; the verdict is the same."""
    env = await session(**{**FAST, "max_output_mb": 4, "unit_test_timeout_secs": 10, "wall_time_s": 60})
    n = 300_000
    task = stdio_task([f"{n}\n"], ["".join(f"{i}\n" for i in range(n))])
    out = await env.verify(task, fenced("n = int(input())\nprint('\\n'.join(map(str, range(n))))"))
    assert out.reward == 1.0, out.fields["metadata"]
    out = await env.verify(task, fenced("n = int(input())\nprint('\\n'.join(map(str, range(1, n + 1))))"))
    assert out.reward == 0.0 and out.fields["result"] == [-2]
