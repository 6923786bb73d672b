"""A model endpoint that hangs or fails every call is taken out of service, its calls moved, and probed back in.

Two replicas of one HTTP model (``base_url: [a, b]``), each the vLLM emulator (``tests/stub_openai.py``, a test
double for the LLM) in its own process; ``gym-runtime run`` in its own. The faults are real: a SIGSTOPped server
(the kernel still accepts connections, nothing answers: a frozen generation server) and one that answers 500 to
every generation while it lists its models (NeMo RL #3488's). ``timeout_s`` is far longer than the bounds
checked, so what finds the hang is the watch of answers and probes, not the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, WEATHER, read_jsonl

ROWS = WEATHER.parent / "data/example.jsonl"
LONG_TIMEOUT_S = 600  # a long generation's bound: what a hang must not wait for


class Stub:
    """The emulator in its own process (``python tests/stub_openai.py``), so it can be stopped with a signal."""

    def __init__(self, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "stub_openai.py"), "--text", "It is cold.", *flags],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("http://"), self.url

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def stubs() -> Iterator[list[Stub]]:
    made: list[Stub] = []
    try:
        yield made
    finally:
        for stub in made:
            stub.close()


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    made: list[Run] = []
    try:
        yield made
    finally:
        for run in made:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(30)


class Run:
    """``gym-runtime run`` in its own process; its stderr read as it comes, each line with when it came."""

    def __init__(self, cfg: Path, rows: Path, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gym_runtime.cli", "run", str(cfg), "-i", str(rows), "-o", str(out)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def events(self, name: str) -> list[tuple[float, dict[str, object]]]:
        found = []
        for at, line in list(self.lines):
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == name:
                    found.append((at, event))
        return found

    def done(self) -> int:
        """Rollouts done by the last progress line (``run: K/N ...``): the rows file is written at the end."""
        for _, line in reversed(list(self.lines)):
            if line.startswith("run: "):
                return int(line[5:].split("/", 1)[0])
        return 0

    def rows(self) -> list[dict[str, object]]:
        return read_jsonl(self.out) if self.out.exists() else []

    def finish(self, within: float) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=within)
        self._reader.join(10)
        return self.proc.returncode, out

    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)[-4000:]


def config(tmp: Path, urls: list[str], **extra: object) -> Path:
    policy = {
        "adapter": "openai", "api": "chat", "base_url": urls, "model": "tiny", "timeout_s": LONG_TIMEOUT_S,
        "concurrency": 8, **extra,
    }  # fmt: skip
    cfg = {
        "namespace": "gym",
        "nats": "embedded",
        "models": {"policy": policy},
        "resources": {"weather": {"server": "resources.weather"}},
        "agents": {
            "weather_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather", "max_steps": 4}
        },
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(cfg))  # YAML is a superset of JSON
    return path


def many_rows(tmp: Path, n: int) -> Path:
    rows = ROWS.read_text().splitlines()
    path = tmp / "rows.jsonl"
    path.write_text("\n".join(rows[i % len(rows)] for i in range(n)) + "\n")
    return path


def until(holds: Callable[[], object], timeout: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not holds():
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        time.sleep(0.1)


def once_each(rows: list[dict[str, object]], n: int) -> None:
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
    assert len(rows) == n and len(set(keys)) == n, f"{len(rows)} rows, {len(set(keys))} distinct, of {n}"


def test_a_hung_endpoint_is_found_its_calls_moved_and_probed_back_in(
    stubs: list[Stub], runs: list[Run], tmp_path: Path
) -> None:
    """SIGSTOP one of two replicas mid-batch: named in one line within 30 s (not after the 600 s timeout), its
    calls served by the other within 60 s, every row once and none failed; SIGCONT: probed back in."""
    a, b = Stub("--latency", "0.5"), Stub("--latency", "0.5")
    stubs += [a, b]
    n = 400
    run = Run(config(tmp_path, [a.url, b.url]), many_rows(tmp_path, n), tmp_path / "out.jsonl")
    runs.append(run)
    until(lambda: run.done() >= 5, timeout=240, what=lambda: f"rollouts before the fault: {run.stderr()}")
    a.signal(signal.SIGSTOP)
    frozen_at, rows_then = time.monotonic(), run.done()
    until(lambda: run.events("model.endpoint_out"), timeout=120, what=lambda: f"the hang named: {run.stderr()}")
    [(found_at, said)] = run.events("model.endpoint_out")
    found_s = found_at - frozen_at
    assert said["endpoint"] == a.url, said
    assert found_s < 30, f"found {found_s:.1f} s after the freeze"
    # worked around: rollouts keep ending (on the other replica) while the first is still stopped
    until(lambda: run.done() >= rows_then + 20, timeout=120, what=lambda: f"rollouts after: {run.stderr()}")
    moved_s = time.monotonic() - frozen_at
    assert moved_s < 60, f"rows came again {moved_s:.1f} s after the freeze"
    a.signal(signal.SIGCONT)
    thawed_at = time.monotonic()
    until(lambda: run.events("model.endpoint_back"), timeout=120, what=lambda: f"probed back: {run.stderr()}")
    [(back_at, back)] = run.events("model.endpoint_back")
    assert back["endpoint"] == a.url, back
    code, _ = run.finish(within=300)
    assert code == 0, run.stderr()
    rows = run.rows()
    once_each(rows, n)
    assert not [r for r in rows if r.get("error")], [r.get("error") for r in rows if r.get("error")][:3]
    assert len(run.events("model.endpoint_out")) == 1, run.stderr()
    print(f"found {found_s:.1f} s, rows again by {moved_s:.1f} s, back {back_at - thawed_at:.1f} s after SIGCONT")


def test_a_slow_endpoint_that_answers_probes_is_never_taken_out(
    stubs: list[Stub], runs: list[Run], tmp_path: Path
) -> None:
    """Every generation takes 3 times ``stall_s`` on one replica (its server lists its models at once): probed,
    found alive, never out; every row once, none failed."""
    slow, fast = Stub("--latency", "15"), Stub("--latency", "0.2")
    stubs += [slow, fast]
    n = 12
    run = Run(config(tmp_path, [slow.url, fast.url], stall_s=5, concurrency=4), many_rows(tmp_path, n), tmp_path / "o")
    runs.append(run)
    code, _ = run.finish(within=600)
    assert code == 0, run.stderr()
    once_each(run.rows(), n)
    assert not run.events("model.endpoint_out"), run.stderr()
