"""A command that reads the default namespace (``gym``) on a server whose work is in another one says where it is:
``status`` names the namespaces on the server, ``collect`` and ``explain`` the one that holds the batch, each as
the ``--namespace`` to add. The batch is published by the real CLI on a real nats-server (no worker: its tasks
wait in the queue)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import WEATHER, cli

ROWS = WEATHER.parent / "data/example.jsonl"


@pytest.fixture
def published(nats_server: EmbeddedServer, tmp_path: Path) -> str:
    cfg = yaml.safe_load(WEATHER.read_text())
    cfg["namespace"] = "exp"
    cfg["base_dir"] = str(WEATHER.parent)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = cli("publish", str(path), "-i", str(ROWS), "--nats", nats_server.url, "--batch", "b1", "--quiet")
    assert res.returncode == 0, res.stderr
    return nats_server.url


def one_line(res: object) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]  # type: ignore[attr-defined]
    assert len(lines) == 1 and "Traceback" not in lines[0], res.stderr  # type: ignore[attr-defined]
    return lines[0]


def test_status_names_the_namespaces_on_the_server(published: str) -> None:
    res = cli("status", "--nats", published)
    assert res.returncode == 0, res.stderr
    assert "(none: namespace 'exp' is on this server: add --namespace exp)" in res.stdout, res.stdout
    there = cli("status", "--nats", published, "--namespace", "exp")
    assert "add --namespace" not in there.stdout and "namespace exp" in there.stdout, there.stdout


def test_collect_and_explain_name_the_namespace_that_holds_the_batch(published: str, tmp_path: Path) -> None:
    for argv in (
        ["collect", "--batch", "b1", "-o", str(tmp_path / "out.jsonl"), "--nats", published],
        ["explain", "b1", "0", "--nats", published],
    ):
        res = cli(*argv)
        assert res.returncode == 2, res.stderr
        line = one_line(res)
        assert "no batch 'b1' in namespace 'gym'" in line and "namespace 'exp' holds it: add --namespace exp" in line


def test_a_batch_no_namespace_holds_is_told_how_to_name_one(published: str) -> None:
    res = cli("explain", "nope", "0", "--nats", published)
    assert res.returncode == 2, res.stderr
    assert "--namespace NAME reads another namespace" in one_line(res)
