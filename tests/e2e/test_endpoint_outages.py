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

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO, WEATHER, cli, read_jsonl

ROWS = WEATHER.parent / "data/example.jsonl"
LONG_TIMEOUT_S = 600  # a long generation's bound: what a hang must not wait for
IN_FLIGHT = 16  # rollouts at once (``run --concurrency``) where the run is to stop


class Stub:
    """The emulator in its own process (``python tests/stub_openai.py``), so it can be stopped with a signal."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "stub_openai.py"), "--text", "It is cold.", *flags],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("http://"), self.url

    def restart(self, *flags: str) -> None:
        """The same port served again with other flags (a server fixed, or broken, and started again)."""
        port = self.url.split(":")[2].split("/")[0]
        self.close()
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "stub_openai.py"), "--text", "It is cold.", "--port", port, *flags],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == self.url

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

    def __init__(self, cfg: Path, rows: Path, out: Path, *flags: str) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gym_runtime.cli", "run", str(cfg), "-i", str(rows), "-o", str(out), *flags],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
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

    def finish(self, within: float) -> int:
        code = self.proc.wait(timeout=within)
        self._reader.join(30)  # every line read (the reader owns stderr)
        return code

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
    code = run.finish(within=300)
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
    code = run.finish(within=600)
    assert code == 0, run.stderr()
    once_each(run.rows(), n)
    assert not run.events("model.endpoint_out"), run.stderr()


def failures(out: Path) -> list[dict[str, object]]:
    path = out.with_name(out.stem + "_failures.jsonl")
    return read_jsonl(path) if path.exists() else []


def test_an_endpoint_answering_only_500s_is_taken_out_and_back_in(
    stubs: list[Stub], runs: list[Run], tmp_path: Path
) -> None:
    """One replica restarted mid-batch as a server that answers 500 to every generation (it still lists its
    models): out after ``out_after`` failed calls, named in one line; its calls answered by the other; fixed and
    started again, one trial call brings it back. Every row once, none failed."""
    a, b = Stub("--latency", "0.5"), Stub("--latency", "0.5")
    stubs += [a, b]
    n = 400
    out = tmp_path / "out.jsonl"
    run = Run(config(tmp_path, [a.url, b.url], replica_cooldown_s=2), many_rows(tmp_path, n), out)
    runs.append(run)
    until(lambda: run.done() >= 5, timeout=240, what=lambda: f"rollouts before the fault: {run.stderr()}")
    a.restart("--latency", "0.5", "--status", "500")
    broken_at = time.monotonic()
    until(lambda: run.events("model.endpoint_out"), timeout=120, what=lambda: f"the errors named: {run.stderr()}")
    [(found_at, said)] = run.events("model.endpoint_out")
    assert said["endpoint"] == a.url and "calls failed in a row" in str(said["cause"]), said
    assert found_at - broken_at < 30, f"found {found_at - broken_at:.1f} s after the fault"
    a.restart("--latency", "0.5")
    fixed_at = time.monotonic()
    until(lambda: run.events("model.endpoint_back"), timeout=120, what=lambda: f"back in: {run.stderr()}")
    [(back_at, back)] = run.events("model.endpoint_back")
    assert back["endpoint"] == a.url, back
    code = run.finish(within=300)
    assert code == 0, run.stderr()
    once_each(run.rows(), n)
    assert not failures(out)
    assert len(run.events("model.endpoint_out")) == 1, run.stderr()
    print(f"found {found_at - broken_at:.1f} s after the fault, back {back_at - fixed_at:.1f} s after the fix")


def test_with_every_endpoint_answering_500s_the_run_stops_with_one_line(
    stubs: list[Stub], runs: list[Run], tmp_path: Path
) -> None:
    """Both replicas answer 500 to every generation: each is out after ``out_after`` failed calls, and the run
    stops its batch at once with one line naming both and their errors, instead of failing 400 rollouts in
    turn: those in flight then fail on the model, the rest are cancelled. Every row once, each attributed to
    infrastructure."""
    a, b = Stub("--status", "500"), Stub("--status", "500")
    stubs += [a, b]
    n = 400
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    run = Run(config(tmp_path, [a.url, b.url]), many_rows(tmp_path, n), out, "--concurrency", str(IN_FLIGHT))
    runs.append(run)
    code = run.finish(within=300)
    took = time.monotonic() - t0
    assert code == 1, run.stderr()
    last = [line for _, line in run.lines if line.strip()][-1]
    assert last.startswith("gym-runtime: error: model 'policy': every endpoint is out of service ("), last
    assert a.url in last and b.url in last and last.count("HTTP 500") == 2, last
    errors = [line for _, line in run.lines if line.startswith("gym-runtime: error")]
    assert errors == [last], errors
    rows, failed = run.rows(), failures(out)
    assert not rows
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in failed]
    assert len(keys) == n and len(set(keys)) == n, (len(keys), len(set(keys)))
    classes = {str(r.get("error_class")) for r in failed}
    assert classes <= {"model_error", "cancelled"}, classes
    on_model = [r for r in failed if r.get("error_class") == "model_error"]
    assert len(on_model) <= 2 * IN_FLIGHT, f"{len(on_model)} rollouts failed on the model before the run stopped"
    assert {r.get("failure_attribution") for r in failed} == {"infrastructure"}, failed[0]
    print(f"stopped after {took:.1f} s; {len(on_model)} rollouts failed on the model, the rest cancelled")


def test_with_every_endpoint_out_a_run_with_worker_children_stops_with_one_line(
    stubs: list[Stub], runs: list[Run], tmp_path: Path
) -> None:
    """As above, the model workers in ``run``'s children (``--processes per-role``, what ``auto`` picks for a large
    batch on several cores): the run reads their status answers (every 2 s, and at once on a failure row) and stops
    the batch in one line. Before, only a model worker in ``run``'s own process stopped it: here each of the 1,500
    rollouts failed on the model in turn; with the look every 2 s alone, all 1,500 failed between two looks."""
    a, b = Stub("--status", "500"), Stub("--status", "500")
    stubs += [a, b]
    n = 1500
    out = tmp_path / "out.jsonl"
    run = Run(config(tmp_path, [a.url, b.url]), many_rows(tmp_path, n), out, "--concurrency", str(IN_FLIGHT),
              "--processes", "per-role")  # fmt: skip
    runs.append(run)
    assert run.finish(within=300) == 1, run.stderr()
    errors = [line for _, line in run.lines if line.startswith("gym-runtime: error")]
    assert len(errors) == 1, errors
    assert errors[0].startswith("gym-runtime: error: model 'policy': every endpoint is out of service ("), errors
    failed = failures(out)
    once_each(failed, n)
    classes = {str(r.get("error_class")) for r in failed}
    assert classes <= {"model_error", "cancelled"} and "cancelled" in classes, classes


def test_with_every_endpoint_out_a_collect_of_start_ed_workers_stops_the_batch_and_says_they_keep_running(
    stubs: list[Stub], nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """``publish`` against workers ``start`` runs, both replicas answering 500 to every generation: ``collect``
    (the command that waits on the batch) stops it once the model's workers say every endpoint is out, in one
    line that names them and says the workers keep running (``start``'s, not its own to stop) and how to stop
    them. Before, each rollout failed in turn on the model: a ``model_error`` row each, no line, no stop."""
    a, b = Stub("--status", "500"), Stub("--status", "500")
    stubs += [a, b]
    n = 2000  # at 1,000 and a look every 2 s all had failed before one (quiet machine); looking at once: 417-773
    cfg, out = config(tmp_path, [a.url, b.url]), tmp_path / "out.jsonl"
    start = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(cfg), "--nats", nats_server.url, "--in-process"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert start.stdout is not None and "ready" in start.stdout.readline()
        t0 = time.monotonic()
        collect = subprocess.Popen(  # waiting on the batch as it is published (`publish ... && collect` may come late)
            [sys.executable, "-m", "gym_runtime.cli", "collect", "--batch", "out1", "--nats", nats_server.url,
             "-o", str(out), "--no-progress", "--wait", "120"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        published = cli("publish", str(cfg), "-i", str(many_rows(tmp_path, n)), "--nats", nats_server.url,
                        "--batch", "out1", timeout=300)  # fmt: skip
        assert published.returncode == 0, published.stderr
        _, stderr = collect.communicate(timeout=300)
        took = time.monotonic() - t0
        assert collect.returncode == 1, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("gym-runtime: error")]
        assert len(errors) == 1, stderr[-3000:]
        line = errors[0]
        assert line.startswith("gym-runtime: error: model 'policy': every endpoint is out of service ("), line
        assert a.url in line and b.url in line and "the batch was stopped" in line, line
        assert f"keep running (process {os.uname().nodename}/{start.pid})" in line and "gym-runtime start" in line
        failed = failures(out)
        once_each(failed, n)
        classes = {str(r.get("error_class")) for r in failed}
        assert classes <= {"model_error", "cancelled"} and "cancelled" in classes, classes
        assert start.poll() is None  # as the line says: they keep running
        on_model = sum(r.get("error_class") == "model_error" for r in failed)
        print(f"collect stopped the batch {took:.1f} s after the publish began; {on_model} of {n} failed on the model")
    finally:
        start.send_signal(signal.SIGTERM)
        try:
            start.wait(60)
        except subprocess.TimeoutExpired:
            start.kill()
            start.wait()
