"""The workers' ready line (issue 74): one writer and one reader (``service.ready``), which the supervisor, the Ray
actors and ``Client`` over ``start`` all use, so the line cannot drift between who prints it and who waits."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from gym_runtime.service.ready import READY, read_ready, say_ready
from tests.helpers import REPO


def test_what_say_ready_prints_read_ready_takes_from_a_child_in_text_and_in_bytes() -> None:
    out = io.StringIO()
    say_ready(out, " (2 processes)")
    assert out.getvalue() == f"{READY} (2 processes)\n"
    code = "import sys; from gym_runtime.service.ready import say_ready; say_ready(sys.stdout, ' on Ray (1 actors)')"
    for text in (True, False):
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=text, timeout=60)
        stream = io.StringIO(child.stdout) if text else io.BytesIO(child.stdout)
        assert read_ready(stream), child.stderr


def test_a_child_that_exits_or_says_something_else_first_is_not_ready() -> None:
    r, w = os.pipe()
    os.close(w)  # exited before printing anything
    with os.fdopen(r, "rb") as closed:
        assert not read_ready(closed)
    assert not read_ready(io.StringIO("error: the config has no agents\nworkers ready\n"))
    assert not read_ready(io.StringIO("not ready\n"))  # a line that merely holds the word


def test_the_line_is_spelled_in_one_module() -> None:
    """No module of the runtime but ``service/ready.py`` spells the line or looks for "ready" in a child's line."""
    spelled = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "runtime").rglob("*.py"))
        if p.relative_to(REPO).as_posix() != "runtime/service/ready.py"
        and ('"workers ready' in (s := p.read_text()) or '"ready" in' in s or 'b"workers ready' in s)
    ]
    assert spelled == []
