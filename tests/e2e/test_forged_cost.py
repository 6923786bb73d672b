"""Costs and provenance come from the workers that did the work (issue 52, item 5).

The attack: a native environment set its session's model cost (``self.models.cost``) to minus a billion
tokens; the row showed -999,999,986 input tokens, and under ``--budget 40tokens`` the honest environment ran
1 of 8 rows while the forging one ran 8 of 8 (negative counts were skipped, the mean became 0, and a mean of 0
admitted everything). It also named an image it never ran in ``provenance.images``/``image_ids``.

Now the resource worker reads a session's cost and images from the model client and lease it made (the
model workers' usage, the sandbox workers' answers), which the environment's code can read but not set; and
no negative or unknown count lowers a budget. Real nats-server, the real ``gym-runtime run`` in a subprocess,
real workers; the only double is the policy LLM, whose token counts per call are fixed (20 + 7).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import ROWS, cli, read_jsonl, write_jsonl
from tests.stub_openai import RecordedRequest, StubOpenAI, StubReply, responses_reply

N_TASKS = 8
INPUT, OUTPUT = 20, 7


def fixed(_: RecordedRequest) -> StubReply:
    return StubReply(body=responses_reply(input_tokens=INPUT, output_tokens=OUTPUT))


def write_config(tmp_path: Path, base_url: str, server: str, isolation: str = "none") -> Path:
    raw: dict[str, Any] = {
        "namespace": "gym",
        "nats": "embedded",
        "models": {"policy": {"adapter": "openai", "base_url": base_url, "api_key": "test", "model": "p"}},
        "resources": {"weather": {"server": server, "isolation": isolation}},
        "agents": {"weather_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather"}},
    }
    path = tmp_path / f"{server.rsplit('.', 1)[-1]}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("server", "isolation"),
    [("resources.weather", "none"), ("tests.envs.cost_forger", "none"), ("tests.envs.cost_forger", "process")],
)
def test_an_environment_cannot_forge_its_cost_past_a_token_budget(
    nats_server, tmp_path: Path, server: str, isolation: str
) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [ROWS[i % len(ROWS)] for i in range(N_TASKS)])
    out = tmp_path / "out.jsonl"
    with StubOpenAI(handler=fixed) as stub:
        config = write_config(tmp_path, stub.base_url, server, isolation)
        args = ("run", str(config), "-i", str(tasks), "-o", str(out), "--nats", nats_server.url, "--quiet")
        batch = f"{server.replace('.', '_')}_{isolation}"
        r = cli(*args, "--batch", batch, "--processes", "one", "--budget", "40tokens", timeout=300)
    # 27 tokens a rollout: the first runs alone, then 27 + 27 > 40: nothing more starts (before, the forger: 8 of 8)
    assert r.returncode == 1 and "budget reached: 27 tokens of the budget's 40 tokens spent" in r.stderr, r.stderr
    (row,) = read_jsonl(out)
    assert row["cost"]["models"]["policy"] == {"calls": 1, "input_tokens": INPUT, "output_tokens": OUTPUT} | {
        k: v for k, v in row["cost"]["models"]["policy"].items() if k.endswith("_ms")
    }
    # an image it never ran is named nowhere (before: provenance.images ["forged:image"])
    assert "images" not in row["provenance"] and "image_ids" not in row["provenance"], row["provenance"]


def no_usage(_: RecordedRequest) -> StubReply:
    body = responses_reply(input_tokens=INPUT, output_tokens=OUTPUT)
    body.pop("usage")
    return StubReply(body=body)


def test_a_token_budget_refuses_a_model_that_reports_no_usage_in_one_line(nats_server, tmp_path: Path) -> None:
    """Before: the calls counted 0 tokens, so the budget's estimate was 0 and it admitted every rollout."""
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [ROWS[i % len(ROWS)] for i in range(N_TASKS)])
    out = tmp_path / "out.jsonl"
    with StubOpenAI(handler=no_usage) as stub:
        config = write_config(tmp_path, stub.base_url, "resources.weather")
        args = ("run", str(config), "-i", str(tasks), "-o", str(out), "--nats", nats_server.url, "--quiet")
        r = cli(*args, "--batch", "nousage", "--processes", "one", "--budget", "1000tokens", timeout=300)
    said = [line for line in r.stderr.splitlines() if "budget" in line]
    assert r.returncode == 1 and len(said) == 1, r.stderr
    assert "model entry 'policy' reported no token usage and returned no token ids" in said[0], said
    assert len(read_jsonl(out)) == 1 and "7 of 8 rollouts not started" in said[0]
