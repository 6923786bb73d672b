"""Runs *inside* the project's sandbox (``runtime/jail/runner.py``): a repository and a shell.

Standard library only. ``main(channel)`` serves requests until the parent closes
the channel:

- ``{"op": "init", "files": {path: text}, "path": [dirs]}``: write the repository
  into ``./repo``, make it a git repository with one commit (the task's base
  commit, so ``git diff`` shows what changed since), reply ``{"ok": true}``.
- ``{"op": "run", "command": str, "timeout": s, "max_output": n}``: run the command
  with ``bash -c`` in ``./repo`` in its own process group; stdout and stderr
  together, the first ``max_output`` bytes kept. On the timeout, or when the
  command returns while children it started linger, the whole group is killed.
  Reply ``{"returncode", "timed_out", "truncated"}`` with the output as the message's raw body
  (bytes: the parent counts and decodes them).
- ``{"op": "write", "path": str, "text": str}``: write a file (relative to ``./repo``).

The sandbox around it provides the real limits (no network, read-only file
system outside the working directory, rlimits, a process cap, a wall clock).
"""

import os
import signal
import subprocess
import time

GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "gym",
    "GIT_AUTHOR_EMAIL": "gym@localhost",
    "GIT_COMMITTER_NAME": "gym",
    "GIT_COMMITTER_EMAIL": "gym@localhost",
    "GIT_TERMINAL_PROMPT": "0",
    # The sandbox runs the program under a random uid, so git sees a repository "owned by someone
    # else"; the repository is the sandbox's own throw-away copy, so trust it.
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "safe.directory",
    "GIT_CONFIG_VALUE_0": "*",
}


def _env(path_dirs):
    env = dict(os.environ)
    env.update(GIT_ENV)
    env["PATH"] = os.pathsep.join([*path_dirs, env.get("PATH", "/usr/bin:/bin")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PAGER"] = env["GIT_PAGER"] = "cat"
    return env


def _safe_path(root, rel):
    full = os.path.realpath(os.path.join(root, rel))
    if not (full == root or full.startswith(root + os.sep)):
        raise ValueError(f"path {rel!r} leaves the repository")
    return full


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(root, env, command, timeout, max_output):
    proc = subprocess.Popen(
        ["bash", "-p", "-c", command],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = bytearray()
    truncated = timed_out = False
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)

    def take():  # what the pipe holds now: None when it would block, b"" once every writer closed it
        nonlocal truncated
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return None
        if chunk:
            room = max_output - len(out)
            if room > 0:
                out.extend(chunk[:room])
            truncated = truncated or len(chunk) > room
        return chunk

    while True:
        if time.monotonic() > deadline:
            timed_out = proc.poll() is None
            break
        chunk = take()
        if chunk:
            continue
        if chunk == b"":  # every writer closed the pipe
            break
        if proc.poll() is not None:
            # the command ended, perhaps just after the read above: take what the pipe held then (at most a
            # pipe's size, 1 MiB); children still holding it may go on writing, and are killed below
            for _ in range(16):
                if not take():
                    break
            break
        time.sleep(0.01)
    _kill_group(proc.pid)
    try:
        returncode = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        returncode = None
    proc.stdout.close()
    return {
        "returncode": -9 if timed_out else returncode,
        "output": bytes(out),
        "timed_out": timed_out,
        "truncated": truncated,
    }


def main(channel):
    # When the worker is root the sandbox runs us under a random unprivileged uid and keeps only the
    # file-system uid 0 for this process; the commands we start (bash, python, git) lose it at execve,
    # so the working tree must be open to that uid (it is ours alone anyway), and bash must not try to
    # change uids (-p; the sandbox forbids uid changes). The Python under a root-only directory stays
    # reachable for them through the sandbox's read-only view of it (sandbox._mask_closed_dirs).
    os.umask(0)
    os.chmod(os.getcwd(), 0o777)
    root = os.path.realpath(os.path.join(os.getcwd(), "repo"))
    env = _env([])
    while True:
        try:
            req = channel.recv()
        except EOFError:
            return
        op = req.get("op")
        try:
            if op == "init":
                os.makedirs(root, exist_ok=True)
                for rel, text in sorted(req["files"].items()):
                    full = _safe_path(root, rel)
                    os.makedirs(os.path.dirname(full), exist_ok=True)
                    with open(full, "w", encoding="utf-8") as f:
                        f.write(text)
                env = _env(req.get("path") or [])
                res = _run(root, env, "git init -q && git add -A && git commit -q -m base", 60, 65536)
                if res["returncode"] != 0:
                    raise RuntimeError("git init failed: " + res["output"][-2000:].decode("utf-8", "replace"))
                channel.send({"ok": True})
            elif op == "run":
                res = _run(root, env, req["command"], float(req["timeout"]), int(req["max_output"]))
                channel.send({k: v for k, v in res.items() if k != "output"}, res["output"])  # output: raw bytes
            elif op == "write":
                full = _safe_path(root, req["path"])
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "w", encoding="utf-8") as f:
                    f.write(req["text"])
                channel.send({"ok": True})
            else:
                channel.send({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - report and keep serving: the parent decides
            channel.send({"error": f"{type(e).__name__}: {e}"})
