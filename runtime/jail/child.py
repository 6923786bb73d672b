"""A sandbox for running untrusted (model-written) Python programs, built from the stdlib.

Why not bubblewrap: ``bwrap`` would need a native binary (Debian's package or a
PyPI wheel that bundles one) on every machine that verifies, and it sets no
resource limits itself. Everything bwrap would do for us here is a handful of
Linux system calls, so this module makes them directly (``ctypes`` on libc; the
stdlib's ``os.unshare`` only exists from Python 3.12) and adds what bwrap lacks:
rlimits, a process cap and a wall-clock kill. Nothing to install, nothing
downloaded at run time.

How one run is isolated (parent side: :class:`JailRunner`; child side:
``python -I child.py --child``, which isolates itself *before* it reads any
untrusted input, and fails closed when a required layer is missing):

- **Own process, own session**: a new process group, killed as a whole
  (``SIGKILL``) at the wall-clock deadline, after a protocol error, and always at
  the end; the child also has ``PR_SET_PDEATHSIG`` so it dies with its parent.
- **Namespaces** (``unshare``; as root directly, otherwise inside a new user
  namespace): PID (the program's process tree dies with its init: nothing
  escapes the kill, not even a process that calls ``setsid``), network (an empty
  network namespace: no interface is up, ``connect`` fails with ENETUNREACH),
  mount (a private ``/proc`` that shows only the sandbox's processes; a
  size-limited ``tmpfs`` as the working directory; as root, every root-only
  directory above the Python installation, such as ``/root``, replaced by a
  read-only ``tmpfs`` that holds read-only bind mounts of just the paths the
  Landlock rules name: ``_mask_closed_dirs``), IPC and UTS.
- **Environment**: ``env`` is replaced (PATH, LANG, HOME/TMPDIR = the working
  dir, thread-count pins) and Python runs with ``-I`` (no PYTHON* variables, no
  user site). The worker's variables are not in the child, and other processes'
  ``/proc/PID/environ`` are out of reach (PID namespace + private ``/proc`` +
  Landlock's ptrace scoping + no capabilities).
- **Landlock** (Linux >= 5.13, unprivileged): the file system becomes read-only
  and limited to the Python installation (``sys.prefix``/``base_prefix``),
  ``/usr``, ``/lib*``, ``/bin`` and a few ``/etc`` files; only the throw-away
  working directory is writable. Where the kernel supports it (ABI >= 4/6) TCP
  bind/connect, signals to outside processes and abstract UNIX sockets are
  denied too.
- **seccomp** (a small BPF filter, ``_seccomp_program``): no ``socket()`` of any
  family and no ``connect``/``bind``/``listen``/``accept``, so nothing can address
  a host UNIX socket by path or abstract name; ``socketpair()`` stays for AF_UNIX
  stream/seqpacket (asyncio needs it). No new namespaces (``unshare``, ``setns``,
  ``clone`` with namespace flags; ``clone3`` answers ENOSYS so libc uses
  ``clone``), no ``mount``, ``keyctl``, ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``ptrace``, io_uring, module/kexec loading, uid/gid changes;
  no ``seccomp`` (no stacked filters or listeners), ``pidfd_*``, ``modify_ldt``,
  ``memfd_secret``, ``memfd_create`` and ``execveat`` (no executable image in
  memory), ``syslog``; ``personality`` only answers the query; ``prctl`` refuses
  ``PRCTL_DENIED`` (seccomp, dumpable, keepcaps, securebits, mm, ptracer, ...).
  Without a cgroup System V shared memory is refused too (nothing would charge it).
  The whole list, and what stays allowed, is in ``resources/code_gen/README.md``.
- **Privileges**: ``no_new_privs``; every capability dropped (effective,
  permitted, inheritable, ambient and the bounding set). When the worker runs as
  root, every uid and gid of the program becomes a random unprivileged one (so
  no euid 0, and ``RLIMIT_NPROC`` applies); only the file-system uid is set back
  to 0 (``_leave_root``) so a Python installed under a root-only directory stays
  readable, which without capabilities and under Landlock grants nothing beyond
  the rules above. ``execve`` resets the fsuid, so for the processes the program
  starts (``bash``, ``python``) the mount namespace masks such directories (see
  above); where it cannot, only the sandbox process itself reaches that Python.
- **cgroup** (``cgroups.py``, parent side): one per sandbox, v2 or v1, joined by
  the child before its first fork, so memory and process count hold for the
  sandbox as a whole. Where none is writable, the filter refuses new processes
  (threads stay allowed): one process, one ``RLIMIT_AS``, within the budget.
- **CPU**: counted for the sandbox as a whole by the parent (``runner._CpuWatch``:
  the cgroup's usage, else the process tree's from ``/proc``), which kills it at
  ``cpu_s``; per process, ``RLIMIT_CPU`` with soft = hard (SIGKILL; the program
  cannot raise it).
- **rlimits**:
  ``RLIMIT_AS`` (address space: a big allocation fails with MemoryError),
  ``RLIMIT_FSIZE`` (largest file the program may write; SIGXFSZ is ignored so a
  write fails with EFBIG instead of killing), ``RLIMIT_NPROC`` (processes and
  threads: no fork bombs), ``RLIMIT_NOFILE`` and ``RLIMIT_CORE`` = 0.
- **Output**: every message the child sends is a header line read with a byte
  cap, and maybe a raw body whose announced size the reader checks against its
  own cap before reading it; a child that breaks this is killed.
- **No exec of what the program writes**: the working directory has no Landlock
  EXECUTE right and its tmpfs is ``noexec`` (``Limits.exec_workdir`` lifts both,
  for a shell over a repository), so neither a file there nor an unnamed one
  (``O_TMPFILE`` through ``/proc/self/fd``) runs.

Required layers: seccomp, confinement of the file system and of other processes
(Landlock), dropping capabilities and, when root, leaving root, the rlimits, and a
memory limit for the sandbox as a whole (a cgroup, or the single-process mode).
:func:`probe` reports what this machine offers.

Nothing in the sandbox decides a verdict: see ``harness.py`` and ``grading.py``.

The child speaks newline-delimited JSON: it reads requests on its stdin and
writes messages on its stdout. Before the payload runs, both channels move to
private descriptors and fds 0/1 point at ``/dev/null``, so the untrusted program
cannot read the control channel by accident or corrupt it with stray prints.

This file is the child side, run alone as a script (``python -I child.py --child SPEC``):
standard library only, nothing of the project imported. The parent side is ``runner.py``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import platform
import signal
import struct
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

# ----------------------------------------------------------------------------- constants

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 0x4000, 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
# filesystem access rights, by the ABI that introduced them
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_FS_ABI1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
LL_REFER, LL_TRUNCATE, LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1 << 0, 1 << 1
LL_SCOPE_ABSTRACT_UNIX_SOCKET, LL_SCOPE_SIGNAL = 1 << 0, 1 << 1

# seccomp / classic BPF
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_ALU_AND_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
AF_UNIX, SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 1, 5, 0xF
CLONE_THREAD, CLONE_NEWCGROUP = 0x00010000, 0x02000000
CLONE_NAMESPACES = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)
PR_SET_KEEPCAPS, CAP_SETUID = 8, 7
# prctl options refused to the program: PR_SET_DUMPABLE, PR_SET_KEEPCAPS, PR_SET_SECCOMP, PR_SET_SECUREBITS,
# PR_SET_MM, PR_SET_IO_FLUSHER, PR_SET_SYSCALL_USER_DISPATCH, PR_SET_MEMORY_MERGE, PR_SET_PTRACER
PRCTL_DENIED = (4, 8, 22, 28, 35, 57, 59, 67, 0x59616D61)
# Per architecture: the audit arch, the calls the filter looks at, and ``deny`` (EPERM):
# io_uring; uid/gid changes; namespaces and mounts (unshare, setns, mount, umount2,
# pivot_root, chroot, the new mount API); keyctl/add_key/request_key; bpf;
# perf_event_open; userfaultfd; ptrace and process_vm_*; module and kexec loading;
# file handles; acct, swapon/off, reboot.
_SYSCALLS: dict[str, dict[str, Any]] = {
    "x86_64": dict(
        audit=0xC000003E,
        x32=True,
        socket=41,
        socketpair=53,
        clone=56,
        clone3=435,
        fork=[57, 58],
        net=[42, 49, 50, 43, 288],  # connect, bind, listen, accept, accept4
        prctl=157,
        personality=135,
        shm=[29, 30, 31, 67],  # shmget, shmat, shmctl, shmdt
        deny=[
            317,  # seccomp (stacking filters, listeners)
            434,  # pidfd_open
            424,  # pidfd_send_signal
            438,  # pidfd_getfd
            440,  # process_madvise
            448,  # process_mrelease
            154,  # modify_ldt
            447,  # memfd_secret
            319,  # memfd_create (uncounted memory without a cgroup; an executable image in memory)
            322,  # execveat (exec of a file descriptor)
            172,  # iopl
            173,  # ioperm
            134,  # uselib
            153,  # vhangup
            179,  # quotactl
            443,  # quotactl_fd
            300,  # fanotify_init
            212,  # lookup_dcookie
            103,  # syslog
            425,
            426,
            427,
            105,
            106,
            113,
            114,
            116,
            117,
            119,
            122,
            123,
            272,
            308,
            165,
            166,
            155,
            161,
            428,
            429,
            430,
            431,
            432,
            433,
            442,
            250,
            248,
            249,
            321,
            298,
            323,
            101,
            310,
            311,
            246,
            320,
            175,
            313,
            176,
            303,
            304,
            163,
            167,
            168,
            169,
        ],
    ),
    "aarch64": dict(
        audit=0xC00000B7,
        x32=False,
        socket=198,
        socketpair=199,
        clone=220,
        clone3=435,
        fork=[],
        net=[203, 200, 201, 202, 242],
        prctl=167,
        personality=92,
        shm=[194, 195, 196, 197],
        deny=[
            277,  # seccomp
            434,
            424,
            438,
            440,
            448,
            447,  # memfd_secret
            279,  # memfd_create
            281,  # execveat
            58,  # vhangup
            60,  # quotactl
            443,
            262,  # fanotify_init
            18,  # lookup_dcookie
            116,  # syslog
            425,
            426,
            427,
            143,
            144,
            145,
            146,
            147,
            149,
            151,
            152,
            159,
            97,
            268,
            40,
            39,
            41,
            51,
            428,
            429,
            430,
            431,
            432,
            433,
            442,
            219,
            217,
            218,
            280,
            241,
            282,
            117,
            270,
            271,
            104,
            294,
            105,
            273,
            106,
            264,
            265,
            89,
            224,
            225,
            142,
        ],
    ),
}


# ----------------------------------------------------------------------------- libc helpers

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    return _libc


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def _prctl(option: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> int:
    return _check(_lib().prctl(option, a, b, c, d), f"prctl({option})")


def _unshare(flags: int) -> None:
    _check(_lib().unshare(flags), f"unshare({flags:#x})")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    ret = _lib().mount(enc(src), enc(target), enc(fstype), flags, enc(data))
    _check(ret, f"mount({target})")


def _umount(target: str) -> None:
    _check(_lib().umount2(target.encode(), MNT_DETACH), f"umount({target})")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- landlock


def landlock_abi() -> int:
    """The Landlock ABI version the kernel offers, 0 when it has none."""
    if sys.platform != "linux":
        return 0
    ret = _lib().syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)
    )
    return int(ret) if ret > 0 else 0


def _fs_rights(abi: int) -> int:
    rights = LL_FS_ABI1
    if abi >= 2:
        rights |= LL_REFER
    if abi >= 3:
        rights |= LL_TRUNCATE
    if abi >= 5:
        rights |= LL_IOCTL_DEV
    return rights


def _apply_landlock(
    abi: int, read_paths: list[str], rw_dirs: list[str], dev_files: list[str], exec_rw: bool = False
) -> dict[str, bool]:
    handled_fs = _fs_rights(abi)
    handled_net = (LL_NET_BIND_TCP | LL_NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL) if abi >= 6 else 0
    if abi >= 6:
        attr = struct.pack("=QQQ", handled_fs, handled_net, scoped)
    elif abi >= 4:
        attr = struct.pack("=QQ", handled_fs, handled_net)
    else:
        attr = struct.pack("=Q", handled_fs)
    buf = ctypes.create_string_buffer(attr, len(attr))
    lib = _lib()
    rfd = _check(
        lib.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )
    file_only = (
        LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | (LL_TRUNCATE if abi >= 3 else 0) | (LL_IOCTL_DEV if abi >= 5 else 0)
    )

    def add(path: str, rights: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # absent on this machine: nothing to allow
        try:
            if not os.path.isdir(path):
                rights &= file_only
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights & handled_fs, fd), 12)
            _check(
                lib.syscall(
                    SYS_LANDLOCK_ADD_RULE,
                    ctypes.c_int(rfd),
                    ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                    rule,
                    ctypes.c_uint32(0),
                ),
                f"landlock_add_rule({path})",
            )
        finally:
            os.close(fd)

    try:
        ro = LL_EXECUTE | LL_READ_FILE | LL_READ_DIR
        for p in read_paths:
            add(p, ro)
        for p in dev_files:
            add(p, LL_READ_FILE | LL_WRITE_FILE | LL_TRUNCATE | LL_IOCTL_DEV)
        for p in rw_dirs:  # (no EXECUTE unless asked: nothing the program writes runs, not even via /proc/self/fd)
            add(p, handled_fs if exec_rw else handled_fs & ~LL_EXECUTE)
        _check(lib.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(rfd), ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(rfd)
    return {"landlock_fs": True, "landlock_net": bool(handled_net), "landlock_scope": bool(scoped)}


# ----------------------------------------------------------------------------- seccomp


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _seccomp_program(single_process: bool = False) -> bytes | None:
    """The filter: see ``_SYSCALLS``; sockets only as ``socketpair(AF_UNIX, STREAM|SEQPACKET)``.

    Without ``socket()``, ``connect``/``bind``/``listen``/``accept`` and datagram
    pairs, nothing can address a path or an abstract name. ``clone`` with a
    namespace flag fails; ``clone3`` reports ENOSYS (its flags are out of a BPF
    filter's reach; libc then falls back to ``clone``). ``prctl`` options in
    ``PRCTL_DENIED`` fail, ``personality`` only answers the query. ``single_process``
    (no cgroup): new processes fail with EAGAIN, threads (``CLONE_THREAD``) stay
    allowed, and System V shared memory is refused (nothing would charge it).
    """
    arch: dict[str, Any] | None = _SYSCALLS.get(platform.machine())
    if arch is None:
        return None
    ins: list[tuple[int, int, int, int]] = []

    def ret(value: int) -> tuple[int, int, int, int]:
        return (BPF_RET_K, 0, 0, value)

    def load(offset: int) -> tuple[int, int, int, int]:
        return (BPF_LD_W_ABS, 0, 0, offset)  # 0: nr, 4: arch, 16 + 8 * i: args[i] (low half)

    def on(nr: int, block: list[tuple[int, int, int, int]]) -> None:
        ins.append((BPF_JEQ_K, 0, len(block), nr))  # skip the block unless the call is nr
        ins.extend(block)

    eperm, eacces = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.EACCES
    ins += [load(4), (BPF_JEQ_K, 1, 0, arch["audit"]), ret(SECCOMP_RET_KILL_PROCESS), load(0)]
    if arch["x32"]:
        ins += [(BPF_JGE_K, 0, 1, 0x40000000), ret(SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for nr in arch["deny"]:
        on(nr, [ret(eperm)])
    for nr in [arch["socket"], *arch["net"]]:
        on(nr, [ret(eacces)])
    on(
        arch["socketpair"],
        [
            load(16),
            (BPF_JEQ_K, 0, 5, AF_UNIX),
            load(24),
            (BPF_ALU_AND_K, 0, 0, SOCK_TYPE_MASK),
            (BPF_JEQ_K, 1, 0, SOCK_STREAM),
            (BPF_JEQ_K, 0, 1, SOCK_SEQPACKET),
            ret(SECCOMP_RET_ALLOW),
            ret(eacces),
        ],
    )
    on(arch["clone3"], [ret(SECCOMP_RET_ERRNO | errno.ENOSYS)])
    # prctl: the options that change how the process may be traced, dumped or filtered, or its mm
    opts = PRCTL_DENIED
    on(
        arch["prctl"],
        [load(16)]
        + [(BPF_JEQ_K, len(opts) + 1 - i, 0, k) for i, k in enumerate(opts, 1)]
        + [ret(SECCOMP_RET_ALLOW), ret(eperm)],
    )
    # personality: asking (0xffffffff) only; no ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, ...
    on(arch["personality"], [load(16), (BPF_JEQ_K, 0, 1, 0xFFFFFFFF), ret(SECCOMP_RET_ALLOW), ret(eperm)])
    if single_process:  # no cgroup to charge System V shared memory to: none at all
        for nr in arch["shm"]:
            on(nr, [ret(eperm)])
    clone = [load(16), (BPF_JSET_K, 0, 1, CLONE_NAMESPACES), ret(eperm)]
    if single_process:
        clone += [(BPF_JSET_K, 0, 1, CLONE_THREAD), ret(SECCOMP_RET_ALLOW), ret(SECCOMP_RET_ERRNO | errno.EAGAIN)]
    else:
        clone += [ret(SECCOMP_RET_ALLOW)]
    on(arch["clone"], clone)
    if single_process:
        for nr in arch["fork"]:
            on(nr, [ret(SECCOMP_RET_ERRNO | errno.EAGAIN)])
    ins.append(ret(SECCOMP_RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


def _apply_seccomp(single_process: bool) -> bool:
    prog = _seccomp_program(single_process)
    if prog is None:
        return False
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    ret = _lib().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0)
    _check(ret, "prctl(PR_SET_SECCOMP)")
    return True


# ----------------------------------------------------------------------------- capabilities


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capset(effective: int = 0, permitted: int = 0) -> None:
    hdr = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    data[0].effective, data[0].permitted = effective & 0xFFFFFFFF, permitted & 0xFFFFFFFF
    data[1].effective, data[1].permitted = effective >> 32, permitted >> 32
    _check(_lib().capset(ctypes.byref(hdr), data), "capset")


def _drop_bounding_set() -> None:
    lib = _lib()
    for cap in range(64):
        if lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            # EINVAL: past the last capability this kernel knows. EPERM: no
            # CAP_SETPCAP, i.e. an unprivileged process that has no capability
            # to lose (and no_new_privs keeps exec from granting any).
            if ctypes.get_errno() in (errno.EINVAL, errno.EPERM):
                break
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _drop_capabilities() -> None:
    _drop_bounding_set()
    _lib().prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _capset(0, 0)


def _leave_root(uid: int) -> None:
    """Root worker: every uid and gid of the program becomes ``uid``, an unprivileged one.

    No euid 0 inside, and ``RLIMIT_NPROC`` applies (root is exempt). Only the
    *file-system* uid goes back to 0 (through a moment of CAP_SETUID, then every
    capability is gone): the Python installation may sit under a root-only
    directory such as ``/root/.pyenv``. Without capabilities an fsuid of 0 is
    just "owner" of root's files, and Landlock limits those to reading the
    allowed paths and writing the working directory.
    """
    lib = _lib()
    _drop_bounding_set()
    _prctl(PR_SET_KEEPCAPS, 1)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # clears the effective set; KEEPCAPS kept the permitted one
    _capset(1 << CAP_SETUID, 1 << CAP_SETUID)
    lib.setfsuid(0)
    if lib.setfsuid(-1) != 0:  # (-1 changes nothing and returns the current fsuid)
        raise OSError(errno.EPERM, "setfsuid(0) failed")
    _prctl(PR_SET_KEEPCAPS, 0)
    _capset(0, 0)
    if 0 in os.getresuid() or 0 in os.getresgid():
        raise OSError(errno.EPERM, "still root")


# ----------------------------------------------------------------------------- probe


@dataclass
class Layers:
    """Which isolation layers a child actually got (reported back to the parent)."""

    root: bool = False
    userns: bool = False
    pidns: bool = False
    netns: bool = False
    mountns: bool = False
    private_proc: bool = False
    tmpfs_workdir: bool = False
    masked_dirs: list[str] = field(default_factory=list)  # root-only dirs replaced by a read-only view
    landlock_fs: bool = False
    landlock_net: bool = False
    landlock_scope: bool = False
    seccomp: bool = False
    caps_dropped: bool = False
    unprivileged_uid: bool = False
    rlimits: bool = False
    cgroup: int = 0  # 2 or 1: the sandbox's own cgroup (memory + processes as a whole); 0: none
    single_process: bool = False  # no cgroup: no new processes, so RLIMIT_AS bounds the whole
    missing: list[str] = field(default_factory=list)

    def check(self) -> list[str]:
        missing = []
        if not self.seccomp:
            missing.append("system call filter (seccomp, x86_64 or aarch64)")
        if self.root and not self.userns and not self.unprivileged_uid:
            missing.append("leaving root")
        if not (self.cgroup or self.single_process):
            missing.append("a memory limit for the sandbox as a whole (cgroup or single process)")
        if not self.landlock_fs:
            missing.append("file-system and process confinement (Landlock, Linux >= 5.13)")
        if not self.caps_dropped:
            missing.append("dropping capabilities")
        if not self.rlimits:
            missing.append("resource limits")
        self.missing = missing
        return missing


# ----------------------------------------------------------------------------- child side


def _read_only_paths() -> list[str]:
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths |= {os.path.realpath(p) for p in list(paths)}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    paths |= {"/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"}
    paths |= {
        "/etc/ld.so.cache",
        "/etc/ld.so.conf",
        "/etc/ld.so.conf.d",
        "/etc/localtime",
        "/etc/passwd",
        "/etc/group",
        "/etc/nsswitch.conf",
        "/etc/mime.types",
    }
    return sorted(p for p in paths if p and p != "/")


_DEV_FILES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]


def _set_rlimits(lim: dict[str, Any]) -> None:
    import resource

    def setlim(which: int, soft: int, hard: int | None = None) -> None:
        cur_soft, cur_hard = resource.getrlimit(which)
        hard = soft if hard is None else hard
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))

    cpu = max(1, math.ceil(lim["cpu_s"]))
    # soft = hard: SIGKILL at the limit; a program cannot raise its soft limit past the hard one. (Per
    # process, a backstop: the parent counts the sandbox as a whole, ``runner._CpuWatch``.)
    setlim(resource.RLIMIT_CPU, cpu, cpu)
    setlim(resource.RLIMIT_AS, int(lim["memory_bytes"]))
    setlim(resource.RLIMIT_FSIZE, int(lim["file_bytes"]))
    setlim(resource.RLIMIT_NOFILE, int(lim["nofile"]))
    setlim(resource.RLIMIT_CORE, 0)
    setlim(resource.RLIMIT_NPROC, int(lim["nproc"]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write fails with EFBIG instead of killing


def _enter_namespaces(layers: Layers) -> None:
    """Outer child: new namespaces (the PID namespace takes effect for the next fork)."""
    uid, gid = os.getuid(), os.getgid()
    rest = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    try:
        _unshare(rest)
    except OSError:
        # not root (or no CAP_SYS_ADMIN): do it inside a new user namespace
        try:
            _unshare(CLONE_NEWUSER)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
            layers.userns = True
            _unshare(rest)
        except OSError:
            # try the namespaces one by one; the network one matters most
            for flag in (CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUTS):
                try:
                    _unshare(flag)
                except OSError:
                    continue
                if flag == CLONE_NEWNET:
                    layers.netns = True
                elif flag == CLONE_NEWNS:
                    layers.mountns = True
            return
    layers.pidns = layers.netns = layers.mountns = True


def _reap_until(pid: int) -> None:
    """Wait (reaping any orphan meanwhile) until ``pid`` ends, then exit the way it did."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
        if done == pid:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _closed_ancestor(path: str) -> str | None:
    """The outermost proper ancestor of ``path`` that others may not search (no ``o+x``), if any."""
    parts = path.strip("/").split("/")[:-1]
    cur = ""
    for part in parts:
        cur += "/" + part
        try:
            mode = os.stat(cur).st_mode
        except OSError:
            return None
        if not mode & 0o001:
            return cur
    return None


def _mask_closed_dirs(paths: list[str], keep: str) -> list[str]:
    """Root worker, new mount namespace: make ``paths`` reachable without fsuid 0, hide the rest.

    The Python installation may live under a directory only root may search
    (``/root/.pyenv``, ``/root`` is 0700). The sandbox's own process keeps fsuid 0
    to get there, but ``execve`` resets the fsuid, so a process the program starts
    (``bash``, then ``python``) could not. Here, still privileged and before any
    untrusted input: for each such outermost directory, open the needed subtrees,
    mount a small tmpfs (mode 0755, ``nosuid,nodev,noexec``) over the directory,
    recreate the paths inside it and bind-mount the subtrees back, read-only
    (``nosuid,nodev``); then the tmpfs itself becomes read-only. Everything else
    under that directory (credentials, other users' files) is no longer there at
    all. On any failure the directory's mount is taken away again (so the old
    view and the fsuid-0 fallback remain). A directory that holds ``keep`` (the
    working directory) is left alone. Returns the directories masked.
    """
    keep = os.path.realpath(keep)
    groups: dict[str, list[str]] = {}
    for p in sorted({os.path.realpath(p) for p in paths}):
        if not os.path.exists(p):
            continue
        top = _closed_ancestor(p)
        if top is not None:
            groups.setdefault(top, []).append(p)
    masked = []
    for top, subs in sorted(groups.items()):
        if keep == top or keep.startswith(top + "/"):
            continue
        subs = [p for p in subs if not any(p.startswith(q + "/") for q in subs)]  # outermost only
        fds: list[tuple[str, int]] = []
        mounted = False
        try:
            for p in subs:
                fds.append((p, os.open(p, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)))
            _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,nr_inodes=1024,mode=0755")
            mounted = True
            for p, fd in fds:
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.makedirs(p, mode=0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
                    os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o444))
                _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC, None)
                _mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
            _mount(None, top, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            masked.append(top)
        except OSError:
            if mounted:
                try:
                    _umount(top)
                except OSError:
                    pass
        finally:
            for _, fd in fds:
                os.close(fd)
    return masked


def _mount_private(lim: dict[str, Any], layers: Layers) -> None:
    """In the new mount namespace: no propagation, the PID namespace's own /proc, a tmpfs workdir,
    and (root worker) root-only directories on the way to the Python installation masked."""
    workdir = lim["workdir"]
    if layers.mountns:
        try:
            _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
                layers.private_proc = layers.pidns
            except OSError:
                pass
            if layers.root and not layers.userns:
                layers.masked_dirs = _mask_closed_dirs(_read_only_paths(), workdir)
            try:
                size = max(1 << 20, int(lim["file_bytes"]))
                noexec = 0 if lim.get("exec_workdir") else MS_NOEXEC
                opts = f"size={size},nr_inodes=4096,mode=0700"
                _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV | noexec, opts)
                layers.tmpfs_workdir = True
            except OSError:
                pass
        except OSError:
            pass


def _inner_setup(lim: dict[str, Any], layers: Layers) -> None:
    """The program's process: limits, privileges, Landlock, seccomp."""
    workdir = lim["workdir"]
    if not layers.pidns:
        _mount_private(lim, layers)  # (with a PID namespace, its init did this)
    os.chdir(workdir)  # enter the tmpfs mounted over it

    _set_rlimits(lim)
    layers.rlimits = True

    if layers.root and not layers.userns:
        _leave_root(lim["ruid"])  # (seccomp below keeps the program from changing uids back)
        layers.unprivileged_uid = True

    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    abi = landlock_abi()
    if abi >= 1:
        read_paths = _read_only_paths()
        if layers.private_proc:
            read_paths.append("/proc")
        layers.__dict__.update(_apply_landlock(abi, read_paths, [workdir], _DEV_FILES, bool(lim.get("exec_workdir"))))
    layers.single_process = not layers.cgroup
    try:
        layers.seccomp = _apply_seccomp(layers.single_process)
    except OSError:
        layers.seccomp = False
    _drop_capabilities()
    layers.caps_dropped = True


def _send(fd: int, obj: Any, body: bytes | None = None) -> None:
    """A header line (ASCII JSON), then, when given, ``body`` raw: its size is in the header (``"body"``)."""
    if body is not None:
        obj = {**obj, "body": len(body)}
    data = (json.dumps(obj) + "\n").encode("ascii")  # ASCII JSON: even lone surrogates travel
    for chunk in (data, body or b""):
        view = memoryview(chunk)
        while view:
            n = os.write(fd, view)
            view = view[n:]


class Channel:
    """The child's end of the parent link over two private fds.

    In: JSON lines. Out: JSON header lines, each maybe followed by a raw body (``_send``).
    """

    def __init__(self, rfd: int, wfd: int) -> None:
        self._rfd, self._wfd = rfd, wfd
        self._buf = b""

    def send(self, obj: Any, body: bytes | None = None) -> None:
        _send(self._wfd, obj, body)

    def recv(self) -> Any:
        while b"\n" not in self._buf:
            chunk = os.read(self._rfd, 1 << 16)
            if not chunk:
                raise EOFError("parent closed the channel")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


def _child_main(spec_json: str) -> None:
    lim = json.loads(spec_json)
    parent = lim["parent_pid"]
    if sys.platform == "linux":
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(70)  # the parent died before we could arm PDEATHSIG
    with open(lim["payload"], encoding="utf-8") as f:
        payload_src = f.read()

    # Move the channels to private fds; 0 and 1 become /dev/null.
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)

    layers = Layers(root=os.geteuid() == 0)
    cgroup_error = None
    if lim.get("cgroup_procs"):
        try:  # before any fork: every process of the sandbox is charged together
            for procs in lim["cgroup_procs"]:  # (cgroups.join; this file runs alone: python -I)
                _write(procs, str(os.getpid()))
            layers.cgroup = int(lim["cgroup_version"])
        except OSError as e:
            cgroup_error = f"joining the cgroup: {e}"
    if sys.platform == "linux":
        _enter_namespaces(layers)
    if layers.pidns:
        pid = os.fork()
        if pid:
            # Outer process: hold no channel end, wait for the namespace's init, pass on its fate.
            os.close(rfd)
            os.close(wfd)
            _reap_until(pid)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # We are PID 1 of the new namespace. The kernel shields an init process from
        # signals it has no handler for (SIGXCPU, SIGTERM from inside, ...), so the
        # program must not run as PID 1: mount the namespace's /proc here, then fork
        # once more and stay behind as a reaper that passes on the program's fate.
        _mount_private(lim, layers)
        pid = os.fork()
        if pid:
            os.close(rfd)
            os.close(wfd)
            _reap_until(pid)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    try:
        if sys.platform != "linux":
            raise OSError(f"no sandbox on {sys.platform}")
        if cgroup_error:
            raise OSError(cgroup_error)
        _inner_setup(lim, layers)
    except Exception as e:  # report, then fail closed
        layers.missing = [f"setup failed: {type(e).__name__}: {e}"]
        _send(wfd, {"kind": "sandbox", "ok": False, "layers": asdict(layers)})
        os._exit(3)
    if layers.check():
        _send(wfd, {"kind": "sandbox", "ok": False, "layers": asdict(layers)})
        os._exit(3)
    _send(wfd, {"kind": "sandbox", "ok": True, "layers": asdict(layers)})

    ns: dict[str, Any] = {"__name__": "gym_sandbox_payload", "__file__": lim["payload"]}
    exec(compile(payload_src, lim["payload"], "exec"), ns)
    ns[lim.get("entry", "main")](Channel(rfd, wfd))
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2])
    else:
        sys.exit("usage: python -I child.py --child SPEC (started by gym_runtime.jail.runner)")
