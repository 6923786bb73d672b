"""Issue 67: what a new user still tripped on (round 6), each tried as that user would: the trainer script as a script,
the CLI as a subprocess, against a real nats-server (or a port nothing listens on) and real files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from tests.e2e.test_new_user_edges import Tail, assert_one_line, popen_cli, signal_and_wait, wait_for
from tests.helpers import REPO, WEATHER, cli, read_jsonl

ROWS = REPO / "resources/weather/data/example.jsonl"


def test_a_sync_client_with_a_wrong_config_path_raises_and_the_script_exits(tmp_path: Path) -> None:
    """Item 2: the ConfigError printed, then the interpreter waited for ever in the portal's thread at shutdown."""
    script = tmp_path / "train.py"
    script.write_text('from gym_runtime import SyncClient\n\nwith SyncClient("wrong/path.yaml") as client:\n    pass\n')
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr  # the exception's exit, not a hang the timeout would end
    assert "wrong/path.yaml" in res.stderr.splitlines()[-1], res.stderr


def test_a_trace_file_in_a_missing_folder_is_made_as_o_makes_its_folder(tmp_path: Path) -> None:
    """Item 8: `run` succeeded, then printed OpenTelemetry's FileNotFoundError tracebacks and wrote no spans."""
    trace = tmp_path / "traces/today/spans.jsonl"
    out = tmp_path / "out.jsonl"
    res = cli("run", str(WEATHER), "-i", str(ROWS), "-o", str(out), "--trace-file", str(trace), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "FileNotFoundError" not in res.stderr, res.stderr
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    assert spans and all("name" in s for s in spans)


def test_a_trace_file_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    trace = tmp_path / "afile/x.jsonl"
    res = cli("run", str(WEATHER), "-i", str(ROWS), "-o", str(tmp_path / "o.jsonl"), "--trace-file", str(trace))
    assert_one_line(res, f"--trace-file {tmp_path / 'afile/x.jsonl'}: {tmp_path / 'afile'} is a file, not a directory")
    assert not (tmp_path / "o.jsonl").exists()  # nothing ran


def test_run_refuses_an_output_over_its_input(tmp_path: Path) -> None:
    """Item 9: `run -i X -o X` overwrote the tasks with the rollouts without a word."""
    rows = tmp_path / "tasks.jsonl"
    rows.write_text(ROWS.read_text())
    res = cli("run", str(WEATHER), "-i", str(rows), "-o", str(tmp_path / "." / "tasks.jsonl"))
    assert_one_line(res, "is the input file (-i ", "it would be overwritten; give another -o, e.g. -o ")
    assert rows.read_text() == ROWS.read_text()  # the tasks untouched


def test_start_on_a_dead_bus_says_what_it_waits_for_and_what_to_do_then_that_it_still_waits(tmp_path: Path) -> None:
    """Item 12: one JSON warning at 8 s, then nothing for minutes. Now: the first names what to do, and the wait is
    said again at doubling intervals (8 s, then 16 s later), not once per try."""
    dead = f"nats://127.0.0.1:{free_port()}"
    proc = popen_cli("start", str(WEATHER), "--nats", dead, "--in-process")
    tail = Tail(proc.stderr)
    wait_for(lambda: '"nats.still_unreachable"' in tail.text(), 120, "the second notice")
    code, _ = signal_and_wait(proc, signal.SIGTERM, timeout=60)
    lines = [json.loads(line) for line in tail.all().splitlines() if line.startswith("{")]
    assert code == 0
    first = [x for x in lines if x.get("event") == "nats.unreachable"]
    again = [x for x in lines if x.get("event") == "nats.still_unreachable"]
    assert len(first) == 1 and len(again) == 1, lines  # not one per try (two tries a second)
    assert "`gym-runtime server`" in first[0]["hint"] and "--nats URL" in first[0]["hint"], first[0]
    assert again[0]["waited_s"] >= 20, again[0]  # 8 s, then 16 s after it


def dead_model_config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load(WEATHER.read_text())
    cfg["base_dir"] = str(WEATHER.parent)
    port = free_port()
    cfg["models"]["policy"] = {"adapter": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "model": "m"}
    path = tmp_path / "dead.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_dead_model_url_is_said_once_not_per_worker(tmp_path: Path) -> None:
    """Item 13: a JSON model.endpoint_unusable line per worker, then the command's line: now the line alone."""
    cfg = dead_model_config(tmp_path)
    res = cli("run", str(cfg), "-i", str(ROWS), "-o", str(tmp_path / "o.jsonl"), "--processes", "2")
    assert_one_line(res, "cannot connect to http://127.0.0.1:", "check models.policy.base_url and models.policy.model")
    assert "endpoint_unusable" not in res.stderr, res.stderr
    assert res.stderr.count("cannot connect") == 1, res.stderr  # the two workers' one cause, said once


def test_status_names_another_namespaces_workers_even_with_results_of_its_own(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Item 17: the hint came only when the default namespace was empty; with results there, another namespace's
    workers on the same server showed as `(none)`."""
    mine = tmp_path / "gym.yaml"
    cfg = yaml.safe_load(WEATHER.read_text()) | {"base_dir": str(WEATHER.parent), "nats": nats_server.url}
    mine.write_text(yaml.safe_dump(cfg))
    res = cli("run", str(mine), "-i", str(ROWS), "-o", str(tmp_path / "o.jsonl"), "--no-progress")
    assert res.returncode == 0, res.stderr  # results stored in namespace gym, its workers gone
    other = tmp_path / "exp.yaml"
    other.write_text(yaml.safe_dump(cfg | {"namespace": "exp"}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(other), "--in-process"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        status = cli("status", "--nats", nats_server.url)
    finally:
        proc.terminate()
        proc.wait(30)
    assert status.returncode == 0, status.stderr
    assert "namespace 'exp' has workers here: add --namespace exp" in status.stdout, status.stdout
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 5


def test_the_quick_start_writes_nothing_untracked_into_the_clone() -> None:
    """Item 15: the README's command left `out_batch.json` untracked in the repository's root."""
    readme = (REPO / "README.md").read_text()
    assert "-o runs/out.jsonl" in readme
    ignored = subprocess.run(
        ["git", "check-ignore", "runs/out.jsonl", "runs/out_batch.json", "out_batch.json"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert ignored.stdout.split() == ["runs/out.jsonl", "runs/out_batch.json", "out_batch.json"], ignored


def test_the_docs_give_one_python_floor_for_nemo_gym_07() -> None:
    """Item 15: >= 3.13.14 in one place, >= 3.13 in two others."""
    for page in ("docs/nemo-gym.md", "docs/trainer.md", "docs/sandboxes.md"):
        text = (REPO / page).read_text()
        assert "Python >= 3.13;" not in text and "Python >= 3.13 (" not in text, page
    assert "0.7 asks for Python >= 3.13.14" in (REPO / "docs/nemo-gym.md").read_text()


def test_the_image_build_line_says_it_needs_buildx_or_the_alternative() -> None:
    deployment = (REPO / "docs/deployment.md").read_text()
    block = deployment.split("## The image", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "buildx" in block and "DOCKER_BUILDKIT=1" in block, block
