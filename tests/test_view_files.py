"""``view`` and ``diff`` survive any file (the trust round's attacks): non-finite and huge numbers shown as they
are, unreadable rows and ATIF documents one line naming ``file:line`` (exit 2) at the start or a notice on
the page later, a file changed under a running view re-indexed, and rows' control characters escaped on the
terminal. Each runs the CLI as a user does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli
from tests.test_atif import FOREIGN
from tests.test_view import one_error_line, serve, view
from tests.view_rows import failure, row, write

DEEP = 100_000


def raw_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def huge_run(tmp_path: Path) -> Path:
    """Rewards +-Infinity, NaN, +-1e308 and the integer 10**400, a logprob 10**400, costs inf and 10**400."""
    rows = [json.dumps(row(t, 0, 1.0, version=1)) for t in range(7)]
    rewards = ["Infinity", "-Infinity", "NaN", "1e308", "-1e308", "1" + "0" * 400, "1e400"]
    out = []
    for t, (line, reward) in enumerate(zip(rows, rewards)):
        line = line.replace('"reward": 1.0', f'"reward": {reward}')
        line = line.replace("-1.5", "1" + "0" * 400)  # a logprob
        line = line.replace(
            '"estimated_cost": 0.001', '"estimated_cost": ' + ("Infinity" if t % 2 else "1" + "0" * 400)
        )
        out.append(line)
    return raw_lines(tmp_path / "huge.jsonl", *out)


def test_non_finite_and_huge_numbers_are_shown_as_they_are_on_every_page(tmp_path: Path) -> None:
    path = huge_run(tmp_path)
    plain = write(tmp_path / "plain.jsonl", [row(t, 0, 1.0) for t in range(7)])
    for s in serve(str(path), str(plain)):
        status, _, body = s.get("/")
        assert status == 200, body[:300]
        page = body.decode()
        assert "not a number" in page  # the mean of +inf and -inf
        for t in range(7):
            status, _, body = s.get(f"/rollout/0/0/{t}")
            assert status == 200, (t, body[:300])
        assert "not a number" in s.get("/rollout/0/0/2")[2].decode()  # the NaN reward
        assert "inf" in s.get("/rollout/0/0/0")[2].decode()
        assert "1e+400" in s.get("/rollout/0/0/1")[2].decode()  # the logprob 10**400, as it is
        for q in ("sort=reward", "sort=reward&desc=true", "sort=cost", "rmin=1"):
            assert s.get("/rollouts?" + q)[0] == 200, q
        status, _, body = s.get("/diff?a=0&b=1")
        assert status == 200, body[:300]
    out = cli("diff", str(path), str(plain))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    out = cli("diff", str(path), str(plain), "--json")
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)  # valid JSON: non-finite numbers written as null or strings, never NaN


def deep(n: int = DEEP) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"reward": 1, "x": ' + deep() + "}", "nested deeper than"),
        ('{"reward": 1, "response": {"output": ' + deep() + "}}", "nested deeper than"),
    ],
)
def test_a_row_too_deep_is_one_line_naming_its_line(tmp_path: Path, line: str, says: str) -> None:
    path = raw_lines(tmp_path / "deep.jsonl", json.dumps(row(0, 0, 1.0)), line)
    assert f"{path}:2: " in (msg := one_error_line(view(str(path), "--port", "0"))) and says in msg
    out = cli("diff", str(path), str(path))
    assert out.returncode == 2 and f"{path}:2:" in out.stderr and "Traceback" not in out.stderr


def test_a_line_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes(json.dumps(row(0, 0, 1.0)).encode() + b'\n{"reward": 1, "x": "caf\xe9"}\n')
    assert f"{path}:2: " in one_error_line(view(str(path), "--port", "0"))


def foreign(**change: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(FOREIGN))
    doc.update(change)
    return doc


def broken_atif() -> dict[str, Any]:
    obs = foreign()
    obs["steps"][-1]["observation"] = "a string"
    calls = foreign()
    for s in calls["steps"]:
        if s.get("tool_calls"):
            s["tool_calls"] = ["a string"]
    return {
        "observation a string": obs,
        "steps holding ints": foreign(steps=[1, 2, 3]),
        "tool_calls holding strings": calls,
        "agent a list": foreign(agent=["terminus-2"]),
    }


@pytest.mark.parametrize("kind", list(broken_atif()))
def test_a_malformed_atif_document_is_one_line_in_view_export_and_reverify(tmp_path: Path, kind: str) -> None:
    doc = broken_atif()[kind]
    pretty = tmp_path / "trajectory.json"
    pretty.write_text(json.dumps(doc, indent=2))
    msg = one_error_line(view(str(pretty), "--port", "0"))
    assert f"{pretty}:" in msg and "not an ATIF trajectory" in msg, msg
    out = cli("export", str(pretty), "-o", str(tmp_path / "x.atif.jsonl"))
    assert out.returncode == 2 and "not an ATIF trajectory" in out.stderr and "Traceback" not in out.stderr
    lines = write(tmp_path / "lines.jsonl", [FOREIGN, doc])
    msg = one_error_line(view(str(lines), "--port", "0"))
    assert f"{lines}:2: " in msg and "not an ATIF trajectory" in msg, msg


def test_an_atif_document_too_deep_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "trajectory.json"
    text = json.dumps(FOREIGN)
    path.write_text(text[:-1] + ', "notes": ' + deep() + "}")
    msg = one_error_line(view(str(path), "--port", "0"))
    assert f"{path}:" in msg and "nested deeper than" in msg, msg


def test_a_file_changed_under_a_running_view_is_re_indexed_never_500(tmp_path: Path) -> None:
    path = write(tmp_path / "out.jsonl", [row(t, 0, 1.0, answer=f"answer {t} " + "x" * 300) for t in range(20)])
    for s in serve(str(path)):
        assert s.get("/rollout/0/0/19")[0] == 200
        write(path, [row(t, 0, 0.0, answer=f"short {t}") for t in range(5)])  # rewritten shorter
        status, _, body = s.get("/rollout/0/0/3")
        assert status == 200 and b"short 3" in body, body[:300]
        assert s.get("/rollout/0/0/19")[0] == 404
        assert b"5 rollouts" in s.get("/rollouts")[2]
        with path.open("a") as f:  # grown: 200 rows appended
            f.write("".join(json.dumps(row(100 + t, 0, 1.0, answer=f"grown {t}")) + "\n" for t in range(200)))
        status, _, body = s.get("/rollout/0/0/204")
        assert status == 200 and b"grown 199" in body
        assert b"205 rollouts" in s.get("/rollouts")[2]
        whole = json.dumps(row(900, 0, 1.0, answer="written in two steps"))
        with path.open("a") as f:  # a line still being written: not a row yet, and not a notice
            f.write(whole[:100])
        assert b"205 rollouts" in s.get("/rollouts")[2] and b"cannot be read" not in s.get("/")[2]
        with path.open("a") as f:
            f.write(whole[100:] + "\n")
        assert b"206 rollouts" in s.get("/rollouts")[2] and b"written in two steps" in s.get("/rollout/0/0/205")[2]
        path.write_text(json.dumps(row(0, 0, 1.0)) + "\nnot json at all\n")  # rewritten, now with a bad line
        status, _, body = s.get("/")
        assert status == 200 and b"out.jsonl:2: not JSON" in body
        assert s.get("/rollout/0/0/0")[0] == 200
        status, _, body = s.get("/rollout/0/0/1")
        assert status == 200 and b"cannot be read" in body
        path.unlink()  # gone
        status, _, body = s.get("/")
        assert status == 200 and b"no such file" in body
        assert s.get("/rollout/0/0/0")[0] in (200, 404)


def test_diff_escapes_the_control_characters_of_rows(tmp_path: Path) -> None:
    esc = "\x1b]0;owned\x07\x1b[2J\x1b[31m\x9b31m\u202e"
    a = [row(t, 0, 1.0, agent="agent" + esc) for t in range(3)]
    b = [row(t, 0, 0.0, agent="agent" + esc) for t in range(2)]
    for r in b:
        r["provenance"]["parts"] = {"agent" + esc: "x", "model.p" + esc: "y"}
        r["provenance"]["grader"] = "judge" + esc
    fa = write(tmp_path / "a.jsonl", a)
    fb = write(tmp_path / "b.jsonl", b, [failure(2, 0, "timeout" + esc)])
    fb.with_name("b_failures.jsonl").write_text(
        json.dumps({**failure(2, 0, "timeout" + esc), "agent_ref": {"name": "agent" + esc}}) + "\n"
    )
    for argv in ([], ["--all"], ["--json"]):
        out = cli("diff", str(fa), str(fb), *argv)
        assert out.returncode == 0, out.stderr
        for ch in ("\x1b", "\x07", "\x9b", "\u202e"):
            assert ch not in out.stdout and ch not in out.stderr, (argv, ch)
        assert "\\x1b" in out.stdout or "\\u001b" in out.stdout
