"""Runs *inside* the sandbox: executes one program against its unit tests, LiveCodeBench style.

Standard library only: the sandbox (``child.py``) reads this file before it confines itself
and runs ``main(channel)`` after. It reproduces how NeMo Gym's ``code_gen``
(through its LiveCodeBench ``testing_util``) runs a program, because rewards
depend on those details:

*stdin/stdout tasks* (``fn_name`` is null): a trailing
``if __name__ == '__main__':`` block is unwrapped; top-level imports stay at
module level and every other statement becomes the body of a function
``wrapped_function`` that follows a fixed prelude of star-imports (``string``,
``re``, ``math``, ``collections``, ``sys``, ... then ``builtins`` and
``typing``) and ``sys.setrecursionlimit(50000)``. Each test calls that function
with ``sys.stdin`` replaced by a mock over the test input (``readline`` and
iteration give lines, ``read`` the whole text, ``readlines`` the text split on
newlines, ``sys.stdin.buffer`` is a small bytes mock) and ``builtins.open``
replaced by ``mock_open`` over the input; ``sys.stdout`` is captured; ``SystemExit`` just
ends the test. The captured text is sent to the parent, which compares it and answers whether
to go on.

*call-based tasks* (``fn_name`` given): the prelude and the code are executed; if
the code mentions ``class Solution`` the method is looked up on an instance of
it, else on the module; each input line is JSON, the arguments of one call; a
tuple result counts as a list. Each result is sent as plain data (:func:`encode`:
built-in types only, read through their base types) with its ``str`` for the
metadata; the parent decodes and compares it.

Nothing here decides a verdict: this file runs in the same process as the
untrusted program, which can reach every object in it (stack frames, ``gc``) and
every descriptor, so it is treated as untrusted too. Whatever arrives on the
channel is read by the worker as *raw output of the current test* only; the
expected outputs never enter the sandbox; protocol:
``loading``, then ``ready`` | ``unprepared``, then per test ``output`` | ``error``
(the worker answers ``{"next": bool}``), then ``done``. An ``output`` carries its data
as a raw body after its header line (``child.Channel``): the captured stdout as UTF-8
bytes, or the call's result as JSON (UTF-8, not escaped), so the worker counts bytes.

Per test a ``SIGALRM`` timer of ``timeout`` seconds raises ``TimeoutException``
(result -3); the program can switch that timer off, so the worker keeps its own
clock per test and per load and ends the run there with the same verdict. Any other exception
is a runtime error (-4, with ``repr`` and
traceback); a failure while preparing the program ends everything with ``[-4]``
and ``"Error during testing: <message>"`` (the parent builds it from ``unprepared``). Like LiveCodeBench's
``reliability_guard``, destructive helpers (``os.kill``, ``os.system``,
``subprocess.Popen``, ``shutil.rmtree``, ...) are set to None first: a program
that calls them fails the way it does under NeMo Gym. (That is not the security
boundary; ``gym_runtime.jail`` is.)
"""

import ast
import contextlib
import faulthandler
import json
import signal
import sys
import time
import traceback
from io import StringIO
from types import ModuleType

_FROM_IMPORTS = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
    "builtins",
    "typing",
)
_IMPORTS = _FROM_IMPORTS[:16]  # every module above but builtins and typing, imported by name
PRELUDE = (
    "".join(f"from {m} import *\n" for m in _FROM_IMPORTS)
    + "".join(f"import {m}\n" for m in _IMPORTS)
    + "sys.setrecursionlimit(50000)\n"
)


class TimeoutException(Exception):
    """Raised by the per-test timer (its repr, ``TimeoutException()``, is what the metadata shows)."""


def _on_alarm(signum, frame):
    raise TimeoutException


def _arm(seconds):
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _disarm():
    signal.setitimer(signal.ITIMER_REAL, 0)


@contextlib.contextmanager
def _armed(seconds):
    """One test's call under its alarm and the fault handler, both off again whichever way it ended."""
    _arm(seconds)
    faulthandler.enable()
    try:
        yield
    finally:
        _disarm()
        faulthandler.disable()


def shorten(value, length=300):
    """``str(value)``, cut to its first and last ``length // 2`` characters when longer."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= length:
        return text
    return text[: length // 2] + "...(truncated) ..." + text[-length // 2 :]


# ----------------------------------------------------------------------- program preparation


def unwrap_main_guard(code):
    """Replace a final ``if __name__ == '__main__':`` block by its body (else branch dropped)."""
    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:
        pass
    return code


def wrap_in_function(code):
    """Prelude + the code's top-level imports + every other statement inside ``wrapped_function``."""
    try:
        tree = ast.parse(code)
        imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
        others = [s for s in tree.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
        fn = ast.FunctionDef(
            name="wrapped_function",
            args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=others,
            decorator_list=[],
            lineno=-1,
        )
        return PRELUDE + "\n" + ast.unparse(imports) + "\n" + ast.unparse(fn)
    except Exception:
        return code


def load_program(code, timeout):
    """Execute the code as module ``tmp_sol``; the namespace to call into (a ``Solution()`` if any)."""
    _arm(timeout)
    try:
        module = ModuleType("tmp_sol", "")
        exec(code, module.__dict__)
        target = module.Solution() if "class Solution" in code else module
        assert target is not None
    finally:
        _disarm()
    return target


def lookup(target, name):
    try:
        assert hasattr(target, name)
        return getattr(target, name)
    except Exception:
        return None


# The preparation step "returned nothing" under NeMo Gym, which it reports as this error.
_NOTHING = TypeError("cannot unpack non-iterable NoneType object")


# ----------------------------------------------------------------------- stdin / stdout mocks


class MockBuffer:
    """``sys.stdin.buffer`` during a test: ``read`` gives all input bytes, ``readline`` the first line."""

    def __init__(self, inputs):
        self.inputs = inputs.encode("utf-8")

    def read(self, *args):
        return self.inputs

    def readline(self, *args):
        return self.inputs.split(b"\n")[0] + b"\n"


class MockStdinWithBuffer:
    """``sys.stdin`` during a test; what it does not define comes from a StringIO over the input."""

    def __init__(self, inputs):
        self.inputs = inputs
        self._stringio = StringIO(inputs)
        self.buffer = MockBuffer(inputs)

    def read(self, *args):
        return self.inputs

    def readline(self, *args):
        return self._stringio.readline(*args)

    def readlines(self, *args):
        return self.inputs.split("\n")

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._stringio)

    def __getattr__(self, name):
        return getattr(self._stringio, name)


class OutputLimitExceeded(BaseException):
    """The program printed more than the cap; ends the test (a BaseException: ``except Exception`` won't hide it)."""


def utf8(text):
    """The bytes a text is on the way out (lone surrogates kept: ``surrogatepass``)."""
    return text.encode("utf-8", "surrogatepass")


class _CappedStringIO(StringIO):
    """Captured stdout that keeps at most ``cap`` bytes (UTF-8); a write past the cap ends the test.

    The size is that of the characters themselves (``str.__str__``), never what a ``str``
    subclass says its length is. (The parent counts the bytes it receives again: this is
    where an honest program learns it went over, not the limit itself.)
    """

    def __init__(self, cap):
        super().__init__()
        self._cap = cap
        self._size = 0
        self.overflow = False

    def write(self, s):
        if not isinstance(s, str):
            return super().write(s)
        s = str.__str__(s)
        n = len(s) if s.isascii() else len(utf8(s))
        room = self._cap - self._size
        if n > room:
            self.overflow = True
            if room > 0:
                part = utf8(s)[:room].decode("utf-8", "ignore")  # (a character cut in two is left out)
                super().write(part)
                self._size += len(utf8(part))
            raise OutputLimitExceeded
        self._size += n
        return super().write(s)


class Capture(list):
    """``with Capture(cap) as out:`` swaps ``sys.stdout`` for a capped StringIO; ``out[0]`` is the text."""

    def __init__(self, cap):
        super().__init__()
        self.cap = cap
        self.overflow = False

    def __enter__(self):
        self._saved = sys.stdout
        self._sink = _CappedStringIO(self.cap)
        self._sink.close = lambda x: 1  # closing stdout is a no-op (that takes one argument)
        sys.stdout = self._sink
        return self

    def __exit__(self, *exc):
        self.append(self._sink.getvalue())
        self.overflow = self._sink.overflow
        del self._sink
        sys.stdout = self._saved


class _Patch:
    """Set ``target.name`` for a while, then restore it as ``unittest.mock.patch`` does.

    (An attribute that lived on the object itself is put back; one that came from
    its class is deleted again, so the class's shows through.)
    """

    def __init__(self, target, name, new):
        self.target, self.name, self.new = target, name, new

    def __enter__(self):
        try:
            self.original, self.local = self.target.__dict__[self.name], True
        except (AttributeError, KeyError):
            self.original, self.local = getattr(self.target, self.name, None), False
        setattr(self.target, self.name, self.new)

    def __exit__(self, *exc):
        if self.local:
            setattr(self.target, self.name, self.original)
        else:
            delattr(self.target, self.name)


def _mock_open(inputs):
    """``open`` during a test: ``unittest.mock.mock_open(read_data=inputs)``, built on first use.

    Code that names ``open`` directly gets the real one (the prelude's
    ``from builtins import *`` bound it); only code that looks ``builtins.open`` up
    at call time reaches this, which is rare, so ``unittest.mock`` (slow to import)
    is imported only then.
    """
    made = []

    def open_(*args, **kwargs):
        if not made:
            from unittest import mock

            made.append(mock.mock_open(read_data=inputs))
        return made[0](*args, **kwargs)

    return open_


def call_with_input(function, inputs):
    """Call ``function()`` with stdin (and ``open``) mocked over ``inputs``; ``SystemExit`` ends it."""
    import builtins

    if isinstance(inputs, list):
        inputs = "\n".join(inputs)
    lines = iter(inputs.split("\n"))
    fake_stdin = MockStdinWithBuffer(inputs)
    # Applied in this order, as NeMo Gym's stacked ``@patch`` decorators are: the
    # read* patches land on the real ``sys.stdin`` object (still visible to code
    # that bound it earlier, e.g. ``from sys import stdin``), then ``sys.stdin``
    # itself is replaced.
    real_stdin = sys.stdin
    patches = [
        _Patch(real_stdin, "read", lambda *a: inputs),
        _Patch(real_stdin, "readlines", lambda *a: inputs.split("\n")),
        _Patch(real_stdin, "readline", lambda *a: next(lines)),
        _Patch(sys, "stdin", fake_stdin),
        _Patch(builtins, "open", _mock_open(inputs)),
    ]
    entered = []
    try:
        for p in patches:
            p.__enter__()
            entered.append(p)
        try:
            return function()
        except SystemExit:
            pass
    finally:
        for p in reversed(entered):
            p.__exit__(None, None, None)


# ----------------------------------------------------------------------- the two modes


_MAX_TEXT = 128 << 10  # an error's repr or traceback longer than this keeps its head and tail


def _clip(text):
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT // 2] + "...(truncated) ..." + text[-_MAX_TEXT // 2 :]


def _error(channel, exc):
    """Report a test that raised: -3 for the per-test timer, else -4 with the traceback."""
    code = -3 if "timeoutexception" in repr(exc).lower() else -4
    channel.send(
        {
            "kind": "error",
            "code": code,
            "error": _clip(repr(exc)),
            "traceback": None if code == -3 else _clip(traceback.format_exc()),
        }
    )


def _prepare(channel, prepare):
    """Load the program; report ``ready`` or, when that fails, ``unprepared`` (NeMo Gym's [-4]).

    ``loading`` goes first, before any of the program's code runs: from then on the
    parent's clock for the load runs (``timeout``, whatever the program does to the timer).
    """
    channel.send({"kind": "loading"})
    try:
        prepared = prepare()
    except Exception as e:
        channel.send({"kind": "unprepared", "error": _clip(str(e))})
        return None
    channel.send({"kind": "ready"})
    return prepared


def run_stdio(channel, job):
    """Run tests one by one; after each, the parent (which holds the expected output) says go on or stop."""
    timeout, cap = job["timeout"], job["output_cap"]

    def prepare():
        program = load_program(wrap_in_function(unwrap_main_guard(job["code"])), timeout)
        function = lookup(program, "wrapped_function")
        if function is None:
            raise _NOTHING
        return function

    function = _prepare(channel, prepare)
    if function is None:
        return
    total = 0.0
    for gt_inp in job["inputs"]:
        with Capture(cap) as captured, _armed(timeout):
            try:
                start = time.time()
                call_with_input(function, gt_inp)
                total += time.time() - start
                _disarm()
            except OutputLimitExceeded:
                _disarm()  # reported below (overflow=True): the parent fails the test
            except Exception as e:
                _disarm()
                _error(channel, e)
                return
        channel.send({"kind": "output", "overflow": captured.overflow}, utf8(captured[0]))
        if not channel.recv().get("next"):
            return
    channel.send({"kind": "done", "execution_time": total})


# ----------------------------------------------------------------------- call results as plain data

_MAX_DEPTH = 200
_BIG_INT = 10**4000  # past this an int travels as hex (decimal conversion of huge ints is limited)


def encode(value, depth=0, seen=None):
    """A call's result as JSON data the worker decodes into plain Python values.

    Only the value of built-in types travels: a subclass (an ``int`` whose
    ``__eq__`` always says True, an ``IntEnum``, a ``defaultdict``) is read through
    its base type's own slots, so what the worker compares is data, never code.
    Every JSON object is a tag (``{"$": kind, ...}``): dicts, tuples, sets, complex
    numbers, bytes, big ints, and ``opaque`` for anything else (it equals nothing).
    """
    if value is None or value is True or value is False:
        return value
    if depth > _MAX_DEPTH:
        return {"$": "opaque", "type": "too deep"}
    if isinstance(value, int):
        v = int.__index__(value)
        return v if -_BIG_INT < v < _BIG_INT else {"$": "int", "hex": hex(v)}
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        real, imag = complex.__getattribute__(value, "real"), complex.__getattribute__(value, "imag")
        return {"$": "complex", "re": real, "im": imag}
    if isinstance(value, (bytes, bytearray)):
        return {"$": "bytes", "hex": bytes(value).hex()}
    seen = set() if seen is None else seen
    if id(value) in seen:
        return {"$": "opaque", "type": "cycle"}
    seen.add(id(value))
    try:
        if isinstance(value, list):
            return [encode(v, depth + 1, seen) for v in list.__iter__(value)]
        if isinstance(value, tuple):
            return {"$": "tuple", "items": [encode(v, depth + 1, seen) for v in tuple.__iter__(value)]}
        if isinstance(value, dict):
            return {
                "$": "dict",
                "items": [[encode(k, depth + 1, seen), encode(v, depth + 1, seen)] for k, v in dict.items(value)],
            }
        if isinstance(value, (set, frozenset)):
            kind = "frozenset" if isinstance(value, frozenset) else "set"
            each = frozenset.__iter__ if kind == "frozenset" else set.__iter__  # (no copy: a copy rehashes)
            return {"$": kind, "items": [encode(v, depth + 1, seen) for v in each(value)]}
        item = getattr(type(value), "item", None)
        if type(value).__module__ == "numpy" and callable(item) and getattr(value, "ndim", 1) == 0:
            return encode(item(value), depth + 1, seen)  # a numpy scalar: its Python value
    finally:
        seen.discard(id(value))
    return {"$": "opaque", "type": type(value).__name__}


def run_calls(channel, job):
    """Call the method once per test; send each result as data; the parent compares and says go on or stop."""
    timeout = job["timeout"]

    def prepare():
        target = load_program(PRELUDE + "\n\n" + job["code"], timeout)
        method = lookup(target, job["fn_name"])
        if method is None:
            raise _NOTHING
        return method, [[json.loads(line) for line in inp.split("\n")] for inp in job["inputs"]]

    prepared = _prepare(channel, prepare)
    if prepared is None:
        return
    method, all_inputs = prepared
    total = 0.0
    for gt_inp in all_inputs:
        with _armed(timeout):
            try:
                start = time.time()
                prediction = method(*gt_inp)
                total += time.time() - start
                if isinstance(prediction, tuple):
                    prediction = list(prediction)
                value = utf8(json.dumps(encode(prediction), ensure_ascii=False))
                message = {"kind": "output", "text": None, "text_error": None}
                try:
                    message["text"] = shorten(prediction)
                except Exception as e:  # NeMo Gym fails only when it must show a wrong answer
                    message["text_error"] = [_clip(repr(e)), _clip(traceback.format_exc())]
                _disarm()
            except Exception as e:
                _disarm()
                _error(channel, e)
                return
        channel.send(message, value)
        if not channel.recv().get("next"):
            return
    channel.send({"kind": "done", "execution_time": total})


# ----------------------------------------------------------------------- NeMo Gym's guard


def _raise_soft_limit(which, target):
    """Set the soft limit to ``target`` when it is below, as NeMo Gym's guard does.

    (``RLIM_INFINITY`` is -1 here, so an unlimited soft limit counts as below:
    under NeMo Gym the data segment ends up limited to 4 GiB.)
    """
    import resource

    soft, hard = resource.getrlimit(which)
    if soft < target:
        try:
            resource.setrlimit(which, (target, hard))
        except ValueError:
            pass


def guard():
    """What LiveCodeBench's ``reliability_guard`` does to the process before grading."""
    import builtins
    import os
    import resource
    import shutil
    import subprocess

    _raise_soft_limit(resource.RLIMIT_DATA, 4 << 30)
    _raise_soft_limit(resource.RLIMIT_STACK, 4 << 30)
    faulthandler.disable()
    builtins.quit = None
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in (
        "kill",
        "system",
        "putenv",
        "remove",
        "removedirs",
        "rmdir",
        "fchdir",
        "setuid",
        "fork",
        "forkpty",
        "killpg",
        "rename",
        "renames",
        "truncate",
        "replace",
        "unlink",
        "fchmod",
        "fchown",
        "chmod",
        "chown",
        "chroot",
        "lchflags",
        "lchmod",
        "lchown",
        "getcwd",
        "chdir",
    ):
        setattr(os, name, None)
    shutil.rmtree = None
    shutil.move = None
    shutil.chown = None
    subprocess.Popen = None
    builtins.help = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[name] = None


# Modules NeMo Gym's grading process has already imported when the guard runs
# (its grader imports them); imported fresh *after* the guard some of them fail
# (they call functions the guard removed), so a program that uses them would fail
# here but not there. Imported only when the code names them: they are slow.
_PRELOADED = {"numpy": "numpy", "multiprocessing": "multiprocessing", "mock": "unittest.mock"}


def _preload(code):
    import datetime  # noqa: F401  (cheap ones: always)
    import decimal  # noqa: F401
    import enum  # noqa: F401
    import platform  # noqa: F401

    for word, module in _PRELOADED.items():
        if word in code:
            try:
                __import__(module)
            except Exception:
                pass


def main(channel):
    job = channel.recv()
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(50000)
    signal.signal(signal.SIGALRM, _on_alarm)
    _preload(job["code"])
    guard()
    (run_stdio if job["mode"] == "stdio" else run_calls)(channel, job)
