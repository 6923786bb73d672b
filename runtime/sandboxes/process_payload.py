"""Runs *inside* the project's process sandbox (``gym_runtime.jail``) for the ``process`` backend.

Standard library only. ``main(channel)`` serves requests until the parent closes the channel:

- ``{"op": "exec", "argv": [...], "timeout": s, "max_output": n}``: run ``argv`` in the working directory in
  its own process group, stdout and stderr each capped at ``n`` bytes; at the timeout, or when the command
  ends while children linger, the whole group is killed. Reply ``{"exit_code", "timed_out", "truncated",
  "stdout": len}`` with stdout then stderr as the message's body.
- ``{"op": "write", "path": p, "data": s}`` (the bytes as a latin-1 string): write a file.
- ``{"op": "read", "path": p, "max": n}``: the file's bytes as the body (an error past ``n``).
- ``{"op": "pack", "max": n}``: the working directory as a tar (the body; an error past ``n``), for a fork;
  ``{"op": "unpack", "data": s}``: such a tar (latin-1) unpacked into this one's.
"""

import io
import os
import signal
import subprocess
import tarfile
import time


def _kill(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exec(argv, timeout, cap):
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    open_fds = set(kept)
    truncated = timed_out = False
    deadline = time.monotonic() + timeout
    for fd in open_fds:
        os.set_blocking(fd, False)

    def take(fd):  # what the pipe holds now: False once it would block (empty, a writer still holding it)
        nonlocal truncated
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            open_fds.discard(fd)
            return False
        room = cap - len(kept[fd])
        if room > 0:
            kept[fd] += chunk[:room]
        truncated = truncated or len(chunk) > room
        return True

    while open_fds:
        if time.monotonic() > deadline:
            timed_out = True
            break
        progressed = False
        for fd in list(open_fds):
            progressed = take(fd) or progressed
        if not progressed:
            if proc.poll() is not None:
                # it may have written and ended since the reads above: take what its pipes held when it ended
                # (at most a pipe's size, 1 MiB), then stop: children it left may hold them open and go on
                # writing; they end with the group below
                for fd in list(open_fds):
                    for _ in range(16):
                        if not take(fd):
                            break
                break
            time.sleep(0.005)
    _kill(proc.pid)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    out, err = (bytes(kept[f.fileno()]) for f in (proc.stdout, proc.stderr))
    proc.stdout.close()
    proc.stderr.close()
    return {"exit_code": None if timed_out else code, "timed_out": timed_out, "truncated": truncated}, out, err


def _path(rel):
    root = os.path.realpath(os.getcwd())
    full = os.path.realpath(os.path.join(root, rel.lstrip("/") if rel.startswith("/work/") else rel))
    if not (full == root or full.startswith(root + os.sep)):
        raise ValueError(f"path {rel!r} leaves the working directory")
    return full


def _pack(cap):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(".", recursive=True)
    if buf.tell() > cap:
        raise ValueError(f"the working directory is larger than {cap} bytes (the pool's disk_mb)")
    return buf.getvalue()


def _safe(member, path):
    """tarfile's ``data`` filter (nothing outside the working directory, whatever the tar says), the files' own
    permission bits kept: the commands run under another uid than ours (see ``main``)."""
    safe = tarfile.data_filter(member, path)
    return None if safe is None else safe.replace(mode=member.mode & 0o777, deep=False)


def _unpack(data):
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(".", filter=_safe)
        else:
            tar.extractall(".")
    os.chmod(os.getcwd(), 0o777)


def main(channel):
    # as root the sandbox runs us under a random uid with file-system uid 0 for this process only: the
    # commands we start lose it at execve, so the working directory must be open to them (it is ours alone)
    os.umask(0)
    os.chmod(os.getcwd(), 0o777)
    while True:
        try:
            req = channel.recv()
        except EOFError:
            return
        op = req.get("op")
        try:
            if op == "exec":
                head, out, err = _exec(req["argv"], float(req["timeout"]), int(req["max_output"]))
                head["stdout"] = len(out)
                channel.send(head, out + err)
            elif op == "write":
                full = _path(req["path"])
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(req["data"].encode("latin-1"))
                channel.send({"ok": True})
            elif op == "read":
                with open(_path(req["path"]), "rb") as f:
                    data = f.read(int(req["max"]) + 1)
                if len(data) > int(req["max"]):
                    raise ValueError(f"{req['path']} is larger than {req['max']} bytes (the pool's max_output)")
                channel.send({"ok": True}, data)
            elif op == "pack":
                channel.send({"ok": True}, _pack(int(req["max"])))
            elif op == "unpack":
                _unpack(req["data"].encode("latin-1"))
                channel.send({"ok": True})
            else:
                channel.send({"error": f"unknown op {op!r}"})
        except Exception as e:
            channel.send({"error": f"{type(e).__name__}: {e}"})
